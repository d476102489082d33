"""A vLLM trace's saves reach the caller by the transport its engine allows, equal bit for bit to the pickled path.

With the engine in this process (this CPU's suite: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the worker hands the
saves over as tensors (`nnsight_seam.HandedSaves`); ``STREAMSCOPE_SAVES_TRANSPORT=pickle`` sends them as nnsight
does, pickled, which is also what an engine in another process does. Each test runs the same trace both ways on
one engine and compares: values bit for bit, dtype, shape, strides, storage offset, which saves share an object,
and that a handed tensor is the caller's own (not an inference tensor of the engine's, not sharing memory with
another save).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import precision
import streamscope
from streamscope import nnsight_seam as seam

GREEDY = {"temperature": 0.0, "max_tokens": 1}
PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Once upon a time"]

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="the in-process transport needs the engine in this process; "
                                "the GPU suite runs it in its own (the pickled path, covered by every other test)")


class Note:
    """A plain Python object a trace saves (defined at module level, so it pickles by reference)."""

    def __init__(self, text: str, values: list) -> None:
        self.text, self.values = text, values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Note) and (self.text, self.values) == (other.text, other.values)


class Refused(Exception):
    """Raised inside an invoke: it must come home with its type and message."""


@pytest.fixture(scope="module")
def model(checkpoints):
    loaded = streamscope.load(checkpoints("llama"), engine="vllm", **precision.engine_kwargs())
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def bf16(checkpoints):
    loaded = streamscope.load(checkpoints("llama"), engine="vllm", **{**precision.engine_kwargs(), "dtype": "bfloat16"})
    yield loaded
    loaded.close()


def run_both(trace):
    """`trace()`'s result with the saves handed over and pickled, and the transport counts each way moved."""
    before = seam.transport_counts()
    handed = trace()
    middle = seam.transport_counts()
    with seam.saves_transport("pickle"):
        pickled = trace()
    after = seam.transport_counts()
    assert middle["handed"] > before["handed"] and middle["pickled"] == before["pickled"], \
        "the in-process engine fell back to pickling the saves"
    assert after["pickled"] > middle["pickled"] and after["handed"] == middle["handed"]
    return handed, pickled


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def same_tensor(handed: torch.Tensor, pickled: torch.Tensor) -> None:
    assert type(handed) is type(pickled) is torch.Tensor
    assert handed.dtype == pickled.dtype and handed.device == pickled.device
    assert handed.shape == pickled.shape
    assert handed.stride() == pickled.stride() and handed.storage_offset() == pickled.storage_offset()
    assert handed.untyped_storage().nbytes() == pickled.untyped_storage().nbytes()
    assert torch.equal(bits(handed), bits(pickled))  # bit for bit, NaNs and signed zeros included
    assert not handed.is_inference(), "handed the engine's inference tensor, not the caller's copy"
    handed.add_(0)  # the caller may edit it in place, as an unpickled tensor


def same(handed, pickled) -> None:
    """Equal structures, tensors by `same_tensor`."""
    assert type(handed) is type(pickled)
    if isinstance(handed, torch.Tensor):
        same_tensor(handed, pickled)
    elif isinstance(handed, (list, tuple)):
        assert len(handed) == len(pickled)
        for a, b in zip(handed, pickled):
            same(a, b)
    elif isinstance(handed, dict):
        assert handed.keys() == pickled.keys()
        for key in handed:
            same(handed[key], pickled[key])
    else:
        assert handed == pickled


def test_no_tensor_is_pickled_on_the_fast_path(model, monkeypatch):
    """The fast path pickles no tensor at all: counted where torch pickles one."""
    pickled_tensors = []
    reduce = torch.Tensor.__reduce_ex__

    def counting(self, protocol):
        pickled_tensors.append(self.shape)
        return reduce(self, protocol)

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", counting)
    before = seam.transport_counts()
    with model.trace(**GREEDY) as tracer:
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                blocks = torch.stack([layer.layer_output for layer in model.layers]).save()
    after = seam.transport_counts()
    assert pickled_tensors == []
    assert after["handed"] > before["handed"] and after["pickled"] == before["pickled"]
    assert after["tensors_handed"] - before["tensors_handed"] == len(PROMPTS)
    assert len(blocks) == len(PROMPTS) and blocks[0].shape[0] == model.num_layers


