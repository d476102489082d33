"""streamscope over HTTP: vLLM's own OpenAI-compatible server, steered and harvested by streamscope's names.

``streamscope serve PATH [--taps ...] [vllm serve options]`` (`server`) runs
vLLM's server with streamscope's worker in the engine. A request's steers and
harvest travel as declarative JSON in its ``streamscope`` field (`protocol`),
are applied in the worker to that request's token rows (`worker`), and
harvests wait in a folder for download (`storage`). `streamscope.Client`
(`client`) speaks to it with the in-process engines' signatures and types.
"""
