"""A dataset's harvest over a local Ray cluster: two replicas, shards equal to one process's harvest, resumable.

The replicas here are transformers engines of a tiny checkpoint (cheap to start twice on two cores; the vLLM
replica is tests/vllm/test_ray_harvest.py). The oracle for a sharded run is `model.harvest` of the same prompts
in one process with the same batches: equal bit for bit (the same forward on the same batches). Batches of
one prompt here: the transformers engine groups a call's prompts by length, so padded batches of a shard
are not those of the whole dataset.
A replica is killed with Ray's own kill (its process ends, as a crashed node's would).
"""

from __future__ import annotations

import json

import pytest
import torch

import streamscope
from streamscope.scale import HarvestFailed, harvest

import ray  # the ray extra, which scripts/setup.sh installs

PROMPTS = [
    "The Eiffel Tower is in Paris",
    "A quick brown fox",
    "one two three four five six seven",
    "Hello",
    "The capital of France is",
    "Rome was not built in a day, they say",
    "x y",
    "Shards are written whole or not at all",
    "Ray runs the replicas",
    "The last prompt of the set",
]
VALUES = ["layer_output", "mlp.mlp_output", "token_embeddings"]
LAYERS = [0, 1]
SHARD = 3   # four shards: 3, 3, 3, 1 prompts
BATCH = {"batch_size": 1}  # no padding: a prompt's forward is the same in a shard and in the whole set


@pytest.fixture(scope="module")
def local_ray():
    # "local": a cluster of this test's own; ray.init() alone joins the last one started on this machine,
    # which may be another test file's, running beside this one under -n 2.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def reference(path):
    # Each replica holds one Ray CPU, so its torch runs one thread (Ray sets OMP_NUM_THREADS=1); a CPU matmul
    # split over two threads adds in another order (measured: up to 1.2e-6 apart), so the reference runs one.
    model = streamscope.load(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return model.harvest(PROMPTS, VALUES, LAYERS, positions="all", batch_size=1, progress=False)
    finally:
        torch.set_num_threads(threads)


def run(path, out, **options):
    options = {"replicas": 2, "engine": "transformers", "shard_size": SHARD, "harvest_options": BATCH,
               "progress": False, **options}
    return harvest(PROMPTS, path, VALUES, LAYERS, "all", out=out, **options)


def assert_equal_to(reference, folder):
    loaded = streamscope.load_harvest(folder)
    assert loaded.layers == reference.layers and loaded.positions == reference.positions
    assert loaded.prompts == list(range(len(PROMPTS)))
    for value in VALUES:
        for prompt, (mine, theirs) in enumerate(zip(loaded[value], reference[value])):
            assert torch.equal(mine, theirs), f"{value} of prompt {prompt} differs"


def shard_stamps(folder):
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in folder.glob("shard-*")}


def finished_shards(kept, data):
    """The files of `kept` (`shard_stamps`) that belong to finished shards: those with a record, each with its
    `data` file (the record is written after it). A replica killed between its data's rename and its record leaves
    the data alone: a shard not finished, whole, that the next run writes again."""
    finished = {name[:-len(".json")] for name in kept if name.endswith(".json")}
    assert all(f"{stem}.{data}" in kept for stem in finished), sorted(kept)
    return {name: stamp for name, stamp in kept.items() if name.rsplit(".", 1)[0] in finished}


def replicas_of(run_prefix="streamscope-harvest-"):
    return [ray.get_actor(name) for name in ray.util.list_named_actors() if name.startswith(run_prefix)]


def test_two_replicas_write_the_single_process_harvest_bit_for_bit(local_ray, path, reference, tmp_path):
    seen = []
    folder = run(path, tmp_path / "run", progress=seen.append)
    assert_equal_to(reference, folder)
    records = [json.loads((folder / f"shard-{number:05d}.json").read_text()) for number in range(4)]
    assert {record["replica"] for record in records} == {0, 1}  # both replicas harvested
    assert sum(record["tokens"] for record in records) == json.loads((folder / "index.json").read_text())["tokens"]
    # Progress after every shard: shards done, tokens/s, an ETA that reaches zero.
    assert [event.shards_done for event in seen] == [1, 2, 3, 4]
    assert seen[-1].eta_seconds == 0 and seen[-1].tokens_per_second > 0 and seen[-1].replicas == 2
    assert not list(folder.glob(".*.tmp")) and not replicas_of()  # no temporaries, every actor ended