def test_views_slices_and_shared_saves(model):
    """Reads narrowed out of the step's batch, non-contiguous slices, a tensor and its view, one object under two
    names, and an expanded (stride-0) tensor: as the pickled path gives them."""
    def trace():
        with model.trace(**GREEDY) as tracer:
            for prompt in PROMPTS:
                with tracer.invoke(prompt):
                    first = model.layers[0].layer_mid[0, :3]
                    transposed = model.layers[0].mlp_norm_output.transpose(1, 2).save()
                    every_other = model.layers[0].layer_output[:, ::2, 1::3].save()
                    stacked = torch.stack([first, model.layers[1].layer_mid[0, :3]])
                    row = stacked[1]
                    whole = model.layers[1].layer_output.save()
                    last = model.layers[1].layer_output[0, -1].save()
                    pair = [stacked, row, stacked].save()
                    expanded = model.logits[:, :4].expand(3, 4).save()
        return whole, every_other, transposed, last, pair, expanded

    handed, pickled = run_both(trace)
    same(handed, pickled)
    for pair in handed[4]:
        assert pair[0] is pair[2], "one object saved twice came home as two"
        assert pair[1].untyped_storage().data_ptr() != pair[0].untyped_storage().data_ptr()
    assert not handed[2][0].is_contiguous()  # the transposed read keeps its strides, as unpickled


def test_bfloat16(bf16):
    def trace():
        with bf16.trace(**GREEDY) as tracer:
            for prompt in PROMPTS:
                with tracer.invoke(prompt):
                    narrowed = bf16.layers[0].layer_output[:, 1:, :7].save()
                    blocks = torch.stack([bf16.layers[0].layer_output]
                                         + [layer.layer_output for layer in bf16.layers[1:]]).save()
        return blocks, narrowed

    handed, pickled = run_both(trace)
    assert handed[0][0].dtype == torch.bfloat16
    same(handed, pickled)


def test_python_objects(model):
    """Saves that are not tensors (numbers, strings, containers, the user's own class, tensors inside them) come home
    as new objects, equal to the pickled path's."""
    def trace():
        with model.trace(**GREEDY) as tracer:
            for prompt in PROMPTS:
                with tracer.invoke(prompt):
                    hidden = model.layers[0].layer_output
                    summary = {"norm": float(hidden.norm()), "tokens": int(hidden.shape[1]), "name": "block 0",
                               "rows": (hidden[0, 0], [hidden[0, -1], None])}.save()
                    note = Note(prompt[:5], [1, 2.5, "x"]).save()
        return summary, note

    handed, pickled = run_both(trace)
    same(handed, pickled)
    assert handed[1][0] == Note(PROMPTS[0][:5], [1, 2.5, "x"])


def test_a_save_pickles_as_the_pickled_path_would(model):
    """A handed save pickles and unpickles afterwards like the pickled path's (it is an ordinary tensor)."""
    with model.trace(**GREEDY) as tracer:
        with tracer.invoke(PROMPTS[0]):
            value = model.layers[1].layer_output[:, ::2].save()
    again = pickle.loads(pickle.dumps(value))
    assert torch.equal(again, value) and again.stride() == value.stride()


