"""A vLLM trace's saves reach the caller by the transport its engine allows, equal bit for bit to the pickled path.

With the engine in this process (this CPU's suite: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the worker hands the
saves over as tensors (`trace_transport.HandedSaves`); with the engine in its own process (vLLM's default, the GPU
layout) it packs every tensor of a collect into one buffer; ``STREAMSCOPE_SAVES_TRANSPORT=pickle`` sends them as
nnsight does, pickled. Each test runs the same trace both ways on one engine and compares: values bit for bit,
dtype, shape, strides, storage offset, which saves share an object, errors' type and message, and that a tensor
that came home is the caller's own (not an inference tensor of the engine's, not sharing memory with another save).
The traces and the comparison live in tests/transport_cases.py, which the engine process run imports.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import precision
import streamscope
import transport_cases
from streamscope import nnsight_seam as seam
from streamscope import nonfinite
from streamscope.vllm import trace_transport, write_batch
from transport_cases import GREEDY, PROMPTS, Note, Refused, same

in_process = pytest.mark.skipif(precision.ON_GPU, reason="the hand-over needs the engine in this process; the GPU "
                                "suite runs it in its own (the engine process tests below)")


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
    before = trace_transport.transport_counts()
    handed = trace()
    middle = trace_transport.transport_counts()
    with trace_transport.saves_transport("pickle"):
        pickled = trace()
    after = trace_transport.transport_counts()
    assert middle["handed"] > before["handed"] and middle["pickled"] == before["pickled"], \
        "the in-process engine fell back to pickling the saves"
    assert after["pickled"] > middle["pickled"] and after["handed"] == middle["handed"]
    return handed, pickled


@in_process
def test_no_tensor_is_pickled_on_the_fast_path(model, monkeypatch):
    """The fast path pickles no tensor at all: counted where torch pickles one."""
    pickled_tensors = []
    reduce = torch.Tensor.__reduce_ex__

    def counting(self, protocol):
        pickled_tensors.append(self.shape)
        return reduce(self, protocol)

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", counting)
    before = trace_transport.transport_counts()
    with model.trace(**GREEDY) as tracer:
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                blocks = torch.stack([layer.layer_output for layer in model.layers]).save()
    after = trace_transport.transport_counts()
    assert pickled_tensors == []
    assert after["handed"] > before["handed"] and after["pickled"] == before["pickled"]
    assert after["tensors_handed"] - before["tensors_handed"] == len(PROMPTS)
    assert len(blocks) == len(PROMPTS) and blocks[0].shape[0] == model.num_layers


@in_process
def test_views_slices_and_shared_saves(model):
    """Reads narrowed out of the step's batch, non-contiguous slices, a tensor and its view, one object under two
    names, and an expanded (stride-0) tensor: as the pickled path gives them."""
    handed, pickled = run_both(lambda: transport_cases.views_slices_and_shared(model))
    same(handed, pickled)
    transport_cases.check_views_slices_and_shared(handed)


@in_process
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


@in_process
def test_python_objects(model):
    """Saves that are not tensors (numbers, strings, containers, the user's own class, tensors inside them) come home
    as new objects, equal to the pickled path's."""
    handed, pickled = run_both(lambda: transport_cases.python_objects(model))
    same(handed, pickled)
    assert handed[1][0] == Note(PROMPTS[0][:5], [1, 2.5, "x"])


@in_process
def test_a_save_pickles_as_the_pickled_path_would(model):
    """A handed save pickles and unpickles afterwards like the pickled path's (it is an ordinary tensor)."""
    with model.trace(**GREEDY) as tracer:
        with tracer.invoke(PROMPTS[0]):
            value = model.layers[1].layer_output[:, ::2].save()
    again = pickle.loads(pickle.dumps(value))
    assert torch.equal(again, value) and again.stride() == value.stride()


@in_process
@pytest.mark.parametrize("failing", [0, 1])
def test_errors_inside_an_invoke(model, failing):
    """An error raised in an invoke comes home with its type and message, whichever transport; the other invoke's
    saves are still handed over, and the engine serves the next trace."""
    handed, pickled = run_both(lambda: transport_cases.error_in_invoke(failing)(model))
    assert type(handed) is type(pickled) is Refused
    assert str(handed) == str(pickled) and f"invoke {failing} refuses" in str(handed)
    with model.trace(**GREEDY) as tracer:
        with tracer.invoke(PROMPTS[1]):
            logits = model.logits.save()
    assert logits.shape == (1, model.vocab_size)


@in_process
def test_a_bad_transport_setting_is_refused(model, monkeypatch):
    monkeypatch.setenv(trace_transport.SAVES_TRANSPORT_ENV, "shm")
    with pytest.raises(ValueError, match="STREAMSCOPE_SAVES_TRANSPORT='shm'"):
        trace_transport.hand_saves_over()


@in_process
def test_invokes_are_pickled_once_per_trace(model):
    """A trace's invokes reach the in-process worker as one bundle, unpickled once, with the same results as one
    pickle per invoke (nnsight's way, ``STREAMSCOPE_BUNDLE_INVOKES=0``), a shared container above the invokes
    included."""
    report = transport_cases.bundled_and_one_each(model, trace_transport.bundle_counts)
    assert report["moved_bundled"] == {"bundles": 1, "invokes": 3, "loads": 1, "received": 0}, report
    assert set(report["moved_one_each"].values()) == {0}, report
    same(report["bundled"], report["one_each"])


@pytest.fixture(scope="module")
def engine_process(checkpoints, tmp_path_factory):
    """Every case of tests/transport_cases.py run packed and pickled on one engine in its own process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): its report (which cases agreed, what the counters moved each way)."""
    out = tmp_path_factory.mktemp("engine_process") / "report.json"
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    environment.pop(trace_transport.SAVES_TRANSPORT_ENV, None)  # the default: packed
    start = ("import json, sys, transport_cases; "
             "transport_cases.run_engine_process(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))")
    run = subprocess.run([sys.executable, "-c", start, str(checkpoints("llama")), str(out),
                          json.dumps(precision.engine_kwargs())], env=environment, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0 and out.exists(), run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", sorted(transport_cases.CASES))
def test_the_engine_process_packs_bit_for_bit(engine_process, case):
    """With the engine in its own process, the saves come home packed into one buffer per collect, equal to the
    pickled path's bit for bit (bfloat16, views, non-contiguous slices, a tensor saved twice, Python objects,
    an invoke's error with its type and message)."""
    assert engine_process["cases"][case] == "ok", engine_process["cases"][case]


@pytest.mark.parametrize("case", sorted(transport_cases.CASES))
def test_the_engine_process_does_not_fall_back_to_pickling(engine_process, case):
    """The counters of the worker's process (through ``collective_rpc``) and of the caller's say which path ran:
    packed by default, with no collect pickled; nnsight's pickling only where ``STREAMSCOPE_SAVES_TRANSPORT=pickle``
    asks for it."""
    packed, pickled = engine_process["counts"][case]["auto"], engine_process["counts"][case]["pickle"]
    assert packed["worker"]["packed"] > 0 and packed["worker"]["pickled"] == 0, packed
    assert packed["worker"]["handed"] == 0, "a worker in another process handed tensors over"
    assert packed["received"]["packed"] == packed["worker"]["packed"] and packed["received"]["pickled"] == 0
    if not case.startswith("error_in_invoke"):  # a trace that raised brings no saves home, either way
        assert packed["worker"]["tensors_packed"] > 0 and packed["worker"]["bytes_packed"] > 0, packed
    assert pickled["worker"]["pickled"] > 0 and pickled["worker"]["packed"] == 0, pickled
    assert pickled["received"]["pickled"] == pickled["worker"]["pickled"] and pickled["received"]["packed"] == 0


def test_the_engine_process_takes_a_traces_invokes_pickled_once(engine_process):
    """With the engine in its own process the caller pickles a trace's invokes once, together, and sends the bundle
    to the worker ahead of the requests (one RPC), where the first request unpickles it: the results equal one
    pickle per invoke bit for bit, and ``STREAMSCOPE_BUNDLE_INVOKES=0`` moves no counter."""
    bundles = engine_process["bundles"]
    assert bundles["same"] == "ok", bundles["same"]
    assert bundles["moved_bundled"] == {"bundles": 1, "invokes": 3, "loads": 0, "received": 0, "worker_bundles": 0,
                                        "worker_invokes": 0, "worker_loads": 1, "worker_received": 1}, bundles
    assert set(bundles["moved_one_each"].values()) == {0}, bundles


def test_the_engine_process_serves_after_the_errors(engine_process):
    assert engine_process["serves_after"]


@in_process
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


def steer_at_every_step(model, steps: int, vector: torch.Tensor, invokes: int = 1) -> None:
    """`invokes` invokes (a prompt each), each adding `vector` to a block's layer_output at each of `steps`
    generated tokens."""
    with model.trace(max_tokens=steps, temperature=0.0, ignore_eos=True) as tracer:
        for index in range(invokes):
            with tracer.invoke(PROMPTS[index % len(PROMPTS)]):
                for _ in tracer.iter[:steps]:
                    model.layers[STEER_BLOCK].layer_output[:] += vector


def worker_costs(model, steps: int, monkeypatch, invokes: int = 1) -> tuple[dict, dict, int]:
    """The torch ops dispatched on the trace's worker greenlets and in the landing of the step's held write-backs
    (`write_batch`, on the engine's side), by name, and the calls of nnsight's own eproperty read, over one
    `steer_at_every_step`."""
    import collections

    from greenlet import getcurrent
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: collections.Counter = collections.Counter()
    landing: collections.Counter = collections.Counter()
    reads = [0]
    inside = [False]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if inside[0]:
                landing[str(func)] += 1
            elif getattr(getcurrent(), "mediator", None) is not None:  # on a worker: the invoke's own work
                ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    nnsight_read = seam.eproperty.__get__
    apply = write_batch._apply

    def counted_read(self, obj, owner=None):
        reads[0] += obj is not None
        return nnsight_read(self, obj, owner)

    def counted_apply(run):
        inside[0] = True
        try:
            apply(run)
        finally:
            inside[0] = False

    vector = torch.linspace(-1, 1, model.hidden_size)
    with monkeypatch.context() as patch:
        patch.setattr(seam.eproperty, "__get__", counted_read)
        patch.setattr(write_batch, "_apply", counted_apply)
        # The scans read as on a device (deferred to the invoke's end); on the host they are read at the write.
        patch.setattr(nonfinite, "READ_ON_THE_HOST", False)
        with Counting():
            steer_at_every_step(model, steps, vector, invokes)
    return dict(ops), dict(landing), reads[0]


def per_step(short: dict, long: dict, steps: int) -> dict:
    counts = {name: (long.get(name, 0) - short.get(name, 0)) / steps for name in set(short) | set(long)}
    return {name: count for name, count in counts.items() if count}


@in_process
def test_a_steer_at_every_step_costs_each_step_the_same_few_ops(model, monkeypatch):
    """What an invoke adds per step is exact: its read and its edit on its worker, and, held to the end of the
    block's visit, its write-back, in the fewest torch ops streamscope knows for them (on a GPU each op that is not
    a view is a kernel launch, `item` a wait for the device). A change that falls back to a longer path (nnsight's
    own eproperty read, a NaN check read back per write, a dtype conversion that is not needed, a write-back made
    on the worker) changes these counts."""
    short, short_landing, short_reads = worker_costs(model, 2, monkeypatch)
    long, long_landing, long_reads = worker_costs(model, 5, monkeypatch)
    assert per_step(short, long, 3) == {
        # The read: the block's two halves summed (a new tensor), viewed [1, tokens, hidden].
        "aten.add.Tensor": 1, "aten.unsqueeze.default": 1,
        # The user's `[:] += vector`: a slice view, the add in place, the copy of the slice onto itself (torch
        # sees the same memory and copies nothing).
        "aten.slice.Tensor": 1, "aten.add_.Tensor": 1, "aten.copy_.default": 1,
        # The write-back, held for the visit's end: the value viewed in the engine's layout (the read's own copy,
        # its shape and dtype as served, is not checked again).
        "aten.reshape.default": 1,
    }, per_step(short, long, 3)
    assert per_step(short_landing, long_landing, 3) == {
        # The write-back as it lands: the NaN/inf scan (the finite entries of each row counted, of the written
        # value and of the model's own, stacked and left on the device, or on a GPU copied to the host without a
        # wait: nothing is read back per step), and the change added to the hidden half (the halves summed, the
        # difference, the add in place: bit for bit the bulk path's change).
        "aten.isfinite.default": 2, "aten.sum.dim_IntList": 2, "aten.stack.default": 1,
        "aten.add.Tensor": 1, "aten.sub.Tensor": 1, "aten.add_.Tensor": 1,
    }, per_step(short_landing, long_landing, 3)
    # The scans are read once, together, when the invoke ends: one look at their counts, whatever the steps.
    assert short.get("aten.cat.default") == long.get("aten.cat.default") == 1, (short, long)
    assert long_reads == short_reads, "a read of a streamscope value went through nnsight's eproperty read"


@in_process
def test_a_steps_write_backs_land_as_one_set_of_kernels_whatever_the_invokes(model, monkeypatch):
    """Three invokes editing the block at every step: each invoke's own ops are one invoke's, and their
    write-backs land together, in the kernels of one invoke's and one concatenation of the three values."""
    short, short_landing, _ = worker_costs(model, 2, monkeypatch, invokes=3)
    long, long_landing, _ = worker_costs(model, 5, monkeypatch, invokes=3)
    assert per_step(short, long, 3 * 3) == {
        "aten.add.Tensor": 1, "aten.unsqueeze.default": 1, "aten.slice.Tensor": 1, "aten.add_.Tensor": 1,
        "aten.copy_.default": 1, "aten.reshape.default": 1,
    }, per_step(short, long, 9)
    assert per_step(short_landing, long_landing, 3) == {
        # The three spans' rows of each half as one view, the values concatenated, then one invoke's kernels.
        "aten.as_strided.default": 2, "aten.cat.default": 1,
        "aten.isfinite.default": 2, "aten.sum.dim_IntList": 2, "aten.stack.default": 1,
        "aten.add.Tensor": 1, "aten.sub.Tensor": 1, "aten.add_.Tensor": 1,
    }, per_step(short_landing, long_landing, 3)


def steered_three_ways(model, steps: int) -> tuple[list, list]:
    """Three invokes, each adding its own vector to the block at every step; the last reads its edit back in
    the same visit. Each invoke's logits at every step, and what the last read back."""
    vectors = [torch.linspace(-1, 1, model.hidden_size) * scale for scale in (0.5, -1.0, 2.0)]
    with model.trace(max_tokens=steps, temperature=0.0, ignore_eos=True) as tracer:
        logits = list().save()
        read_back = list().save()
        for index, vector in enumerate(vectors):
            with tracer.invoke(PROMPTS[index % len(PROMPTS)]):
                mine = []
                for _ in tracer.iter[:steps]:
                    model.layers[STEER_BLOCK].layer_output[:] += vector
                    if index == 2:  # the same value again, in the same visit of the block: it holds the edit
                        read_back.append(model.layers[STEER_BLOCK].layer_output.clone())
                    mine.append(model.logits.clone())
                logits.append(torch.cat(mine))
    return list(logits), list(read_back)


@in_process
def test_write_backs_held_to_the_visits_end_equal_each_made_at_once(model, monkeypatch):
    """Holding the write-backs to the end of the visit changes when they land and nothing else: three invokes
    steering every step with their own vectors, one of them reading its edit back in the same visit, give bit for
    bit the logits and values of the same trace with each write-back made on its worker as it goes."""
    runs = []
    apply = write_batch._apply

    def counted(run):
        runs.append(len(run))
        apply(run)

    monkeypatch.setattr(write_batch, "_apply", counted)
    held, held_back = steered_three_ways(model, 4)
    assert runs and max(runs) == 3, runs  # the three invokes' write-backs did land together
    monkeypatch.setattr(write_batch, "span", lambda hidden, residual: None)
    runs.clear()
    at_once, at_once_back = steered_three_ways(model, 4)
    assert not runs
    for mine, theirs in zip(held + held_back, at_once + at_once_back):
        assert torch.equal(mine, theirs)
    assert len(held_back) == 4


def edit_then_swap(model) -> list:
    """One invoke edits the block's stream in place at every step (held to the visit's end); a later invoke swaps
    the block's raw output for a copy of its own rows (nnsight splices a swap into a new batch tensor). The first
    invoke's logits at every step."""
    vector = torch.linspace(-1, 1, model.hidden_size)
    with model.trace(max_tokens=3, temperature=0.0, ignore_eos=True) as tracer:
        logits = list().save()
        with tracer.invoke(PROMPTS[0]):
            for _ in tracer.iter[:3]:
                model.layers[STEER_BLOCK].layer_output[:] += vector
                logits.append(model.logits.clone())
        with tracer.invoke(PROMPTS[1]):
            for _ in tracer.iter[:3]:
                hidden, residual = model.layers[STEER_BLOCK].output
                model.layers[STEER_BLOCK].output = (hidden * 1, residual * 1)
    return list(logits)


@in_process
def test_an_edit_held_for_the_visits_end_lands_before_another_invokes_swap(model, monkeypatch):
    """A swap made after a held edit, in the same visit, copies the batch into a new tensor: the held edit lands
    first, so it is in the batch the model goes on with, as when each write-back is made at once."""
    held = edit_then_swap(model)
    monkeypatch.setattr(write_batch, "span", lambda hidden, residual: None)
    at_once = edit_then_swap(model)
    for mine, theirs in zip(held, at_once, strict=True):
        assert torch.equal(mine, theirs)
