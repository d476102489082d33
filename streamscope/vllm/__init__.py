"""streamscope on vLLM: nnsight's ``VLLM`` engine, made to run on a CPU-only host.

See [`streamscope.vllm.worker`][streamscope.vllm.worker] for the CPU worker and
the engine arguments that select it.
"""
