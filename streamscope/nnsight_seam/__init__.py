"""Everything streamscope takes from nnsight beyond its public API, in one package, checked against one version.

streamscope serves its values through nnsight's interleaving machinery at a
depth nnsight does not promise to keep: the ``Mediator`` that runs each
invoke's code of a trace (nnsight's word; vLLM's "workers" are its
processes), its pending write-back, the ``eproperty`` callbacks, the
source-instrumented forward, the vLLM workers. nnsight moves these between
releases, so every use of them lives here, written against one release
(`SUPPORTED`), which is checked when this package is imported, before any of
its modules imports an internal path.

The package adapts and does nothing more; each module adapts one part of
nnsight and its docstring lists what it patches, why, and the upstream API
that would replace the patch:

* `mediator`: a trace's invokes (the running ``Mediator``, its pending
  write-back, the eproperty callbacks, an invoke's rows of a batch) and the
  process-wide patches on the mediator, the interleaver and the batcher.
* `backward`: the ``.grad`` property served inside ``with loss.backward():``.
* `envoys`: an envoy's module and children, the module swap, the
  source-instrumented forward.
* `vllm_modeling`: nnsight's vLLM integration: its batcher, worker, runner
  and client, the tracer of an invoke per prompt, and the points where a
  trace's invokes leave the client and its saves come home (the transport
  itself is streamscope's: `streamscope.vllm.trace_transport`).

What counts as nnsight's public API (used directly by the rest of streamscope):
the names the top-level ``nnsight`` package exports in ``__all__``
(``nnsight.Envoy``, ``nnsight.TransformersModel``, ``nnsight.LanguageModel``,
``nnsight.NNsight``, ``nnsight.save``, ...) and ``nnsight.modeling.vllm.VLLM``
(the one name that package exports, and the vLLM entry nnsight documents),
together with what their documentation shows a user doing: ``model.trace``,
``model.generate``, an envoy's ``.path``, ``.output``, ``.input``, ``.source``,
the ``rename=`` and ``envoys=`` arguments. Everything reached by another
module path (``nnsight.intervention.*``, ``nnsight.tracing.*``,
``nnsight.modeling.vllm.<submodule>``) or by a private name is internal, and
only this package touches it. `tests/test_nnsight_seam.py` fails when another
module imports an internal path, or reaches a private name nnsight's classes
define (``envoy._module``: `module_of` here instead).

Two kinds of contact stay outside this package, each covered by the version
check all the same:

* the methods streamscope's engine model classes override on nnsight's
  (``_batch`` on transformers; ``_call``, ``_collect``, ``_resolve_taps`` on
  vLLM), each calling its parent's: nnsight calls them, and a subclass's
  override cannot live elsewhere (the seam test allows these, in those two
  modules only). Envoys and values override nnsight through this package
  (`RebindingEnvoy`, `LocatedProperty`).
* streamscope's own notes kept on a mediator (``streamscope_wanted``,
  ``streamscope_read``, ``streamscope_retired``, the vLLM attention history):
  attributes nnsight never reads, kept where each invoke's state lives.

Every name is importable from this package (``from streamscope import
nnsight_seam as seam``; ``seam.module_of``), as from the module that defines
it. The vLLM pieces (`NNsightGPUWorker`, `NNsightGPUModelRunner`,
`ParallelEnvoy`, `parallel_envoys`, `VLLMClient`, `InvokePerPromptTracer`)
import vLLM, so they load on first use (a module ``__getattr__``), not with
this package.
"""

from __future__ import annotations

from typing import Any, Optional

import nnsight

from ..releases import refuse_release

#: The nnsight release this package was written and tested against (no other release was available to
#: compare, so patch releases are not assumed to match: internals move even there).
SUPPORTED = "0.8.1"
#: Set to 1 to run on another nnsight release anyway, with a warning instead of the ImportError.
ALLOW_ENV = "STREAMSCOPE_ALLOW_NNSIGHT"


def check_version(installed: Optional[str] = None) -> None:
    """Raise ImportError unless nnsight `installed` (by default the one imported) is `SUPPORTED`.

    With ``STREAMSCOPE_ALLOW_NNSIGHT=1`` in the environment the mismatch is a
    RuntimeWarning instead, for whoever wants to try another release.
    """
    installed = nnsight.__version__ if installed is None else installed
    if installed == SUPPORTED:
        return
    message = (f"streamscope needs nnsight {SUPPORTED}, but nnsight {installed} is installed: streamscope "
               f"drives nnsight internals (its trace workers, write-backs and vLLM workers) that differ "
               f"between releases. Install the supported one: `pip install nnsight=={SUPPORTED}`")
    refuse_release(message, ALLOW_ENV)


check_version()

# The modules import nnsight's internal paths: only after the check, as on another release they may not exist.
from .backward import serve_gradients  # noqa: E402
from .envoys import (RebindingEnvoy, children, ensure_source, kernel_call_names, module_of,  # noqa: E402
                     runs_class_forward, uninstrumented, unwrapped_generate)
from .mediator import (LocatedProperty, Mediator, OutOfOrderError, PendingWriteBack,  # noqa: E402
                           WithBlockNotFoundError, around_mediator_run, around_visits, batch_whole, call_location,
                           codes_use_attributes, eproperty, filter_write_backs, held_view, interleaving,
                           invoke_rows, is_saved, location, mediator_at, pending_write_back, read_at, read_located,
                           redirect_write_back, rename_out_of_order, running_mediator, running_taps, set_callbacks,
                           skip_at, step_of, trace_mediators, with_invoke_rows)
from . import vllm_modeling as _vllm_modeling  # noqa: E402
from .vllm_modeling import (EachPrompt, build_meta_trees_within, collect_requests,  # noqa: E402
                            invoke_per_prompt_tracer, narrow_spans_directly, record_saves_cheaply, running_token_span,
                            set_client_worker, start_own_engines, take_request_error, wrap_replay)

__all__ = [
    "SUPPORTED", "ALLOW_ENV", "check_version",
    # mediator
    "eproperty", "LocatedProperty", "Mediator", "OutOfOrderError", "WithBlockNotFoundError", "set_callbacks",
    "read_located", "location", "call_location", "running_mediator", "running_taps", "mediator_at", "step_of",
    "read_at", "skip_at", "is_saved", "invoke_rows", "with_invoke_rows", "PendingWriteBack", "pending_write_back",
    "held_view", "redirect_write_back", "filter_write_backs", "rename_out_of_order", "around_mediator_run",
    "batch_whole", "codes_use_attributes", "trace_mediators", "around_visits", "interleaving",
    # backward
    "serve_gradients",
    # envoys
    "module_of", "children", "RebindingEnvoy", "kernel_call_names", "runs_class_forward", "ensure_source",
    "unwrapped_generate", "uninstrumented",
    # vllm_modeling
    "narrow_spans_directly", "record_saves_cheaply", "running_token_span", "wrap_replay",
    "take_request_error", "collect_requests", "EachPrompt", "invoke_per_prompt_tracer", "set_client_worker",
    "start_own_engines", "build_meta_trees_within",
    # Loaded on first use (vLLM is not imported with streamscope): `vllm_modeling`'s __getattr__.
    "NNsightGPUWorker", "NNsightGPUModelRunner", "ParallelEnvoy", "parallel_envoys", "VLLMClient",  # noqa: F822
    "InvokePerPromptTracer",  # noqa: F822
]


def __getattr__(name: str) -> Any:
    if name in _vllm_modeling.LAZY:
        value = getattr(_vllm_modeling, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