def test_a_replica_killed_mid_run_is_reported_and_the_rest_finish(local_ray, path, reference, tmp_path):
    def kill_one(event):
        if event.shards_done == 1:
            ray.kill(replicas_of()[0], no_restart=True)

    folder = run(path, tmp_path / "run", progress=kill_one)
    assert_equal_to(reference, folder)
    failures = json.loads((folder / "index.json").read_text())["failures"]
    assert len(failures) == 1 and "Actor" in failures[0]["error"], failures


def test_a_run_whose_replicas_all_die_resumes_to_the_same_shards(local_ray, path, reference, tmp_path):
    out = tmp_path / "run"

    def kill_all(event):
        if event.shards_done == 1:
            for actor in replicas_of():
                ray.kill(actor, no_restart=True)

    with pytest.raises(HarvestFailed, match="Run the same harvest again to resume") as stopped:
        run(path, out, progress=kill_all)
    assert 1 <= stopped.value.finished < 4 and len(stopped.value.failures) == 2
    assert not (out / "index.json").exists()
    kept = finished_shards(shard_stamps(out), "safetensors")
    assert len(kept) == 2 * stopped.value.finished  # each finished shard: tensors and record, nothing half
    (out / ".shard-00003.safetensors.deadbeef.tmp").write_bytes(b"half a shard")  # a write a kill cut short
    # A kill between a shard's tensors and its record leaves tensors with no record: whole, but another shard's
    # here, so the resumed run must write that shard again for the harvest to equal the reference.
    done = sorted(name for name in kept if name.endswith(".safetensors"))
    orphan = next(f"shard-{number:05d}.safetensors" for number in range(4)
                  if f"shard-{number:05d}.json" not in kept)
    (out / orphan).write_bytes((out / done[0]).read_bytes())

    resumed = []
    folder = run(path, out, progress=resumed.append)
    assert_equal_to(reference, folder)
    assert all(shard_stamps(out)[name] == stamp for name, stamp in kept.items())  # finished shards untouched
    assert len(resumed) == 4 - stopped.value.finished and not list(out.glob(".*.tmp"))
    # A finished run run again writes nothing.
    stamps = shard_stamps(out)
    run(path, out)
    assert shard_stamps(out) == stamps


def test_the_command_harvests_a_jsonl_file(local_ray, path, reference, tmp_path, capsys):
    from streamscope.cli import main

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"id": index, "body": prompt}) + "\n" for index, prompt in enumerate(PROMPTS)))
    out = tmp_path / "run"
    code = main(["harvest", str(path), str(dataset), "--values", ",".join(VALUES), "--layers", "0,1",
                 "--positions", "all", "--out", str(out), "--column", "body", "--engine", "transformers",
                 "--replicas", "1", "--shard-size", str(SHARD), "--batch-size", "1", "--engine-options", "{}"])
    assert code == 0
    assert f"wrote {len(PROMPTS)} prompts" in capsys.readouterr().out
    assert_equal_to(reference, out)


def test_a_shard_that_raises_stops_the_run_with_the_reason(local_ray, path, tmp_path):
    prompts = ["a b c d e f", "a b c d e f", "a"]  # the last prompt has no position 3
    with pytest.raises(HarvestFailed, match="out of range") as stopped:
        harvest(prompts, path, ["layer_output"], [0], [3], out=tmp_path / "run", replicas=1,
                engine="transformers", shard_size=2, progress=False)
    assert stopped.value.finished == 1 and not replicas_of()



def parquet_rows(folder):
    """The run's Parquet shards as one table, read with pyarrow (as an SAE trainer reads them) in index order."""
    import pyarrow
    import pyarrow.parquet

    index = json.loads((folder / "index.json").read_text())
    assert index["format"] == "parquet"
    return pyarrow.concat_tables([pyarrow.parquet.read_table(folder / shard["file"]) for shard in index["shards"]])


