"""The traces that check how a vLLM trace's saves come home, and the comparison they are held to.

Shared by tests/vllm/test_trace_transport.py (an engine in the test's process) and by the same file's engine
process run, a Python process that imports this module and calls `run_engine_process`, with
``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the engine core and its worker then run in a process of their own, and
every case runs twice on that one engine, once packed (the default) and once pickled as nnsight does
(``STREAMSCOPE_SAVES_TRANSPORT=pickle``, set in the worker's process through its RPC), and is compared bit for
bit. A trace body runs in the worker, which imports what it names (`Note`, `Refused`) from this module: tests/
is on every engine process's PYTHONPATH (tests/vllm/conftest.py). Imported, not run as a script: a second copy
of `Refused` under ``__main__`` would make its name ambiguous where the client rebuilds the worker's error.
"""

from __future__ import annotations

import json
import traceback
from typing import Any, Callable

import torch

GREEDY = {"temperature": 0.0, "max_tokens": 1}
PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Once upon a time"]


class Note:
    """A plain Python object a trace saves (defined at module level, so it pickles by reference)."""

    def __init__(self, text: str, values: list) -> None:
        self.text, self.values = text, values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Note) and (self.text, self.values) == (other.text, other.values)


class Refused(Exception):
    """Raised inside an invoke: it must come home with its type and message."""


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def same_tensor(got: torch.Tensor, pickled: torch.Tensor) -> None:
    """`got` is what unpickling gave `pickled`: type, dtype, device, shape, strides, storage offset and size, bits;
    and the caller's own tensor (not an inference tensor of the engine's), which it may edit in place."""
    assert type(got) is type(pickled) is torch.Tensor
    assert got.dtype == pickled.dtype and got.device == pickled.device
    assert got.shape == pickled.shape
    assert got.stride() == pickled.stride() and got.storage_offset() == pickled.storage_offset()
    assert got.untyped_storage().nbytes() == pickled.untyped_storage().nbytes()
    assert got.requires_grad == pickled.requires_grad
    assert torch.equal(bits(got), bits(pickled))  # bit for bit, NaNs and signed zeros included
    assert not got.is_inference(), "handed the engine's inference tensor, not the caller's copy"
    got.add_(0)  # the caller may edit it in place, as an unpickled tensor


def same(got: Any, pickled: Any) -> None:
    """Equal structures, tensors by `same_tensor`, errors by type and message."""
    assert type(got) is type(pickled), (type(got), type(pickled))
    if isinstance(got, torch.Tensor):
        same_tensor(got, pickled)
    elif isinstance(got, (list, tuple)):
        assert len(got) == len(pickled)
        for a, b in zip(got, pickled):
            same(a, b)
    elif isinstance(got, dict):
        assert got.keys() == pickled.keys()
        for key in got:
            same(got[key], pickled[key])
    elif isinstance(got, BaseException):
        assert str(got) == str(pickled)
    else:
        assert got == pickled


def views_slices_and_shared(model: Any) -> tuple:
    """Reads narrowed out of the step's batch, non-contiguous slices, a tensor and its view, one object under two
    names, and an expanded (stride-0) tensor."""
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


def check_views_slices_and_shared(got: tuple) -> None:
    """What the transport must keep beyond equality with the pickled path's values."""
    for pair in got[4]:
        assert pair[0] is pair[2], "one object saved twice came home as two"
        assert pair[1].untyped_storage().data_ptr() != pair[0].untyped_storage().data_ptr()
    assert not got[2][0].is_contiguous()  # the transposed read keeps its strides, as unpickled


def bfloat16_saves(model: Any) -> tuple:
    """bfloat16 saves from a float32 engine (an engine run in bfloat16 is the in-process test's): whole, narrowed,
    transposed, and every block stacked."""
    with model.trace(**GREEDY) as tracer:
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                outputs = [layer.layer_output for layer in model.layers]  # in the order the model computes them
                narrowed = outputs[0].to(torch.bfloat16)[:, 1:, :7].save()
                transposed = outputs[1].to(torch.bfloat16).transpose(1, 2).save()
                blocks = torch.stack(outputs).to(torch.bfloat16).save()
    return blocks, narrowed, transposed


def python_objects(model: Any) -> tuple:
    """Saves that are not tensors (numbers, strings, containers, the user's own class, tensors inside them)."""
    with model.trace(**GREEDY) as tracer:
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                hidden = model.layers[0].layer_output
                summary = {"norm": float(hidden.norm()), "tokens": int(hidden.shape[1]), "name": "block 0",
                           "rows": (hidden[0, 0], [hidden[0, -1], None])}.save()
                note = Note(prompt[:5], [1, 2.5, "x"]).save()
    return summary, note


def error_in_invoke(failing: int) -> Callable[[Any], BaseException]:
    """A trace whose invoke `failing` raises `Refused` after saving; returns what the trace raised."""
    def trace(model: Any) -> BaseException:
        try:
            with model.trace(**GREEDY) as tracer:
                for index, prompt in enumerate(PROMPTS):
                    with tracer.invoke(prompt):
                        model.layers[0].layer_output.save()
                        if index == failing:
                            raise Refused(f"invoke {index} refuses")
        except Exception as raised:  # noqa: BLE001 (the error is the result)
            return raised
        raise AssertionError("the trace raised nothing")
    return trace


