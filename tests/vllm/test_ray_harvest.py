"""A distributed harvest whose replica is a vLLM engine, in a Ray actor: its shards are the engine's own harvest.

One replica (one vLLM engine of this suite alive at a time, on two shared cores; two replicas run on the
transformers engine in tests/scale/). The shards are cut as `model.harvest(shard_size=...)` cuts its engine
runs, so the reference, an in-process engine's harvest with the same shard size, runs the same batches:
equal bit for bit.
"""

from __future__ import annotations

import json

import torch

import streamscope
from streamscope.scale import harvest

import ray  # the ray extra, which scripts/setup.sh installs

PROMPTS = ["The Eiffel Tower is in Paris", "A quick brown fox jumps", "Hello", "one two three four five",
           "Ray runs a vLLM engine"]
VALUES = ["layer_input", "layer_output", "mlp_output", "final_norm_output"]


def test_a_vllm_replica_writes_the_engines_own_harvest(checkpoints, tmp_path):
    path = checkpoints("llama")
    # "local": a cluster of this test's own; ray.init() alone joins the last one started on this machine,
    # which may be another test file's, running beside this one under -n 2.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        folder = harvest(PROMPTS, path, VALUES, [0, 1], "all", out=tmp_path / "run", replicas=1, engine="vllm",
                         shard_size=3, num_cpus=2, progress=False)
    finally:
        ray.shutdown()
    index = json.loads((folder / "index.json").read_text())
    assert len(index["shards"]) == 2 and index["failures"] == []

    model = streamscope.load(path, engine="vllm")
    try:
        reference = model.harvest(PROMPTS, VALUES, [0, 1], "all", shard_size=3, progress=False)
    finally:
        model.close()
    loaded = streamscope.load_harvest(folder)
    assert loaded.positions == reference.positions
    for value in VALUES:
        for prompt, (mine, theirs) in enumerate(zip(loaded[value], reference[value])):
            assert torch.equal(mine, theirs), f"{value} of prompt {prompt}: {(mine - theirs).abs().max()}"
