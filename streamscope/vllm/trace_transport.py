"""A vLLM trace's transport: its invokes on their way to the worker, its saves on their way home.

streamscope's own, not an adapter: nnsight's vLLM client pickles each invoke of a trace into its request, and
its worker answers a collect with the saves pickled, tensor by tensor, even where the engine runs in the
caller's process. Here

* a worker in the caller's process hands the saves over as tensors (`HandedSaves`), with only the structure
  around them pickled; a worker in another process packs them into one buffer (`PACKED_SAVES`), a device's
  tensors copied to the host at once; ``STREAMSCOPE_SAVES_TRANSPORT=pickle`` keeps nnsight's pickling;
* a trace's invokes are pickled once, together, as one bundle (`bundle_interventions`), kept in this process
  for a worker here or sent ahead of the requests to workers elsewhere (`take_bundle`).

Each plugs into nnsight at one name its vLLM modules cross processes with, replaced through the nnsight seam
(`streamscope.nnsight_seam.vllm_modeling`: `answer_collects_with`, `read_collects_with`, `send_invokes_with`,
`load_invokes_with`, `attach_invokes_with`); nothing here reaches nnsight's internals itself.
`transport_counts`, `received_counts` and `bundle_counts` say which way each went, per process.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import time
import uuid
import warnings
from functools import partial
from typing import Any, Callable

import numpy
import torch

from ..nnsight_seam.vllm_modeling import (answer_collects_with, attach_invokes_with, load_invokes_with,
                                          prompted_invokes, read_collects_with, send_invokes_with)

__all__ = ["HandedSaves", "hand_saves_over", "handing_over", "saves_transport", "SAVES_TRANSPORT_ENV",
           "transport_counts", "received_counts", "PACKED_SAVES", "pack_saves_in_this_process",
           "bundle_interventions", "bundle_counts", "take_bundle", "HERE"]


# A vLLM trace's saves on their way home: handed over as tensors where the engine shares the caller's process.

#: ``pickle`` makes every vLLM trace send its saves pickled, as nnsight does, even with the engine in this process.
SAVES_TRANSPORT_ENV = "STREAMSCOPE_SAVES_TRANSPORT"
_TRANSPORTS = ("auto", "pickle")
#: The process whose vLLM client takes saves handed over (set by `hand_saves_over`; a forked child differs).
_CLIENT_PID: list[int] = []
#: Set while a streamscope worker answers a collect (`handing_over`): another engine's worker (raw nnsight's, in
#: the same process) keeps nnsight's pickled answer.
_HANDING: list[bool] = []
#: Collects answered each way, per process (`transport_counts`): counted where the worker runs.
_COUNTS: dict[str, float] = {"handed": 0, "pickled": 0, "tensors_handed": 0, "packed": 0, "tensors_packed": 0,
                              "bytes_packed": 0, "seconds_pickling": 0.0, "seconds_packing": 0.0}
#: Collects read each way by this process's vLLM clients (`received_counts`): counted where the caller runs.
_RECEIVED: dict[str, float] = {"handed": 0, "packed": 0, "pickled": 0, "seconds_handed": 0.0, "seconds_packed": 0.0,
                               "seconds_pickled": 0.0}


def _compact_reduce(value: Any) -> Any:
    """A save's pickler's `reducer_override`: a plain tensor that views part of a larger storage is pickled as its
    clone, by nnsight's compact rule; anything else as pickle does (``NotImplemented``)."""
    if isinstance(value, torch.Tensor) and _plain(value) and (
            value.untyped_storage().nbytes() > value.numel() * value.element_size()):
        return value.clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return NotImplemented


class HandedSaves:
    """One collect's saves, from a vLLM worker to the client in the same process, with no tensor pickled.

    nnsight's worker pickles what a trace saved (``dumps_compact``) and its
    engine unpickles it, even where both are one process: a trace that saves
    every block's activations copies them to host bytes and back. Here the
    structure around the tensors (dicts, lists, the user's own objects, an
    error's record) is still pickled, so the caller gets the same new objects
    and the same identities the pickled path gives; every plain tensor travels
    beside it as a device-side copy taken by nnsight's own rule: a tensor that
    views part of a larger storage (a read narrowed out of the step's batch)
    comes home as a copy of itself (``clone``), any other with a copy of its
    whole storage at the same offset and strides, which is what unpickling
    rebuilds. The copy is what makes it the caller's: the model's tensors are
    inference tensors that later steps may write over.
    """

    __slots__ = ("structure", "tensors")

    def __init__(self, structure: bytes, tensors: list) -> None:
        self.structure = structure
        self.tensors = tensors


