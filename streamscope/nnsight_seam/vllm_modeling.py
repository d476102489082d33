"""nnsight's vLLM integration: its batcher, its worker's model runner, its client, its tracer, and the points
where a trace's invokes leave the client and its saves come home.

Everything here imports vLLM on first use, not with streamscope. Read, not patched:

* the worker, runner and client classes streamscope subclasses (`NNsightGPUWorker`, `NNsightGPUModelRunner`,
  `VLLMClient`, loaded by name, `LAZY`), the tensor-parallel envoys (`ParallelEnvoy`, `parallel_envoys`), the
  client's worker class (``_WORKER_CLS``; `set_client_worker`), its engine start (``VLLM._load_sync``, replaced for
  engines that keep vLLM's compile: `start_own_engines`), its meta copy's build (``VLLM._load_meta``, wrapped in
  a context: `build_meta_trees_within`), its collection of request outputs
  (``VLLM._collect``; `collect_requests`) and the error a request's output carries (``nnsight_error``;
  `take_request_error`). Upstream: a documented ``worker_cls=`` argument and an error hook on collection.
* the running invoke's token span (the vLLM batcher's ``batch_group``; `running_token_span`).

Patched, each once per process (idempotent, each patch marked on what it installs):

* ``VLLMBatcher.narrow`` (`narrow_spans_directly`): a tensor or a pair of tensors is narrowed to an invoke's
  token span directly, not through nnsight's generic walk, which costs a closure per tensor per invoke per step.
  Upstream: a ``Batcher`` subclass as the vLLM model's batcher (``_batcher_class``), or a fast path for tensors
  in nnsight's own ``narrow``.
* ``Requests.record`` (`record_saves_cheaply`): with nothing saved in the step, the names saved before the
  request was sent are noted without nnsight's walk of every name. Upstream: the same shortcut in nnsight.
* an interleaver's ``replay``, on the instance (`wrap_replay`): streamscope's per-step work at each replayed
  CUDA-graph tap. Upstream: a replay callback on nnsight's tapped interleaver. (The step's schedule, a vLLM
  runner's, is taken in through `streamscope.vllm_seam.after_schedule`.)
* nnsight's vLLM tracer, subclassed (`invoke_per_prompt_tracer`): several prompts run the body once each, an
  invoke per prompt. Upstream: a tracer option for that.
* the names a trace crosses processes with, each replaced by a wrapper of the original that
  `streamscope.vllm.trace_transport` supplies: the client's ``dumps`` of each invoke and
  ``VLLM._attach_mediators`` (`send_invokes_with`, `attach_invokes_with`), the worker's ``loads`` of each
  request's invoke (`load_invokes_with`), the worker's ``dumps_compact`` of a collect (`answer_collects_with`)
  and the ``pickle`` the engine reads a collect with (`read_collects_with`). Upstream: a pluggable serializer on
  nnsight's vLLM client, worker and engine (one for interventions, one for saves).
"""

from __future__ import annotations

import functools
import importlib
from functools import partial
from typing import Any, Callable, Optional

import torch
from nnsight.intervention.interleaver import Mediator
from nnsight.tracing.tracer import _saves

from .mediator import _SERVING, running_mediator

__all__ = ["narrow_spans_directly", "record_saves_cheaply", "running_token_span", "wrap_replay",
           "take_request_error", "collect_requests", "EachPrompt", "invoke_per_prompt_tracer",
           "set_client_worker", "start_own_engines", "build_meta_trees_within", "send_invokes_with",
           "attach_invokes_with", "load_invokes_with",
           "answer_collects_with", "read_collects_with", "prompted_invokes", "LAZY"]

#: nnsight's vLLM modules whose names a trace's transport replaces: the client's (each invoke's ``dumps``), the
#: worker's model runner (each request's ``loads``, a collect's ``dumps_compact``), the engine's (``pickle``).
_CLIENT = "nnsight.modeling.vllm.vllm"
_RUNNER = "nnsight.modeling.vllm.model_runners.GPUModelRunner"
_ENGINE = "nnsight.modeling.vllm.engines.engine"


