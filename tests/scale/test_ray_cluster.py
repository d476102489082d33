"""A harvest over a simulated two-node Ray cluster (`ray.cluster_utils.Cluster`): one replica a node.

Each node is a raylet of its own with one CPU, so the two one-CPU replicas land on different nodes and write
into the one shared folder. The shards equal one process's `model.harvest` bit for bit, as on one node.
"""

from __future__ import annotations

import json

import pytest
import torch

import streamscope
from streamscope.scale import harvest

import ray  # the ray extra, which scripts/setup.sh installs
from ray.cluster_utils import Cluster  # noqa: E402

PROMPTS = ["The Eiffel Tower is in Paris", "A quick brown fox", "Hello", "one two three four", "Ray nodes"]


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_nodes_write_the_single_process_harvest(two_nodes, checkpoints, tmp_path):
    path = checkpoints("llama")
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2
    folder = harvest(PROMPTS, path, ["layer_output", "attention_output"], [0, 1], "all", out=tmp_path / "run",
                     replicas=2, engine="transformers", shard_size=2, harvest_options={"batch_size": 1},
                     progress=False)
    nodes = {json.loads(record.read_text())["node"] for record in folder.glob("shard-*.json")}
    assert len(nodes) == 2  # each node's replica wrote shards

    model = streamscope.load(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each one-CPU replica runs (see test_ray_harvest.py)
    try:
        reference = model.harvest(PROMPTS, ["layer_output", "attention_output"], [0, 1], "all", batch_size=1,
                                  progress=False)
    finally:
        torch.set_num_threads(threads)
    loaded = streamscope.load_harvest(folder)
    for value in reference.keys():
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(loaded[value], reference[value])), value