def _owned_copy(tensor: Any) -> Any:
    """`tensor` as unpickling it would rebuild it: values, dtype, device, shape, strides, offset; not an
    inference tensor (the copy is made outside inference mode)."""
    with torch.inference_mode(False):
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            return tensor.clone()  # nnsight's compact rule: a view of a larger storage comes home as itself alone
        storage = tensor.untyped_storage().clone()
        copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        copy.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
        copy.requires_grad_(tensor.requires_grad)
        return copy


def _plain(tensor: Any) -> bool:
    """Whether `tensor` is a dense tensor over one storage (sparse, quantized and conjugated ones are pickled)."""
    return (tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_conj()
            and not tensor.is_neg())


def _pack(collected: Any, compact: Callable[[Any], bytes]) -> Any:
    """`collected` as `HandedSaves` for a client of this process, packed (`_pack_into_buffer`) for a client in
    another; pickled by `compact` (nnsight's) for a worker no streamscope client set up, or where asked."""
    # Read, not checked: the worker must answer whatever the setting (`hand_saves_over` refused a bad one).
    if not _HANDING or os.environ.get(SAVES_TRANSPORT_ENV) == "pickle":
        _COUNTS["pickled"] += 1
        started = time.perf_counter()
        pickled = compact(collected)
        _COUNTS["seconds_pickling"] += time.perf_counter() - started
        return pickled
    if not _CLIENT_PID or _CLIENT_PID[0] != os.getpid():
        started = time.perf_counter()
        packed = _pack_into_buffer(collected)
        _COUNTS["seconds_packing"] += time.perf_counter() - started
        return packed

    tensors: list = []

    def hand(value: torch.Tensor) -> int:
        tensors.append(_owned_copy(value))
        return len(tensors) - 1

    structure = _pickled_apart(collected, hand)
    _COUNTS["handed"] += 1
    _COUNTS["tensors_handed"] += len(tensors)
    return HandedSaves(structure, tensors)


def _pickled_apart(collected: Any, record: Callable[[torch.Tensor], Any]) -> bytes:
    """`collected` pickled with each dense tensor left out, as the persistent id `record` gives it (called once
    per tensor object: one saved twice stays one object, as pickle's memo keeps it); every other value as
    nnsight's compact rule pickles it."""
    ids: dict[int, Any] = {}
    kept: list = []  # each recorded tensor, alive while pickling: no other object takes its id meanwhile

    class TensorsApartPickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if type(value) is not torch.Tensor or not _plain(value):
                return None
            if id(value) not in ids:
                kept.append(value)
                ids[id(value)] = record(value)
            return ids[id(value)]

        def reducer_override(self, value: Any) -> Any:
            return _compact_reduce(value)

    buffer = io.BytesIO()
    TensorsApartPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(collected)
    return buffer.getvalue()


def _unpack(payload: Any) -> Any:
    """What a worker's collect answered, as nnsight's engine reads it (a pickled payload is unpickled)."""
    if _is_packed(payload):
        return _unpack_buffer(payload)
    if not isinstance(payload, HandedSaves):
        return pickle.loads(payload)
    tensors = payload.tensors

    class StructureUnpickler(pickle.Unpickler):
        def persistent_load(self, key: Any) -> Any:
            return tensors[key]

    return StructureUnpickler(io.BytesIO(payload.structure)).load()


class _HandoverPickle:
    """The ``pickle`` nnsight's vLLM engine module calls: ``loads`` also takes `HandedSaves`; the rest is pickle's."""

    def __init__(self, pickle_module: Any) -> None:
        self._pickle = pickle_module

    def loads(self, payload: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if isinstance(payload, HandedSaves) or _is_packed(payload):
            kind = "handed" if isinstance(payload, HandedSaves) else "packed"
            loaded = _unpack(payload)
        else:
            kind = "pickled"
            loaded = self._pickle.loads(payload, *args, **kwargs)
        _RECEIVED[kind] += 1
        _RECEIVED[f"seconds_{kind}"] += time.perf_counter() - started
        return loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pickle, name)