def test_parquet_shards_hold_the_safetensors_harvest_and_resume_whole(local_ray, path, tmp_path):
    import pyarrow.parquet
    from transformers import AutoTokenizer

    out = tmp_path / "parquet"

    def kill_all(event):
        if event.shards_done == 1:
            for actor in replicas_of():
                ray.kill(actor, no_restart=True)

    with pytest.raises(HarvestFailed) as stopped:
        run(path, out, format="parquet", progress=kill_all)
    present = shard_stamps(out)
    kept = finished_shards(present, "parquet")
    assert len(kept) == 2 * stopped.value.finished
    for name in present:  # every table there, finished or not, is whole: it reads
        if name.endswith(".parquet"):
            pyarrow.parquet.read_table(out / name)
    (out / ".shard-00003.parquet.deadbeef.tmp").write_bytes(b"PAR1 half a table")  # a write a kill cut short
    resumed = []
    run(path, out, format="parquet", progress=resumed.append)
    assert all(shard_stamps(out)[name] == stamp for name, stamp in kept.items())  # never written twice
    assert len(resumed) == 4 - stopped.value.finished and not list(out.glob(".*.tmp"))

    safetensors = streamscope.load_harvest(run(path, tmp_path / "safetensors"))
    table = parquet_rows(out)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert table["prompt"].to_pylist() == [prompt for prompt, chosen in enumerate(safetensors.positions)
                                           for _ in chosen]
    assert table["position"].to_pylist() == [position for chosen in safetensors.positions for position in chosen]
    assert table["token"].to_pylist() == [ids[prompt][position] for prompt, chosen in enumerate(safetensors.positions)
                                          for position in chosen]
    for value in VALUES:
        for slot, layer in ([(None, None)] if value == "token_embeddings" else list(enumerate(LAYERS))):
            name = value if slot is None else f"{value}/{layer}"
            column = table[name].combine_chunks()
            held = torch.from_numpy(column.flatten().to_numpy().reshape(len(column), column.type.list_size).copy())
            expected = torch.cat([tensor if slot is None else tensor[slot] for tensor in safetensors[value]])
            assert held.dtype == expected.dtype and torch.equal(held, expected), name
    with pytest.raises(FileExistsError, match="format: 'parquet' there, 'safetensors' now"):
        run(path, out)  # the same run in another format is another run
    with pytest.raises(ValueError, match="Parquet shards: read them with pyarrow"):
        streamscope.load_harvest(out)


def test_replicas_whose_engines_cannot_start_stop_the_run_cleanly(local_ray, path, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(HarvestFailed, match="every replica failed") as stopped:
        run(path, out, engine_options={"dtype": "float7"})  # each replica's streamscope.load raises
    assert stopped.value.finished == 0 and len(stopped.value.failures) == 2
    assert all("float7" in failure["error"] or "creation" in failure["error"] for failure in stopped.value.failures)
    assert sorted(path.name for path in out.iterdir()) == ["run.json"] and not replicas_of()  # nothing half-written


def test_the_default_shard_size_holds_shard_bytes_and_resumes(local_ray, path, reference, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    from streamscope.bulk import results

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]  # token-id prompts: their lengths are exact
    # Computed apart from the planner: 2 values x 2 blocks + the root's embeddings, float32 (the transformers
    # engine's dtype), at every position of the longest prompt.
    prompt_bytes = (2 * len(LAYERS) + 1) * AutoConfig.from_pretrained(path).hidden_size * 4 * max(map(len, ids))
    monkeypatch.setattr(results, "SHARD_BYTES", SHARD * prompt_bytes + prompt_bytes // 2)  # tens of KiB

    def default(**options):
        return harvest(ids, path, VALUES, LAYERS, "all", out=tmp_path / "run", replicas=2, engine="transformers",
                       harvest_options=BATCH, progress=False, **options)

    folder = default()
    assert json.loads((folder / "run.json").read_text())["shard_size"] == SHARD
    assert len(json.loads((folder / "index.json").read_text())["shards"]) == 4  # 3, 3, 3, 1 prompts
    assert_equal_to(reference, folder)  # the rows of one process's harvest (and of the explicit shard_size=3 run)
    stamps = shard_stamps(folder)
    default()  # resumed with the default: the same plan, nothing to harvest
    default(shard_size=SHARD)  # the number the default planned resumes it too
    assert shard_stamps(folder) == stamps
    with pytest.raises(FileExistsError, match="shard_size: 3 there, 2 now"):
        default(shard_size=2)
    monkeypatch.setattr(results, "SHARD_BYTES", 2 * prompt_bytes)  # a default that plans another number
    with pytest.raises(FileExistsError, match="plans 2 prompts a shard; pass shard_size=3 to resume"):
        default()
