"""Run by test_pipeline_parallel.py in a process of its own: a bulk harvest and a steered generation.

    python pipeline_parallel_run.py CHECKPOINT PIPELINE_PARALLEL_SIZE OUT BIND [CHECKPOINT PIPELINE_PARALLEL_SIZE OUT BIND ...]

Saves (torch.save) to OUT: every bulk value at every block of a few prompts, a generation steered on the
first and the last block with a harvest along and its logits, and what a trace and support() say. Each
CHECKPOINT's engine starts after the last one closed (its stages are processes of their own), in the
environment this process started with and VLLM_CPU_OMP_THREADS_BIND=BIND where BIND is not empty, so that
this process's imports are paid once for all of them. An engine that fails leaves its traceback in
OUT.failed instead, and the next one still runs.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # pipeline stages run as processes of their own

import torch  # noqa: E402

import streamscope  # noqa: E402
from streamscope.bulk.spec import row_width, value_names  # noqa: E402

PROMPTS = ["The Eiffel Tower is in Paris", "A quick brown fox jumps over", "Hello"]


def served(model) -> list[str]:
    """The bulk values this family serves on every block (and the root values)."""
    from streamscope.bulk.spec import locate

    names = []
    for name in value_names():
        try:
            locate(model, name, None if name in ("token_embeddings", "final_norm_output") else 0)
        except Exception:  # noqa: BLE001  (a value the family's blocks do not serve)
            continue
        names.append(name)
    return names


def run(path: str, size: int, out: str) -> None:
    gpu = {"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 1 << 30} if torch.cuda.is_available() else {}
    model = streamscope.load(path, engine="vllm", pipeline_parallel_size=size,
                             dtype=os.environ.get("STREAMSCOPE_TEST_DTYPE", "float32"), **gpu)
    try:
        result: dict = {"support": str(model.support())}
        names = served(model)
        # One harvest's values share one width: the MLP's neurons (intermediate_size wide) and head_results
        # ([heads, hidden_size] a row) go in harvests of their own.
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(row_width(name), []).append(name)
        result["harvest"] = {}
        for group in groups.values():
            harvest = model.harvest(PROMPTS, group, positions="all", progress=False)
            result["harvest"].update({name: harvest[name] for name in group})
        width, last = model.hidden_size, model.num_layers - 1
        generator = torch.Generator().manual_seed(0)
        steers = [streamscope.Steer("layer_output", layer=0, vector=torch.randn(width, generator=generator), scale=2.0),
                  streamscope.Steer("mlp_output", layer=last, vector=torch.randn(width, generator=generator),
                                    positions="last", prompts=[1])]
        generation = model.generate(PROMPTS, max_tokens=4, steer=steers, return_logits=True, progress=False,
                                    harvest={"values": ["layer_output", "final_norm_output"], "positions": "all"})
        result["bare_logits"] = model.generate(PROMPTS, max_tokens=4, steer=[], return_logits=True,
                                               progress=False).logits
        result["tokens"] = generation.tokens
        result["logits"] = generation.logits
        result["generated_harvest"] = {name: generation.harvest[name] for name in generation.harvest.keys()}
        result["plain"] = model.generate(PROMPTS, max_tokens=4, return_logits=True, progress=False).logits
        try:
            with model.trace(PROMPTS[0]):
                model.layers[0].layer_output.save()
            result["trace"] = "ran"
        except NotImplementedError as error:
            result["trace"] = str(error)
        try:
            with model.generate(PROMPTS[0], max_tokens=2):
                model.layers[0].layer_output.save()
            result["traced_generate"] = "ran"
        except NotImplementedError as error:
            result["traced_generate"] = str(error)
        torch.save(result, out)
    finally:
        model.close()


def main(*engines: str) -> None:
    environment = dict(os.environ)
    for index in range(0, len(engines), 4):
        path, size, out, bind = engines[index:index + 4]
        os.environ.clear()  # what an earlier engine set here is not kept
        os.environ.update(environment, **({"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {}))
        try:
            run(path, int(size), out)
        except Exception:  # noqa: BLE001  (reported for its engine's test; the next engine still runs)
            with open(out + ".failed", "w") as failed:
                failed.write(traceback.format_exc())


if __name__ == "__main__":
    main(*sys.argv[1:])