def narrow_spans_directly() -> None:
    """Narrow a tensor, or a plain tuple of tensors, to a worker's token span on vLLM's flat token axis
    without nnsight's walk of the value.

    nnsight's vLLM batcher serves each worker parked on a visit its span of
    the step's tokens by walking the value generically (``util.apply``: a
    recursive call and a closure per tensor). A trace with an invoke per
    prompt has every value it reads narrowed so, once per invoke and step;
    the values a block hands on are a tensor or a pair. Those are narrowed
    here directly, each tensor by the batcher's own rule (``_token_dim``:
    tokens on dim 0, on dim 1 behind a leading 1, else not batched): the same
    views. Anything else (another container, a clone of each read) takes
    nnsight's path.
    """
    batcher: Any = _vllm_batcher()
    general = batcher.narrow
    if getattr(general, "streamscope_direct", False):
        return
    tensor_type = torch.Tensor

    def span(self: Any, tensor: Any, start: int, size: int) -> Any:
        total, shape = self.total, tensor.shape
        if shape[0] == total:
            return tensor.narrow(0, start, size)
        if len(shape) >= 2 and shape[0] == 1 and shape[1] == total:
            return tensor.narrow(1, start, size)
        return tensor

    def direct(self: Any, value: Any, group: Any) -> Any:
        if group is None or self.clone_reads:
            return general(self, value, group)
        if type(value) is tuple and len(value) == 2:
            first, second = value
            if isinstance(first, tensor_type) and isinstance(second, tensor_type):
                for serving in _SERVING:
                    serving(group)
                start, size = group
                return (span(self, first, start, size), span(self, second, start, size))
        elif isinstance(value, tensor_type):
            for serving in _SERVING:
                serving(group)
            return span(self, value, group[0], group[1])
        return general(self, value, group)

    setattr(direct, "streamscope_direct", True)  # marks the patch as applied (a function attribute)
    batcher.narrow = direct


def record_saves_cheaply() -> None:
    """Skip nnsight's per-step walk of a vLLM worker's names when the trace has saved nothing.

    At every step nnsight notes, on each scheduled worker, which of its names
    hold a saved value (``Requests.record``: each name's value looked up in the
    thread's set of saved ids), so the collect knows them. With nothing saved
    in the thread the answer is the names saved before the worker was sent
    (``presaved``), and that is what is noted, without the walk; an error to
    capture, or any save at all, takes nnsight's path.
    """
    Requests: Any = importlib.import_module(_RUNNER).Requests

    general = Requests.record
    if getattr(general, "streamscope_cheap", False):
        return

    def record(self: Any, mediator: Any) -> None:
        if _saves() or mediator.exception is not None:
            return general(self, mediator)
        mediator.nnsight_saved = set(mediator.presaved)

    setattr(record, "streamscope_cheap", True)  # marks the patch as applied (a function attribute)
    Requests.record = record


def running_token_span() -> Optional[tuple[int, int]]:
    """The running invoke's span of vLLM's flat token axis, ``(start, size)``, while nnsight's vLLM batcher
    serves it in a visit of a module; None outside one (or for an invoke with no rows of its own)."""
    mediator = running_mediator()
    if mediator is None:
        return None
    group, interleaver = mediator.batch_group, mediator.interleaver
    if group is None or interleaver is None or not interleaver.interleaving:
        return None
    return (group[0], group[1]) if type(interleaver.batcher) is _vllm_batcher() else None


@functools.cache
def _vllm_batcher() -> type:
    from nnsight.modeling.vllm.batching import VLLMBatcher  # imports vLLM: loaded by the engine that asks

    return VLLMBatcher


def wrap_replay(interleaver: Any, around: Callable[[Callable, str, Any], Any]) -> bool:
    """Run `around(original, location, tensors)` at every replayed tap of nnsight's tapped vLLM interleaver.

    nnsight calls the interleaver's ``replay(location, tensors)`` at each tap
    of a replayed CUDA graph (looked up at each replay, so wrapping it on the
    instance reaches graphs recorded before). Returns False, wrapping nothing,
    where the interleaver has no taps (an eager engine).
    """
    if not getattr(interleaver, "taps", None):
        return False
    original = interleaver.replay
    interleaver.replay = partial(around, original)
    return True


def take_request_error(output: Any) -> Optional[dict]:
    """The error record a vLLM request's output carries back from the worker (type, message, traceback), or None.

    It is taken off the output, so nnsight's collection does not raise it as
    a RuntimeError: streamscope raises it with its own type. A control-flow
    record (nnsight's own early stop) is left in place.
    """
    error = getattr(output, "nnsight_error", None)
    if not error or error.get("is_control_flow"):
        return None
    output.nnsight_error = None
    return error


def collect_requests(mediators: list, outputs: list) -> None:
    """nnsight's client-side collection of a vLLM trace's request outputs into its invokes' saved values."""
    _vllm_name("VLLMClient")._collect(mediators, outputs)


class EachPrompt(tuple):
    """Several prompts (each text, or token ids without padding) as one vLLM trace input: under
    `invoke_per_prompt_tracer`'s tracer the trace runs its body once per prompt, an invoke (a request) each."""


