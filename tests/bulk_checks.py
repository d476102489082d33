"""Checks of the bulk path that read the same on both engines: against the oracle, positions, shards, errors.

Each engine's ``test_bulk.py`` supplies the model and the trace references
(the trace syntax differs between engines); the checks here use only
`model.harvest`, `model.generate` and the oracle.
"""

from __future__ import annotations

import pytest
import torch

import oracle
import precision
from access import relative_error
import streamscope
from streamscope.bulk.spec import locate
from streamscope.errors import Unavailable

PROMPTS = [
    "Once upon a time",
    "Rome is in Italy, Berlin is in Germany, Madrid is in Spain",
    "def add(a, b):",
    "Numbers",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the garden",
]
#: Against transformers' float32 forward: the suite's 1e-5 on the CPU; on a GPU, what a batched request keeps
#: from its solo run there (tests/precision.py), since a harvest runs its prompts as one batch.
RELATIVE = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE] if precision.ON_GPU else precision.CPU_FLOAT32
#: One rounding of the engine's dtype, relative: a value read after an edit against the trace's edited copy.
ROUNDING = 1e-6 if precision.DTYPE == "float32" else 1e-2
#: Families the bulk suites run: fused (llama), whole-stream (gpt2), parallel with one shared norm (gptj).
BULK_FAMILIES = ("llama", "gpt2", "gptj")


def served_values(model, family: str) -> list[str]:
    """The oracle's value names (short spellings; the neurons under ``mlp.``) that this family's blocks serve."""
    names = []
    for name in (*oracle.BOUNDARIES, *oracle.CONTRIBUTIONS, *(f"mlp.{name}" for name in oracle.NEURONS)):
        if oracle.ORACLE[family].get(name.split(".")[-1]) is None:
            continue
        try:
            locate(model, name, 0)
        except Unavailable:
            continue
        names.append(name)
    return names


def check_harvest_equals_the_oracle(model, reference, tokenizer, family: str, **options) -> None:
    served = served_values(model, family)
    names = [name for name in served if not name.startswith("mlp.")]
    harvest = model.harvest(PROMPTS, [*names, "token_embeddings", "final_norm_output"], positions="all",
                            progress=False, **options)
    neurons = [name for name in served if name.startswith("mlp.")]  # intermediate_size wide: a harvest of their own
    if neurons:
        with pytest.raises(ValueError, match="a harvest of their own"):
            model.harvest(PROMPTS, [*neurons, "layer_output"], progress=False, **options)
        with pytest.raises(ValueError, match="edit them in a trace"):
            model.generate(PROMPTS[:1], max_tokens=1,
                           steer=[streamscope.Steer("mlp.neurons", 0, torch.ones(model.hidden_size))],
                           progress=False)
        harvested = model.harvest(PROMPTS, neurons, positions="all", progress=False, **options)
        harvest.values.update(harvested.values)
        names += neurons
    assert harvest.layers == list(range(model.num_layers))
    for index, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = oracle.values(reference, family, ids)
        assert harvest.positions[index] == list(range(ids.shape[1]))
        for name in names:
            got, wanted = harvest[name][index], expected[name.split(".")[-1]]  # mlp.neurons: the oracle's neurons
            assert got.shape == (model.num_layers, ids.shape[1], wanted[0].shape[-1]), (name, got.shape)
            for block in range(model.num_layers):
                error = relative_error(got[block], wanted[block][0])
                assert error <= RELATIVE, (prompt, name, block, error)
        for name in ("token_embeddings", "final_norm_output"):
            assert relative_error(harvest[name][index], expected[name][0]) <= RELATIVE, (prompt, name)


def check_positions(model, **options) -> None:
    everything = model.harvest(PROMPTS, "layer_output", layers=[0, -1], positions="all", progress=False, **options)
    assert everything.layers == [0, model.num_layers - 1]
    lengths = [len(positions) for positions in everything.positions]
    per_prompt = [[0], [1, -1], [0, 2], [0], [3, 1]]
    cases = [
        ("last", [[length - 1] for length in lengths]),
        (slice(1, 3), [list(range(length))[1:3] for length in lengths]),
        ([0, -1], [[0, length - 1] for length in lengths]),
        (per_prompt, [[index % length for index in chosen] for chosen, length in zip(per_prompt, lengths)]),
    ]
    for positions, expected_positions in cases:
        rule = positions
        harvest = model.harvest(PROMPTS, "layer_output", layers=[0, -1], positions=positions, progress=False,
                                **options)
        assert harvest.positions == expected_positions, rule
        for index, chosen in enumerate(expected_positions):
            got = harvest["layer_output"][index]
            assert got.shape == (2, len(chosen), model.hidden_size)
            # The same batch through the same engine: the same numbers, bit for bit.
            assert torch.equal(got, everything["layer_output"][index][:, chosen]), (rule, index)
    last = model.harvest(PROMPTS, "layer_output", positions="last", progress=False, **options)
    assert last.stacked("layer_output").shape == (len(PROMPTS), model.num_layers, 1, model.hidden_size)
    with pytest.raises(ValueError, match="cannot be stacked"):
        everything.stacked("layer_output")


