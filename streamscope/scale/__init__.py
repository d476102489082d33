"""Beyond one engine: a dataset's harvest over a Ray cluster, N engine replicas, into resumable shards.

    import streamscope.scale

    folder = streamscope.scale.harvest("corpus.jsonl", "Llama-3-8B", ["layer_output"], layers=[16],
                                       positions="all", out="acts/", replicas=8,
                                       engine_options={"tensor_parallel_size": 1})
    for shard in streamscope.iter_harvest(folder):   # one Harvest per shard, as model.harvest(out=) writes
        ...

Each replica is a streamscope engine (vLLM with its own tensor and pipeline
parallel sizes, or transformers) in a Ray actor, harvesting one shard at a
time with the engine's own bulk path and writing it whole (`shards`). A
restarted run skips finished shards; a dead replica's shard goes to the
others. ``streamscope harvest`` is the same from a shell. docs/scale.md says
how a 70B and a 405B model run.
"""

from .dataset import read_prompts
from .ray import HarvestFailed, Progress, harvest

__all__ = ["harvest", "HarvestFailed", "Progress", "read_prompts"]