def invoke_per_prompt_tracer() -> type:
    """nnsight's vLLM tracer class, extended for a trace whose one input is an `EachPrompt`: its body runs once
    per prompt, each as an invoke of its own (one vLLM request), exactly as one ``with tracer.invoke(prompt):``
    block per prompt with the same body would run. Any other input is nnsight's. Pass it as ``tracer_cls=`` to
    ``VLLM.trace``.

    nnsight builds a trace given its input directly as one invoke (one ``Mediator`` over the body, with the
    input added to the trace's batcher); here there is one such ``Mediator`` per prompt instead, each with its
    own copy of the caller's locals, the trace's keywords (the sampling settings) going with every request.
    The class is this module's ``InvokePerPromptTracer``, built on first use (it imports vLLM): a body that
    names its tracer ships the tracer to the worker, and nnsight's pickler sends a class it cannot import by
    name as source, which it then writes over the class's own methods.
    """
    return _vllm_name("InvokePerPromptTracer")


def _build_invoke_per_prompt_tracer() -> type:
    base = importlib.import_module("nnsight.modeling.vllm.tracer").VLLMTracer

    class InvokePerPromptTracer(base):  # type: ignore[valid-type, misc]
        def prepare(self, code: Any) -> tuple:
            if len(self.args) != 1 or not isinstance(self.args[0], EachPrompt):
                return super().prepare(code)
            frame = self.info.frame
            interleaver = self.envoy.interleaver
            self.batcher = self.envoy._batcher_class(self.envoy, self.kwargs)
            for prompt in self.args[0]:
                mediator = Mediator(code, frame.f_globals, dict(frame.f_locals), node=self.node)
                mediator.batch_group = self.batcher.add(prompt, **self.kwargs)
                interleaver.mediators.append(mediator)
            args, kwargs = self.batcher.assemble(self.fn)
            return list(interleaver.mediators), args, kwargs

    InvokePerPromptTracer.__module__ = __name__
    InvokePerPromptTracer.__qualname__ = "InvokePerPromptTracer"
    return InvokePerPromptTracer


def set_client_worker(model_or_class: Any, worker_cls: str) -> None:
    """Make nnsight's vLLM client start engines with `worker_cls` (a dotted path vLLM imports in the worker).

    nnsight passes ``worker_cls=self._WORKER_CLS`` to ``vllm.LLM`` and forwards
    the caller's keywords too, so the attribute is the only place to say it.
    """
    if isinstance(model_or_class, type):
        setattr(model_or_class, "_WORKER_CLS", worker_cls)
    else:
        object.__setattr__(model_or_class, "_WORKER_CLS", worker_cls)


def start_own_engines(cls: Any, own: Callable[[Any], bool], start: Callable[..., Any]) -> None:
    """Make `cls` (a subclass of nnsight's VLLM) start its engine with ``start(repo_id, worker_cls=<its client
    worker>, **options)`` where ``own(model)`` holds, and with nnsight's own start (``VLLM._load_sync``) elsewhere.

    nnsight starts every untapped engine eagerly on its own runner; an engine that keeps vLLM's compile (graph ops)
    runs vLLM's own worker and runner, and needs neither nnsight's engine class nor its eager setting. Upstream: a
    documented way to start the engine nnsight wraps. Idempotent (the replacement is marked).
    """
    if getattr(cls.__dict__.get("_load_sync"), "_streamscope_own", False):
        return
    nnsight_start = cls._load_sync

    def _load_sync(self: Any, repo_id: str, **options: Any) -> Any:
        if not own(self):
            return nnsight_start(self, repo_id, **options)
        return start(repo_id, worker_cls=self._WORKER_CLS, **options)

    _load_sync._streamscope_own = True  # type: ignore[attr-defined]
    cls._load_sync = _load_sync


def build_meta_trees_within(cls: Any, within: Callable[[], Any]) -> None:
    """Make `cls` (a subclass of nnsight's VLLM) build its meta copy of the model (``VLLM._load_meta``) inside the
    context manager ``within()``. Upstream: a hook around the meta build. Idempotent (the replacement is marked)."""
    if getattr(cls.__dict__.get("_load_meta"), "_streamscope_within", False):
        return
    nnsight_build = cls._load_meta

    def _load_meta(self: Any, repo_id: str, **options: Any) -> Any:
        with within():
            return nnsight_build(self, repo_id, **options)

    _load_meta._streamscope_within = True  # type: ignore[attr-defined]
    cls._load_meta = _load_meta


# Where a trace crosses processes: the names streamscope's transport (`streamscope.vllm.trace_transport`)
# replaces, each by a wrapper it builds around nnsight's original.

def _replace_once(module_name: str, name: str, build: Callable[[Any], Any], mark: str) -> None:
    """Set `module_name`'s `name` to ``build(original)`` unless a replacement marked `mark` is there already."""
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    if getattr(original, mark, False):
        return
    replacement = build(original)
    setattr(replacement, mark, True)  # marks the patch as applied
    setattr(module, name, replacement)