def same_across_batches(got, expected) -> bool:
    """Two runs of a prompt in other batches: bit-equal on the CPU, within `RELATIVE` on a GPU (whose kernels
    block by the batch's shape: the README's batching section)."""
    if not precision.ON_GPU:
        return torch.equal(got, expected)
    return relative_error(got.float(), expected.float()) <= RELATIVE


def check_shards(model, folder, **options) -> None:
    names = ["layer_output", "mlp_output", "token_embeddings"]
    memory = model.harvest(PROMPTS, names, layers=[0, 1], positions="all", progress=False, **options)
    written = model.harvest(PROMPTS, names, layers=[0, 1], positions="all", out=folder, shard_size=2,
                            progress=False, **options)
    assert written == folder
    shards = list(streamscope.iter_harvest(folder))
    # Every prompt in exactly one shard of at most shard_size prompts (transformers batches by length).
    assert sorted(prompt for shard in shards for prompt in shard.prompts) == list(range(len(PROMPTS)))
    assert len(shards) == 3 and all(len(shard.prompts) <= 2 for shard in shards)
    loaded = streamscope.load_harvest(folder)
    assert loaded.layers == memory.layers and loaded.positions == memory.positions
    for name in names:
        for index in range(len(PROMPTS)):
            assert same_across_batches(loaded[name][index], memory[name][index]), (name, index)
    some = streamscope.load_harvest(folder, prompts=[3, 1])
    assert some.prompts == [1, 3] and torch.equal(some["layer_output"][1], loaded["layer_output"][3])
    with pytest.raises(FileExistsError, match="empty folder"):
        model.harvest(PROMPTS, names, out=folder, progress=False, **options)


def check_shards_bounded_in_bytes(model, folder, monkeypatch, slack_prompts: int = 0, **options) -> None:
    """Without ``shard_size`` a shard holds at most `SHARD_BYTES` of rows (set here to about two prompts' worth):
    on vLLM exactly, or a single prompt larger than it; on transformers, which writes a shard once its batches
    cross the limit, up to `slack_prompts` prompts more. The shards hold the harvest in memory, and a shard size
    that is not a positive int is refused by name."""
    from streamscope.bulk import results

    names = ["layer_output", "mlp_output"]
    memory = model.harvest(PROMPTS, names, layers=[0, 1], positions="all", progress=False, **options)
    prompt_bytes = [sum(memory[name][index].nbytes for name in names) for index in range(len(PROMPTS))]
    limit = 2 * sorted(prompt_bytes)[len(PROMPTS) // 2]
    monkeypatch.setattr(results, "SHARD_BYTES", limit)
    model.harvest(PROMPTS, names, layers=[0, 1], positions="all", out=folder, progress=False, **options)
    shards = list(streamscope.iter_harvest(folder))
    assert len(shards) >= 2, [shard.prompts for shard in shards]
    for shard in shards:
        held = sum(prompt_bytes[prompt] for prompt in shard.prompts)
        slack = sum(sorted(prompt_bytes)[-slack_prompts:]) if slack_prompts else 0
        assert held <= limit + slack or len(shard.prompts) == 1, (shard.prompts, held, limit)
    loaded = streamscope.load_harvest(folder)
    for name in names:
        for index in range(len(PROMPTS)):
            assert same_across_batches(loaded[name][index], memory[name][index]), (name, index)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="shard_size"):
            model.harvest(PROMPTS, names, out=folder.with_name(f"bad-{bad}"), shard_size=bad, progress=False,
                          **options)


def check_a_failed_harvest_leaves_no_index(model, folder, monkeypatch, module, **options) -> None:
    """A run that fails after its first shard went to the writer: no index (a half harvest never looks complete),
    the writer thread gone, and the model harvests on."""
    import threading

    from streamscope.bulk.results import INDEX

    real = module.assemble
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a chunk failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "assemble", failing)
    with pytest.raises(RuntimeError, match="a chunk failed"):
        model.harvest(PROMPTS, "layer_output", layers=[0], positions="all", out=folder, shard_size=2,
                      progress=False, **options)
    monkeypatch.setattr(module, "assemble", real)
    assert not (folder / INDEX).exists()
    with pytest.raises(FileNotFoundError, match="was the run finished"):
        streamscope.load_harvest(folder)
    assert not [thread for thread in threading.enumerate() if thread.name == "streamscope-shard-writer"]
    again = model.harvest(PROMPTS[:2], "layer_output", layers=[0], positions="all", progress=False, **options)
    assert again.prompts == [0, 1]


