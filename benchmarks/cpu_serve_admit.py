"""The host time of a server's prefill step that admits new steered requests (`ServeState.observe`), on this CPU.

Each request a ``streamscope serve`` worker sees for the first time is admitted in the step that runs its prompt:
its plan read from the JSON the front end wrote (`serve.forwarding.worker_payload`), its steers' entries made
(`ServeState.admitted_steers`), and what the graph ops serve of it entered into their plan
(`vllm.graph_backend.GraphBackend.enter`), before the step's fill. This times that on an in-process engine started
as ``--graph-ops`` starts the server's (its CPU worker inserting the ops at load; a tiny Llama of `--blocks`
blocks), with the scheduler's output written out by hand: each step admits `--arriving` requests of 64 prompt
tokens, each with a steer at every block, and the requests of the step before finish. It prints the median
microseconds a request, for two workloads:

  one-vector   every request the same vector (what requests sending the same steers share)
  own-vector   each request a vector of its own (a sweep over 256 directions)

    python benchmarks/cpu_serve_admit.py                   # this checkout
    python benchmarks/cpu_serve_admit.py --profile FILE    # and cProfile's stats of the own-vector steps
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: The tiny shape: blocks as the 8B shape has (a request's entry is per block), a narrow stream.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 512}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--arriving", type=int, default=8, help="requests admitted a step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile", default=None, help="write cProfile's stats of the own-vector steps here")
    options = parser.parse_args()

    import torch
    from transformers import LlamaConfig
    from vllm import LLM

    from streamscope.serve.protocol import Checked
    from streamscope.serve.forwarding import worker_payload
    from streamscope.serve.protocol import XARG, vector_bytes
    from streamscope.serve.worker import GRAPH_WORKERS, ServeState
    from streamscope.testing.tokenizer import save_tokenizer
    from streamscope.vllm.graph_backend import RUNNER_ATTRIBUTE, engine_config, graph_ops_of

    with tempfile.TemporaryDirectory() as folder:
        LlamaConfig(**TINY, num_hidden_layers=options.blocks, bos_token_id=0, eos_token_id=1,
                    pad_token_id=2).save_pretrained(folder)
        save_tokenizer(Path(folder), vocab_size=TINY["vocab_size"])
        llm = LLM(folder, load_format="dummy", dtype="float32", enforce_eager=True, enable_prefix_caching=False,
                  max_model_len=256, worker_cls=GRAPH_WORKERS["cpu"],
                  additional_config=engine_config({"slots": 4 * options.arriving}, None))
        model_runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        runner = SimpleNamespace(get_model=model_runner.get_model, model_config=model_runner.model_config,
                                 execute_model=lambda *args, **kwargs: None, _update_states=lambda output: None,
                                 input_batch=SimpleNamespace(req_ids=[]), requests={})
        runner.__dict__[RUNNER_ATTRIBUTE] = graph_ops_of(model_runner)
        state = ServeState(runner, "llama", folder=None, writer=False, hooks_fire=False)
        generator = torch.Generator().manual_seed(0)
        shared = vector_bytes(torch.randn(TINY["hidden_size"], generator=generator))

        def payload(vector: str) -> str:
            steers = [{"value": "layer_output", "layer": layer, "vector": vector, "scale": 4.0,
                       "positions": "all_but_first", "mode": "add", "generated": True}
                      for layer in range(options.blocks)]
            return worker_payload(Checked(steer_payload=steers, harvest=None), None)

        def request(request_id: str, plan: str) -> Any:
            return SimpleNamespace(req_id=request_id, prompt_token_ids=list(range(64)),
                                   sampling_params=SimpleNamespace(extra_args={XARG: plan}))

        results: dict[str, list[float]] = {}
        number = 0
        for workload in ("one-vector", "own-vector"):
            times: list[float] = []
            last: list[str] = []
            profiler = cProfile.Profile() if options.profile and workload == "own-vector" else None
            for step in range(options.steps + 2):  # the first two warm up
                arriving = []
                for _ in range(options.arriving):
                    number += 1
                    vector = shared if workload == "one-vector" else vector_bytes(
                        torch.randn(TINY["hidden_size"], generator=generator))
                    arriving.append(request(f"r{number}", payload(vector)))
                for data in arriving:
                    runner.requests[data.req_id] = SimpleNamespace(num_computed_tokens=0)
                for request_id in last:
                    runner.requests.pop(request_id, None)
                runner.input_batch.req_ids = [data.req_id for data in arriving]
                output = SimpleNamespace(scheduled_new_reqs=arriving, finished_req_ids=set(last),
                                         num_scheduled_tokens={data.req_id: 64 for data in arriving},
                                         total_num_scheduled_tokens=64 * len(arriving))
                if profiler is not None and step >= 2:
                    profiler.enable()
                start = time.perf_counter()
                state.observe(output)
                elapsed = time.perf_counter() - start
                if profiler is not None:
                    profiler.disable()
                if step >= 2:
                    times.append(elapsed / len(arriving))
                for data in arriving:
                    runner.requests[data.req_id].num_computed_tokens = 64
                last = [data.req_id for data in arriving]
            results[workload] = times
            if profiler is not None:
                profiler.dump_stats(options.profile)
            runner.requests.clear()
            state.observe(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set(last), num_scheduled_tokens={},
                                          total_num_scheduled_tokens=0))
        del llm
    print(f"cpu_serve_admit.py: {options.blocks} blocks, a steer at every block, {options.arriving} requests "
          f"admitted a step of 64-token prompts, median us a request over {options.steps} steps:")
    for workload, times in results.items():
        print(f"  {workload}: {statistics.median(times) * 1e6:.0f}")


if __name__ == "__main__":
    main()