def _transport() -> str:
    chosen = os.environ.get(SAVES_TRANSPORT_ENV, "auto")
    if chosen not in _TRANSPORTS:
        raise ValueError(f"{SAVES_TRANSPORT_ENV}={chosen!r}: use one of {_TRANSPORTS} ('auto' hands a vLLM "
                         f"trace's saves over as tensors where the engine runs in this process; 'pickle' always "
                         f"pickles them, as nnsight does).")
    return chosen


def hand_saves_over() -> None:
    """Let vLLM traces of this process take their saves as tensors from a worker in this process (idempotent).

    Called in the client's process before its engine starts. nnsight's
    worker answers a collect with ``dumps_compact(collected)`` and its engine
    reads each rank's answer with ``pickle.loads`` (``merge_collected``): the
    first now answers with `HandedSaves` where the worker runs in the process
    that called this (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with one rank), and
    packs them into one buffer anywhere else (an engine process, a forked
    rank: its pid differs; `pack_saves_in_this_process`); the second reads
    any of the three. ``STREAMSCOPE_SAVES_TRANSPORT=pickle`` keeps the pickled
    path everywhere.
    """
    _transport()  # a bad setting is refused before an engine starts
    _CLIENT_PID[:] = [os.getpid()]
    pack_saves_in_this_process()
    read_collects_with(_HandoverPickle)  # the pickle nnsight's engine reads a collect with


@contextlib.contextmanager
def handing_over() -> Any:
    """Within the block (a streamscope worker's ``collect_nnsight``), a collect may answer with `HandedSaves`."""
    _HANDING.append(True)
    try:
        yield
    finally:
        _HANDING.pop()


@contextlib.contextmanager
def saves_transport(name: str) -> Any:
    """Within the block, vLLM traces of this process send their saves by `name` (``"auto"`` or ``"pickle"``)."""
    before = os.environ.get(SAVES_TRANSPORT_ENV)
    os.environ[SAVES_TRANSPORT_ENV] = name
    try:
        _transport()
        yield
    finally:
        if before is None:
            os.environ.pop(SAVES_TRANSPORT_ENV, None)
        else:
            os.environ[SAVES_TRANSPORT_ENV] = before


def transport_counts() -> dict[str, float]:
    """How this process's vLLM workers have answered collects so far: ``handed`` (as `HandedSaves`),
    ``packed`` (one buffer for a client in another process, `PACKED_SAVES`), ``pickled`` (nnsight's pickled
    payload), ``tensors_handed`` / ``tensors_packed`` (tensors carried by those), ``bytes_packed`` (their buffers'
    size). An engine process's worker counts in that process: a streamscope worker answers them through
    ``collective_rpc("streamscope_transport_counts")``."""
    return dict(_COUNTS)


def received_counts() -> dict[str, float]:
    """How this process's vLLM clients have read collects so far (one per rank's answer): ``handed``, ``packed``,
    ``pickled`` (raw nnsight's engines in this process count too), and ``seconds_`` each, reading them."""
    return dict(_RECEIVED)


# A vLLM trace's saves from a worker in another process: one buffer, not one pickle per tensor.

#: The first item of a packed collect (`_pack_into_buffer`).
PACKED_SAVES = "streamscope-packed-saves-1"
#: Where each tensor's bytes start in a packed buffer: aligned, so a slot can be viewed as any dtype on the device.
_SLOT_ALIGN = 64
#: The most bytes of saves packed together on a device before their copy to the host.
_DEVICE_PACK = 256 * 2**20


def pack_saves_in_this_process() -> None:
    """Let a streamscope worker of this process answer collects as `HandedSaves` or packed (idempotent).

    Replaces the name nnsight's worker pickles a collect with
    (``dumps_compact``) by `_pack`, which still pickles unless a streamscope
    worker answers (`handing_over`). Called by `hand_saves_over` in the
    client's process and by a streamscope worker in its own
    (``streamscope_hand_saves_over``).
    """
    answer_collects_with(_pack)