def check_bad_specs_fail_before_running(model, family: str, **options) -> None:
    vector = torch.zeros(model.hidden_size)
    with pytest.raises(ValueError, match="unknown value 'layer_out'.*layer_output"):
        model.harvest(PROMPTS, "layer_out", progress=False, **options)
    with pytest.raises(IndexError, match=f"block {model.num_layers} is out of range.*{model.num_layers} blocks"):
        model.harvest(PROMPTS, "layer_output", layers=[model.num_layers], progress=False, **options)
    with pytest.raises(IndexError, match="index 40 is out of range for prompt 0"):
        model.harvest(PROMPTS, "layer_output", positions=[40], progress=False, **options)
    with pytest.raises(ValueError, match=r"one list per prompt"):
        model.harvest(PROMPTS, "layer_output", positions=[[0], [1]], progress=False, **options)
    with pytest.raises(ValueError, match=r"vector of shape \(3,\).*\(%d,\)" % model.hidden_size):
        model.generate(PROMPTS, max_tokens=2, steer=[streamscope.Steer("layer_output", 0, torch.zeros(3))],
                       progress=False, **options)
    with pytest.raises(IndexError, match="out of range"):
        model.generate(PROMPTS, max_tokens=2, steer=[streamscope.Steer("layer_output", -99, vector)],
                       progress=False, **options)
    with pytest.raises(ValueError, match="mode 'mul'"):
        model.generate(PROMPTS, max_tokens=2, steer=[streamscope.Steer("layer_output", 0, vector, mode="mul")],
                       progress=False, **options)
    with pytest.raises(ValueError, match="root value"):
        model.generate(PROMPTS, max_tokens=2, steer=[streamscope.Steer("token_embeddings", 0, vector)],
                       progress=False, **options)
    if family == "gptj":
        with pytest.raises(Unavailable, match="parallel block"):
            model.harvest(PROMPTS, "layer_mid", progress=False, **options)
    # Nothing ran: the model serves the next request as before.
    after = model.harvest(PROMPTS[:1], "layer_output", layers=[0], progress=False, **options)
    assert after["layer_output"][0].shape == (1, 1, model.hidden_size)


def head_results_rounding(model) -> float:
    """A harvest's head results against the trace's: the same projection input and columns, multiplied per row on
    the bulk path and per batch in the trace (other shapes, so other summation orders). In float32 each entry is a
    sum of head_dim products, whose two orders differ by at most head_dim roundings (the standard bound of a
    reduction: n * eps of the largest term); in bfloat16, about one rounding of the result."""
    if precision.DTYPE == "float32":
        return model.head_dim * torch.finfo(torch.float32).eps
    return 1e-2


def check_head_results_on_the_bulk_path(model, **options) -> None:
    """`self_attn.head_results` harvested: each prompt's ``[layers, positions, heads, hidden]``, equal to the trace's
    read (through `model.cache`) at every position and, at chosen positions, to those rows of the whole harvest;
    a harvest mixing it with other widths, a steer of it and the bare name are refused before the engine runs,
    and the engine serves on. (Against the oracle on every family: test_families.py.)"""
    name = "self_attn.head_results"
    harvest = model.harvest(PROMPTS, name, positions="all", progress=False, **options)
    assert harvest.layers == list(range(model.num_layers))
    for index, prompt in enumerate(PROMPTS):
        cache = model.cache(prompt, values=[name])
        got = harvest[name][index]
        length = len(harvest.positions[index])
        assert tuple(got.shape) == (model.num_layers, length, model.num_heads, model.hidden_size), got.shape
        for block in range(model.num_layers):
            expected = cache[f"layers.{block}.{name}"][0]
            assert relative_error(got[block], expected) <= head_results_rounding(model), (index, block)
    chosen = model.harvest(PROMPTS, name, layers=[-1], positions=[0, -1], progress=False, **options)
    for index, positions in enumerate(chosen.positions):
        assert relative_error(chosen[name][index][0], harvest[name][index][-1, positions]) <= head_results_rounding(model)
    with pytest.raises(ValueError, match=r"\[heads, hidden_size\] a row.*a harvest of their own"):
        model.harvest(PROMPTS, [name, "layer_output"], progress=False, **options)
    with pytest.raises(ValueError, match="name it 'self_attn.head_results'"):
        model.harvest(PROMPTS, "head_results", progress=False, **options)
    for value in (name, "head_results"):
        with pytest.raises(ValueError, match="a steer of self_attn.head_results is refused.*in a trace"):
            model.generate(PROMPTS[:1], max_tokens=1, steer=[streamscope.Steer(value, 0, torch.ones(model.hidden_size))],
                           progress=False)
    after = model.harvest(PROMPTS[:1], "layer_output", layers=[0], progress=False, **options)
    assert after["layer_output"][0].shape == (1, 1, model.hidden_size)