@pytest.mark.parametrize("failing", [0, 1])
def test_errors_inside_an_invoke(model, failing):
    """An error raised in an invoke comes home with its type and message, whichever transport; the other invoke's
    saves are still handed over, and the engine serves the next trace."""
    def trace():
        with pytest.raises(Exception) as raised:
            with model.trace(**GREEDY) as tracer:
                for index, prompt in enumerate(PROMPTS):
                    with tracer.invoke(prompt):
                        model.layers[0].layer_output.save()
                        if index == failing:
                            raise Refused(f"invoke {index} refuses")
        return raised.value

    handed, pickled = run_both(trace)
    assert type(handed) is type(pickled) is Refused
    assert str(handed) == str(pickled) and f"invoke {failing} refuses" in str(handed)
    with model.trace(**GREEDY) as tracer:
        with tracer.invoke(PROMPTS[1]):
            logits = model.logits.save()
    assert logits.shape == (1, model.vocab_size)


def test_a_bad_transport_setting_is_refused(model, monkeypatch):
    monkeypatch.setenv(seam.SAVES_TRANSPORT_ENV, "shm")
    with pytest.raises(ValueError, match="STREAMSCOPE_SAVES_TRANSPORT='shm'"):
        seam.hand_saves_over()


def test_invokes_are_pickled_once_per_trace(model, monkeypatch):
    """A trace's invokes reach the in-process worker as one bundle, unpickled once, with the same results as one
    pickle per invoke (nnsight's way, ``STREAMSCOPE_BUNDLE_INVOKES=0``), a shared container above the invokes
    included."""
    prompts = PROMPTS + ["Water boils at"]
    vector = torch.arange(model.hidden_size, dtype=torch.float32) / model.hidden_size

    def trace():
        rows = [None] * len(prompts)
        with model.trace(**GREEDY) as tracer:
            rows.save()
            for index, prompt in enumerate(prompts):
                with tracer.invoke(prompt):
                    model.layers[0].layer_output[:, -1] += vector
                    rows[index] = model.layers[1].layer_output[0, -1]
                    logits = model.logits.save()
        return rows, logits

    before = seam.bundle_counts()
    bundled = trace()
    after = seam.bundle_counts()
    assert after["bundles"] - before["bundles"] == 1 and after["loads"] - before["loads"] == 1
    assert after["invokes"] - before["invokes"] == len(prompts)
    monkeypatch.setenv("STREAMSCOPE_BUNDLE_INVOKES", "0")
    one_each = trace()
    assert seam.bundle_counts() == after
    same(bundled, one_each)
    assert all(row is not None for row in bundled[0])


ENGINE_PROCESS = textwrap.dedent('''
    import json, sys
    import torch
    import streamscope
    from streamscope import nnsight_seam as seam

    path, out, prompts, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    if __name__ == "__main__":
        model = streamscope.load(path, engine="vllm", **kwargs)
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    transposed = model.layers[0].mlp_norm_output.transpose(1, 2).save()
                    every_other = model.layers[0].layer_output[:, ::2, 1::3].save()
                    whole = model.layers[1].layer_output.save()
                    logits = model.logits.save()
        torch.save({"transposed": transposed, "every_other": every_other, "whole": whole, "logits": logits}, out)
        print("RESULT " + json.dumps(seam.transport_counts()))
        model.close()
''')