def send_invokes_with(dumps: Callable[..., Any]) -> None:
    """Make nnsight's vLLM client pickle each invoke of a trace (``dumps(mediator)``, into its request's
    ``extra_args``) with ``dumps(mediator, *args, dumps=nnsight's)`` (idempotent)."""
    _replace_once(_CLIENT, "dumps", lambda original: partial(dumps, dumps=original), "streamscope_bundles")


def load_invokes_with(loads: Callable[..., Any]) -> None:
    """Make nnsight's vLLM worker of this process unpickle each request's invoke with
    ``loads(payload, *args, loads=nnsight's, **kwargs)`` (idempotent)."""
    _replace_once(_RUNNER, "loads", lambda original: partial(loads, loads=original), "streamscope_bundles")


def attach_invokes_with(client: type, attach: Callable[[Callable, Any, list], list]) -> None:
    """Make `client` (a subclass of nnsight's vLLM client) attach a trace's invokes to their requests with
    ``attach(nnsight's attach, model, params, **kwargs)`` (idempotent: a class that has its own is left).

    nnsight's ``VLLM._attach_mediators(params)`` pickles each invoke that has a prompt into its request's
    sampling parameters, in the order of `prompted_invokes`.
    """
    if "_attach_mediators" in client.__dict__:
        return
    original = _vllm_name("VLLMClient")._attach_mediators

    def attach_through(model: Any, params: list, **kwargs: Any) -> list:
        return attach(original, model, params, **kwargs)

    setattr(client, "_attach_mediators", attach_through)


def prompted_invokes(model: Any) -> list:
    """The invokes of `model`'s running trace that have a prompt (a request each), in the order nnsight attaches
    them to their requests."""
    return [mediator for mediator in model.interleaver.mediators if mediator.batch_group is not None]


def answer_collects_with(pack: Callable[..., Any]) -> None:
    """Make nnsight's vLLM worker of this process answer a collect (the saves of a trace's requests) with
    ``pack(collected, compact=nnsight's dumps_compact)`` instead of ``dumps_compact(collected)`` (idempotent)."""
    _replace_once(_RUNNER, "dumps_compact", lambda original: partial(pack, compact=original), "streamscope_handover")


def read_collects_with(build: Callable[[Any], Any]) -> None:
    """Make nnsight's vLLM engine read each rank's collect with ``build(pickle)``, an object that answers as the
    ``pickle`` module does, where its ``loads`` reads what `answer_collects_with`'s ``pack`` answers
    (``merge_collected`` calls ``pickle.loads``); idempotent."""
    _replace_once(_ENGINE, "pickle", build, "streamscope_handover")


_VLLM_NAMES = {
    "NNsightGPUWorker": ("nnsight.modeling.vllm.workers.GPUWorker", "NNsightGPUWorker"),
    "NNsightGPUModelRunner": ("nnsight.modeling.vllm.model_runners.GPUModelRunner", "NNsightGPUModelRunner"),
    "ParallelEnvoy": ("nnsight.modeling.vllm.envoys", "ParallelEnvoy"),
    "parallel_envoys": ("nnsight.modeling.vllm.envoys", "parallel_envoys"),
    "VLLMClient": ("nnsight.modeling.vllm.vllm", "VLLM"),
}
"""nnsight's vLLM internals, loaded on first use (they import vLLM):

* ``NNsightGPUWorker`` / ``NNsightGPUModelRunner``: the worker and runner that
  run a trace inside the engine; streamscope subclasses them (bulk RPCs, a CPU
  worker for hosts without a GPU).
* ``ParallelEnvoy`` / ``parallel_envoys()``: the envoys that gather tensor-parallel
  shards, which streamscope's ``envoys=`` map starts from.
* ``VLLMClient``: the class behind ``nnsight.modeling.vllm.VLLM``, reached at
  its defining module, where its ``_WORKER_CLS`` and ``_collect`` live.
* ``InvokePerPromptTracer``: streamscope's tracer over nnsight's vLLM tracer
  (`invoke_per_prompt_tracer`), built here so that it pickles by name.
"""


#: The names this module loads on first use (`_VLLM_NAMES`, and streamscope's tracer); the package's
#: ``__getattr__`` answers them too.
LAZY = frozenset({*_VLLM_NAMES, "InvokePerPromptTracer"})


def _vllm_name(name: str) -> Any:
    if name in globals():  # loaded (or built) before: the same object each time, so it pickles by name
        return globals()[name]
    if name == "InvokePerPromptTracer":  # streamscope's, built over nnsight's vLLM tracer on first use
        globals()[name] = _build_invoke_per_prompt_tracer()
        return globals()[name]
    target = _VLLM_NAMES.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __getattr__(name: str) -> Any:
    return _vllm_name(name)
