"""Run by test_tensor_parallel.py in a process of its own: every served value of a checkpoint, an edit and a skip.

    python tensor_parallel_run.py PROMPT DTYPE TENSOR_PARALLEL_SIZE:CHECKPOINT [TENSOR_PARALLEL_SIZE:CHECKPOINT ...]

Starts one engine after another, one for each TENSOR_PARALLEL_SIZE:CHECKPOINT (each in the environment this
process started with, and each closed before the next starts; its engine core and ranks are processes of their
own), so that this process's imports are paid once for all of them. Prints a line for each engine, in order:
``RESULT {json}``, each value as a nested list, keyed ``name`` (root) or ``i.name``; or ``FAILED {json}``, the
engine's traceback, and goes on with the next.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # tensor parallelism runs its ranks in processes of their own

import torch  # noqa: E402

import streamscope  # noqa: E402

ROOT = ("token_embeddings", "final_norm_output", "prompt_logits", "logits")
GREEDY = {"temperature": 0.0, "max_tokens": 1}


def value(model, name: str):
    """The value `name` (``i.dotted.name`` for block i, or a root name)."""
    block, _, rest = name.partition(".")
    if not block.isdigit():
        return getattr(model, name)
    return functools.reduce(getattr, rest.split("."), model.layers[int(block)])


def run(path: str, tensor_parallel_size: int, prompt: str, dtype: str = "float32") -> dict:
    """Every value of `path`'s engine over `tensor_parallel_size` ranks, an edit and a skip; the engine is closed."""
    model = streamscope.load(path, engine="vllm", dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                             **({"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 1 << 30} if torch.cuda.is_available() else {}))
    try:
        return read(model, prompt)
    finally:
        model.close()


def read(model, prompt: str) -> dict:
    names = list(ROOT)
    for block in range(model.num_layers):  # every value the client's support table says the engine serves
        names += [f"{block}.{row}" for row, reason in model.layers[block].support().rows.items() if reason is None]
    result = {}
    for name in names:  # one trace a value: no value is read after the model passed it
        with model.trace(prompt, **GREEDY):
            read = value(model, name).float().cpu().save()
        result[name] = read.tolist()
    last = model.num_layers - 1
    vector = torch.linspace(-1.0, 1.0, model.hidden_size)
    with model.trace(prompt, **GREEDY):
        heads = model.layers[0].self_attn.head_outputs
        heads[:, :, -1] = 0  # the last head: on the last rank
        mid = model.layers[last].layer_mid
        mid[:, -1] += vector.to(device=mid.device, dtype=mid.dtype)  # the trace runs in the worker, by the GPU
        edited = model.logits.float().cpu().save()
    result["edited logits"] = edited.tolist()
    if model.layers[0].support()["mlp.neurons_pre"] is None:
        with model.trace(prompt, **GREEDY):
            gates = model.layers[0].mlp.neurons_pre
            gates[:, -1, -4:] += 3.0  # the last neurons' gates: in the last rank's half of its fused shard
            neurons = model.layers[0].mlp.neurons
            neurons[:, -1, :4] = 0  # the first neurons: on the first rank
            edited = model.logits.float().cpu().save()
        result["neurons edited logits"] = edited.tolist()
    if model.layers[0].support()["self_attn.head_results"] is None:
        with model.trace(prompt, **GREEDY):
            results = model.layers[0].self_attn.head_results
            results[:, :, -1] *= 10.0  # the last head's result: its rank's heads, added once to the reduced output
            edited = model.logits.float().cpu().save()
        result["head result edited logits"] = edited.tolist()
        # The bulk path: each rank's heads' results at the harvested rows, joined in head order.
        harvest = model.harvest([prompt], "self_attn.head_results", positions="all", progress=False)
        result["harvested head_results"] = harvest["self_attn.head_results"][0].float().tolist()
    # The per-block projections a workflow reads off the worker (TransformerLens's W_O and W_out).
    for kind, weights in (("output projection", model.engine.output_projections()),
                          ("down projection", model.engine.down_projections())):
        for block, weight in enumerate(weights):
            if not isinstance(weight, str):
                result[f"{block}.{kind}"] = weight.tolist()
    # Three invokes in one trace, each its own edit: their interventions pickled once, together, and sent to every
    # rank ahead of the requests (`streamscope.vllm.trace_transport.bundle_interventions`).
    received = [counts["received"] for counts in model.vllm_entrypoint.collective_rpc("streamscope_bundle_counts")]
    with model.trace(**GREEDY) as tracer:
        for scale in (1.0, -1.0, 2.0):
            with tracer.invoke(prompt):
                mid = model.layers[last].layer_mid
                mid[:, -1] += scale * vector.to(device=mid.device, dtype=mid.dtype)
                invoked = model.logits.float().cpu().save()
    result["invokes' edited logits"] = [logits.tolist() for logits in invoked]
    result["bundles received"] = [counts["received"] - before for counts, before in
                                  zip(model.vllm_entrypoint.collective_rpc("streamscope_bundle_counts"), received)]
    with model.trace(prompt, **GREEDY):
        model.layers[0].skip(model.layers[0].layer_input)
        skipped = model.logits.float().cpu().save()
    result["skipped logits"] = skipped.tolist()
    return result


def main(prompt: str, dtype: str, *engines: str) -> None:
    environment = dict(os.environ)
    for engine in engines:
        size, _, path = engine.partition(":")
        os.environ.clear()  # what an earlier engine set here (streamscope's CPU binding of its ranks) is not kept
        os.environ.update(environment)
        try:
            line = "RESULT " + json.dumps(run(path, int(size), prompt, dtype))
        except Exception:  # noqa: BLE001  (reported for its engine's test; the next engine still runs)
            line = "FAILED " + json.dumps(traceback.format_exc())
        print(line, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