def steered_rows(model: Any) -> tuple:
    """Three invokes that edit block 0 and read block 1 into one list made above them (a container the invokes
    share, as they share everything of the trace in the caller's process), and the logits."""
    prompts = PROMPTS + ["Water boils at"]
    vector = torch.arange(model.hidden_size, dtype=torch.float32) / model.hidden_size
    rows = [None] * len(prompts)
    with model.trace(**GREEDY) as tracer:
        rows.save()
        for index, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                stream = model.layers[0].layer_output
                stream[:, -1] += vector.to(stream.device, stream.dtype)  # (on a GPU engine, moved there)
                rows[index] = model.layers[1].layer_output[0, -1]
                logits = model.logits.save()
    assert all(row is not None for row in rows)
    return rows, logits


def bundled_and_one_each(model: Any, counts: Callable[[], dict]) -> dict:
    """`steered_rows` with its invokes pickled together (the default) and one by one (``STREAMSCOPE_BUNDLE_INVOKES=0``):
    the two results, and what `counts()` (the bundle counters that matter: the caller's, and the worker's where it
    runs elsewhere) moved each way."""
    import os

    before = counts()
    bundled = steered_rows(model)
    middle = counts()
    os.environ["STREAMSCOPE_BUNDLE_INVOKES"] = "0"
    try:
        one_each = steered_rows(model)
    finally:
        del os.environ["STREAMSCOPE_BUNDLE_INVOKES"]
    return {"bundled": bundled, "one_each": one_each, "moved_bundled": moved(before, middle),
            "moved_one_each": moved(middle, counts())}


#: The engine process's cases: name -> the trace.
CASES: dict[str, Callable[[Any], Any]] = {
    "views_slices_and_shared": views_slices_and_shared,
    "bfloat16": bfloat16_saves,
    "python_objects": python_objects,
    "error_in_invoke_0": error_in_invoke(0),
    "error_in_invoke_1": error_in_invoke(1),
}


def worker_counts(model: Any) -> dict:
    """The transport counts of the engine's worker process (`trace_transport.transport_counts` there), rank 0's."""
    return model.vllm_entrypoint.collective_rpc("streamscope_transport_counts")[0]


def moved(before: dict, after: dict) -> dict:
    return {key: after[key] - before[key] for key in after}


def run_engine_process(path: str, out: str, engine_kwargs: dict) -> None:
    """Every case packed and pickled on one engine in its own process; writes ``{case: "ok" or the failure}`` and
    what the counters moved each way to `out` (JSON)."""
    import streamscope
    from streamscope.vllm import trace_transport

    report: dict = {"cases": {}, "counts": {}}
    model = streamscope.load(path, engine="vllm", **engine_kwargs)
    try:
        for name, trace in CASES.items():
            try:
                moves = {}
                results = {}
                for transport in ("auto", "pickle"):
                    model.vllm_entrypoint.collective_rpc("streamscope_saves_transport",
                                                         args=(None if transport == "auto" else transport,))
                    worker, received = worker_counts(model), trace_transport.received_counts()
                    results[transport] = trace(model)
                    moves[transport] = {"worker": moved(worker, worker_counts(model)),
                                        "received": moved(received, trace_transport.received_counts())}
                report["counts"][name] = moves
                same(results["auto"], results["pickle"])
                if name == "views_slices_and_shared":
                    check_views_slices_and_shared(results["auto"])
                if name.startswith("error_in_invoke"):
                    assert type(results["auto"]) is Refused, type(results["auto"])
                    assert f"invoke {name[-1]} refuses" in str(results["auto"])
                report["cases"][name] = "ok"
            except Exception:  # noqa: BLE001 (reported to the test, which fails on it)
                report["cases"][name] = traceback.format_exc()
        try:
            def bundle_counts() -> dict:
                worker = model.vllm_entrypoint.collective_rpc("streamscope_bundle_counts")[0]
                return {**{f"worker_{key}": value for key, value in worker.items()}, **trace_transport.bundle_counts()}

            bundling = bundled_and_one_each(model, bundle_counts)
            same(bundling["bundled"], bundling["one_each"])
            report["bundles"] = {"same": "ok", "moved_bundled": bundling["moved_bundled"],
                                 "moved_one_each": bundling["moved_one_each"]}
        except Exception:  # noqa: BLE001 (reported to the test, which fails on it)
            report["bundles"] = {"same": traceback.format_exc()}
        # The engine serves the next trace after the errors.
        with model.trace(**GREEDY) as tracer:
            with tracer.invoke(PROMPTS[1]):
                logits = model.logits.save()
        report["serves_after"] = list(logits.shape) == [1, model.vocab_size]
    finally:
        model.close()
    with open(out, "w") as handle:
        json.dump(report, handle)