def test_the_engine_process_pickles_and_agrees(model, tmp_path, checkpoints):
    """``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (the GPU layout): the worker runs in the engine's process, so the saves
    travel pickled (nothing is handed over in the caller's process), and equal the in-process hand-over's bit for
    bit, strides included."""
    script, out = tmp_path / "engine_process.py", tmp_path / "saves.pt"
    script.write_text(ENGINE_PROCESS)
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    run = subprocess.run([sys.executable, str(script), str(checkpoints("llama")), str(out), json.dumps(PROMPTS),
                          json.dumps(precision.engine_kwargs())], env=environment, capture_output=True, text=True,
                         timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT "):])["handed"] == 0
    there = torch.load(out)

    with model.trace(**GREEDY) as tracer:
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                transposed = model.layers[0].mlp_norm_output.transpose(1, 2).save()
                every_other = model.layers[0].layer_output[:, ::2, 1::3].save()
                whole = model.layers[1].layer_output.save()
                logits = model.logits.save()
    here = {"transposed": transposed, "every_other": every_other, "whole": whole, "logits": logits}
    same(here, there)


def test_several_sequences_per_request_each_get_their_invoke(model, monkeypatch):
    """With ``n=2`` each request runs as two sequences, each with its own copy of the invoke (as nnsight gives
    them), bundled or not: the same values come home, one per sequence."""
    def trace():
        with model.trace(temperature=1.0, seed=0, max_tokens=1, n=2) as tracer:
            for prompt in PROMPTS:
                with tracer.invoke(prompt):
                    hidden = model.layers[1].layer_output.save()
        return hidden

    bundled = trace()
    monkeypatch.setenv("STREAMSCOPE_BUNDLE_INVOKES", "0")
    one_each = trace()
    assert len(bundled) == len(one_each) == 2 * len(PROMPTS)
    same(bundled, one_each)
    assert bundled[0] is not bundled[1] and torch.equal(bundled[0], bundled[1])


# An invoke's work at each step: the per-step cuts of issue 24 (W2's steer written in a trace), counted exactly.

STEER_BLOCK = 1


def steer_at_every_step(model, steps: int, vector: torch.Tensor) -> None:
    """One invoke adding `vector` to a block's layer_output at each of `steps` generated tokens."""
    with model.trace(PROMPTS[0], max_tokens=steps, temperature=0.0, ignore_eos=True) as tracer:
        for _ in tracer.iter[:steps]:
            model.layers[STEER_BLOCK].layer_output[:] += vector


def worker_costs(model, steps: int, monkeypatch) -> tuple[dict, int]:
    """The torch ops dispatched on the trace's worker greenlet, by name, and the calls of nnsight's own eproperty
    read, over one `steer_at_every_step`."""
    import collections

    from greenlet import getcurrent
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: collections.Counter = collections.Counter()
    reads = [0]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(getcurrent(), "mediator", None) is not None:  # on a worker: the invoke's own work
                ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    nnsight_read = seam.eproperty.__get__

    def counted_read(self, obj, owner=None):
        reads[0] += obj is not None
        return nnsight_read(self, obj, owner)

    vector = torch.linspace(-1, 1, model.hidden_size)
    with monkeypatch.context() as patch:
        patch.setattr(seam.eproperty, "__get__", counted_read)
        with Counting():
            steer_at_every_step(model, steps, vector)
    return dict(ops), reads[0]


def test_a_steer_at_every_step_costs_each_step_the_same_few_ops(model, monkeypatch):
    """What an invoke adds per step is exact: its read, its edit and the write-back, in the fewest torch ops
    streamscope knows for them (on a GPU each op that is not a view is a kernel launch, `item` a wait for the
    device). A change that falls back to a longer path (nnsight's own eproperty read, the two-kernel NaN check,
    a dtype conversion that is not needed) changes these counts."""
    short, short_reads = worker_costs(model, 2, monkeypatch)
    long, long_reads = worker_costs(model, 5, monkeypatch)
    per_step = {name: (long.get(name, 0) - short.get(name, 0)) / 3 for name in set(short) | set(long)}
    per_step = {name: count for name, count in per_step.items() if count}
    assert per_step == {
        # The read: the block's two halves summed (a new tensor), viewed [1, tokens, hidden].
        "aten.add.Tensor": 2, "aten.unsqueeze.default": 2,
        # The user's `[:] += vector`: a slice view, the add in place, the copy of the slice onto itself (torch
        # sees the same memory and copies nothing).
        "aten.slice.Tensor": 1, "aten.add_.Tensor": 2, "aten.copy_.default": 1,
        # The write-back: the written value checked for NaN or inf in one reduction and one number read back,
        # viewed in the engine's layout, and the change added to the hidden half (halves summed again, the
        # difference, the add in place: bit for bit the bulk path's change).
        "aten.sum.default": 1, "aten.item.default": 1, "aten.reshape.default": 1, "aten.sub.Tensor": 1,
    }, per_step
    assert long_reads == short_reads, "a read of a streamscope value went through nnsight's eproperty read"
