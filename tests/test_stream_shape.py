"""The note `stream_shape` keeps per envoy of which modules of its chain record a stream shape."""

from __future__ import annotations

import gc
import weakref

import nnsight
import torch

from streamscope.blocks.envoy import record_stream_shape, stream_shape


def _tree() -> tuple[torch.nn.Module, nnsight.NNsight]:
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    return model, nnsight.NNsight(model)


def test_a_module_hooked_after_the_note_is_found():
    model, root = _tree()
    leaf = getattr(getattr(root, "0"), "0")
    model(torch.zeros(2, 3, 4))
    assert stream_shape(leaf) is None  # noted: nothing in the chain records
    record_stream_shape(model[0])  # the block gains its hook after the note was taken
    model(torch.zeros(2, 3, 4))
    assert stream_shape(leaf) == torch.Size([2, 3])
    model(torch.zeros(5, 1, 4))
    assert stream_shape(leaf) == torch.Size([5, 1])  # the shape itself is read at each call, never noted


def test_the_note_does_not_keep_the_model_alive():
    model, root = _tree()
    record_stream_shape(model[0])
    record_stream_shape(model[0][0])  # the envoy's own module records: its note names the envoy itself
    leaf = getattr(getattr(root, "0"), "0")
    model(torch.zeros(2, 3, 4))
    assert stream_shape(leaf) == torch.Size([2, 3])
    gone = [weakref.ref(model), weakref.ref(leaf), weakref.ref(root)]
    del model, root, leaf
    gc.collect()
    assert [ref() for ref in gone] == [None, None, None]