def _is_packed(payload: Any) -> bool:
    # After vLLM's msgpack the tuple is a list and the bytearray bytes.
    return isinstance(payload, (list, tuple)) and len(payload) == 3 and payload[0] == PACKED_SAVES


def _pack_into_buffer(collected: Any) -> list:
    """`collected` for a client in another process: ``[PACKED_SAVES, structure, buffer]``.

    ``structure`` is `collected` pickled with every plain tensor replaced by a
    record of what unpickling rebuilds (dtype, device, the size of its
    storage, shape, strides, storage offset, ``requires_grad``) and where its
    storage's bytes sit in ``buffer``, one ``bytearray`` holding every saved
    tensor's. Which bytes is nnsight's compact rule, as in `HandedSaves`: a
    tensor that views part of a larger storage travels as a copy of itself
    (a contiguous one as its own bytes, with its strides, as its clone would
    be; another as its clone), any other with its whole storage. The tensors
    of one device are packed into one device buffer and copied to the host
    once; a CPU tensor's bytes are copied straight in (by ``memcpy``, not a
    torch kernel: no thread pool to wake for a few kilobytes). Pickling
    instead copies and serializes each tensor on its own. Both parts are
    plain ``bytes``-like values, which vLLM's ``collective_rpc`` carries from
    an engine process natively.
    """
    slots: list[tuple[Any, int]] = []  # (the bytes to send: a uint8 view on the tensor's device, buffer offset)
    end = 0

    def record(value: Any) -> tuple:
        nonlocal end
        with torch.inference_mode(False):
            size = value.numel() * value.element_size()
            if value.untyped_storage().nbytes() > size and not value.is_contiguous():
                value = value.clone()  # its strides are the clone's, as nnsight's compact rule pickles it
            if value.untyped_storage().nbytes() > size:  # contiguous: its own bytes are its clone's, strides kept
                first, nbytes, offset = value.storage_offset() * value.element_size(), size, 0
            else:
                first, nbytes, offset = 0, value.untyped_storage().nbytes(), value.storage_offset()
            source = torch.empty(0, dtype=torch.uint8, device=value.device).set_(
                value.untyped_storage(), first, (nbytes,), (1,))
        start = end
        end += -(-nbytes // _SLOT_ALIGN) * _SLOT_ALIGN
        slots.append((source, start))
        return (len(slots) - 1, str(value.dtype).removeprefix("torch."), str(value.device), start, nbytes,
                tuple(value.shape), value.stride(), offset, value.requires_grad)

    structure = _pickled_apart(collected, record)
    buffer = bytearray(end)
    _fill(buffer, slots)
    _COUNTS["packed"] += 1
    _COUNTS["tensors_packed"] += len(slots)
    _COUNTS["bytes_packed"] += end
    return [PACKED_SAVES, structure, buffer]


def _fill(buffer: bytearray, slots: list) -> None:
    """Copy each slot (``(source, start)``: a tensor's bytes as a uint8 view on its device, where they go in
    `buffer`) into `buffer`: a CPU tensor's straight in, a device's tensors through `_copy_home`."""
    view = memoryview(buffer)
    on_devices: dict[Any, list] = {}
    for source, start in slots:
        if source.device.type == "cpu":
            view[start:start + source.numel()] = source.numpy()
        elif source.numel():
            on_devices.setdefault(source.device, []).append((source, start))
    for placed in on_devices.values():
        # The device's tensors packed into buffers there of at most _DEVICE_PACK bytes, each copied to the host at
        # once: one copy for a collect's saves up to that size, and no more device memory than that beside them.
        group: list = []
        for slot in placed:
            if group and slot[1] + slot[0].numel() - group[0][1] > _DEVICE_PACK:
                _copy_home(group, buffer)
                group = []
            group.append(slot)
        if group:
            _copy_home(group, buffer)


def _copy_home(group: list, buffer: bytearray) -> None:
    """Copy `group` (``(source, start)`` slots on one device, in order) into `buffer`: packed into one buffer on
    the device and copied to the host once (a lone slot is copied as it is)."""
    low = group[0][1]
    high = group[-1][1] + group[-1][0].numel()
    host = torch.frombuffer(buffer, dtype=torch.uint8, count=high - low, offset=low)
    with torch.inference_mode(False):
        if len(group) == 1:
            host.copy_(group[0][0])
            return
        packed = torch.empty(high - low, dtype=group[0][0].dtype, device=group[0][0].device)
        for source, start in group:
            packed[start - low:start - low + source.numel()].copy_(source)
        host.copy_(packed)


def _unpack_buffer(payload: Any) -> Any:
    """A packed collect (`_pack_into_buffer`) as unpickling nnsight's payload gives it: each tensor its own storage,
    on its device, with its dtype, shape, strides, storage offset and ``requires_grad``."""
    _, structure, buffer = payload
    rebuilt: dict[int, Any] = {}
    staged: dict[str, Any] = {}  # per device: the buffer copied there once
    host = numpy.frombuffer(buffer, dtype=numpy.uint8)

    def storage_for(device: str, start: int, nbytes: int) -> Any:
        if device == "cpu":
            owned = torch.empty(nbytes, dtype=torch.uint8)
            owned.numpy()[:] = host[start:start + nbytes]  # a memcpy, as unpickling's
            return owned.untyped_storage()
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
        if device not in staged:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only bytes: only read, by the copy to the device
                staged[device] = torch.from_numpy(host).to(device)  # one copy of the buffer there, sliced there
        return staged[device][start:start + nbytes].clone().untyped_storage()

    class PackedUnpickler(pickle.Unpickler):
        def persistent_load(self, key: Any) -> Any:
            slot, dtype, device, start, nbytes, shape, stride, offset, requires_grad = key
            if slot not in rebuilt:
                storage = storage_for(device, start, nbytes)
                tensor = torch.empty(0, dtype=getattr(torch, dtype), device=device)
                tensor.set_(storage, offset, shape, stride)
                tensor.requires_grad_(requires_grad)
                rebuilt[slot] = tensor
            return rebuilt[slot]

    with torch.inference_mode(False):
        return PackedUnpickler(io.BytesIO(structure)).load()


# A vLLM trace's interventions on their way to the worker: one pickle per trace, kept here for a worker of this
# process, or sent ahead of the trace's requests to workers elsewhere.

#: The bundles of this process's last traces, by trace id (oldest first): their bytes, the unpickled invokes until
#: every one is taken, which are taken.
_BUNDLES: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
#: How many bundles a worker keeps while some of their invokes have not arrived (an aborted request's never does).
_BUNDLES_KEPT = 16
#: While a streamscope client attaches a trace's invokes: the trace's bundle, built on the first invoke's dumps.
_ATTACHING: list[dict] = []
_BUNDLE_COUNTS = {"bundles": 0, "invokes": 0, "loads": 0, "received": 0}
_MEMBER = "streamscope-bundle"


def _bundled_dumps(mediator: Any, *args: Any, dumps: Callable) -> Any:
    """nnsight's ``dumps(mediator)`` for a request, or, while a streamscope trace attaches its invokes, a reference
    to the trace's bundle (every invoke pickled together, once)."""
    attaching = _ATTACHING[-1] if _ATTACHING else None
    if attaching is None or id(mediator) not in attaching["index"]:
        return dumps(mediator, *args)
    if attaching["trace"] is None:
        trace = uuid.uuid4().hex
        _BUNDLES[trace] = {"bytes": dumps(attaching["mediators"], *args), "loaded": None, "taken": set(),
                           "count": len(attaching["mediators"])}
        attaching["trace"] = trace
        _BUNDLE_COUNTS["bundles"] += 1
        _BUNDLE_COUNTS["invokes"] += len(attaching["mediators"])
    return (_MEMBER, attaching["trace"], attaching["index"][id(mediator)])


def _bundled_loads(payload: Any, *args: Any, loads: Callable, **kwargs: Any) -> Any:
    """nnsight's worker-side ``loads`` of a request's intervention; a bundle reference takes its invoke from the
    trace's bundle, unpickled by the first of its requests to arrive."""
    if not (isinstance(payload, (tuple, list)) and len(payload) == 3 and payload[0] == _MEMBER):
        return loads(payload, *args, **kwargs)
    _, trace, index = payload
    entry = _BUNDLES.get(trace)
    if entry is None:
        raise RuntimeError("this request's intervention was bundled with its trace's others, and the bundle is gone: "
                           f"more than {_BUNDLES_KEPT} traces were attached while its requests waited. Run fewer "
                           "traces at once (or set STREAMSCOPE_BUNDLE_INVOKES=0).")
    _BUNDLE_COUNTS["loads"] += 1 if entry["loaded"] is None or index in entry["taken"] else 0
    if index in entry["taken"]:
        # A second request of the same invoke (one of the n sequences of a request with n > 1): its own copy, as
        # nnsight unpickles one for each.
        return loads(entry["bytes"], *args, **kwargs)[index]
    if entry["loaded"] is None:
        entry["loaded"] = loads(entry["bytes"], *args, **kwargs)
    entry["taken"].add(index)
    mediator = entry["loaded"][index]
    if len(entry["taken"]) == entry["count"]:
        entry["loaded"] = None  # every invoke is its request's now; the bytes stay for a late sibling sequence
    return mediator


#: What `bundle_interventions`'s ``route`` answers for an engine whose one worker runs in this process.
HERE = "here"


def bundle_interventions(client: type, route: Callable[[Any], Any]) -> None:
    """Let `client` (streamscope's vLLM model class) pickle a trace's invokes once, together (idempotent).

    nnsight pickles each invoke of a vLLM trace on its own (``dumps(mediator)``
    into its request's ``extra_args``) and the worker unpickles each: the
    model's whole envoy tree, the trace's globals and every tensor an invoke
    names travel once per invoke, and are rebuilt once per invoke. Here the
    invokes are pickled as one list instead, with one memo, so what they
    share is pickled and rebuilt once and stays shared in the worker, as it
    is in the caller's process (where every invoke of a trace runs against
    the same objects); each request carries a reference to the bundle, which
    the first of them to reach the worker unpickles.

    ``route(model)`` says where the bundle goes: `HERE` (the engine's one
    worker runs in this process, which keeps it), a function that hands it
    to every worker elsewhere before the requests are added (``send(trace,
    payload, count)``, each worker then calling `take_bundle`), or None for
    nnsight's own pickling per invoke. ``STREAMSCOPE_BUNDLE_INVOKES=0`` keeps
    nnsight's way everywhere.
    """
    send_invokes_with(_bundled_dumps)
    load_invokes_with(_bundled_loads)
    attach_invokes_with(client, partial(_attach_bundled, route=route))


def _attach_bundled(attach: Callable, model: Any, params: list, route: Callable[[Any], Any], **kwargs: Any) -> list:
    """nnsight's ``attach(model, params)`` of a trace's invokes to their requests, the invokes pickled as one
    bundle (`bundle_interventions`) where ``route(model)`` says where it goes and there are several."""
    mediators = prompted_invokes(model)
    send = route(model) if len(mediators) > 1 and os.environ.get("STREAMSCOPE_BUNDLE_INVOKES") != "0" else None
    if send is None:
        return attach(model, params, **kwargs)
    attaching: dict[str, Any] = {"mediators": mediators, "index": {id(m): i for i, m in enumerate(mediators)},
                                 "trace": None}
    _ATTACHING.append(attaching)
    try:
        attached = attach(model, params, **kwargs)
    finally:
        _ATTACHING.pop()
        _evict_bundles()
    if send is not HERE and attaching["trace"] is not None:
        entry = _BUNDLES.pop(attaching["trace"])
        send(attaching["trace"], entry["bytes"], entry["count"])
    return attached


def take_bundle(trace: str, payload: bytes, count: int) -> None:
    """Keep a trace's bundle (`bundle_interventions`), sent ahead of its requests, in this worker's process."""
    load_invokes_with(_bundled_loads)
    _BUNDLES[trace] = {"bytes": payload, "loaded": None, "taken": set(), "count": count}
    _BUNDLE_COUNTS["received"] += 1
    _evict_bundles()


def _evict_bundles() -> None:
    while len(_BUNDLES) > _BUNDLES_KEPT:
        _BUNDLES.popitem(last=False)


def bundle_counts() -> dict[str, int]:
    """This process's bundled traces so far: ``bundles`` pickled, ``invokes`` in them, ``loads`` (unpickled),
    ``received`` (sent here ahead of their requests, by a client in another process)."""
    return dict(_BUNDLE_COUNTS)
