"""The vLLM engine as the workflows see it: one request per prompt, the weights read in the worker by RPC."""

from __future__ import annotations

import pickle
from typing import Any, Optional, Sequence

import nnsight
import torch
from vllm import envs
from vllm.platforms import current_platform

from .. import nnsight_seam as seam
from .. import vllm_seam
from ..bulk.schema import ONE_FORWARD
from ..engine import Body, Engine, Prompt, join_shards
from .bulk import set_each, settable
from .logits import engine_logits


#: Why an invoke of a vLLM trace takes one prompt, and how to run several.
SEVERAL_PROMPTS = ("an invoke of a vLLM trace runs as one request of one prompt, unpadded, and this invoke's input "
                   "holds {count} prompts. Give the prompts to the trace itself, which runs its body once per "
                   "prompt (an invoke each, values [1, tokens, ...], a saved name coming back as a list, one "
                   "value per prompt):\n"
                   "    with model.trace(prompts, temperature=0.0, max_tokens=1): ...\n"
                   "or write one invoke per prompt:\n"
                   "    with model.trace(temperature=0.0, max_tokens=1) as tracer:\n"
                   "        with tracer.invoke(prompt_1): ...\n"
                   "        with tracer.invoke(prompt_2): ...\n"
                   "or use model.cache(prompts) for every prompt's values padded into one batch (on the left)")


class VllmEngine(Engine):
    """Runs each prompt as its own request (its values come back as ``[1, tokens, ...]``); reads weights in the worker."""

    name = "vllm"
    one_forward = ONE_FORWARD
    no_gradients = ("the vLLM engine runs its model under torch.inference_mode, keeping no autograd graph. Load "
                    "the checkpoint on transformers for gradients: `streamscope.load(path, engine=\"transformers\")`.")

    def precision(self) -> tuple[str, torch.dtype]:
        dtype = vllm_seam.engine_dtype(self.model.vllm_entrypoint)
        return ("cpu" if current_platform.is_cpu() else "cuda"), dtype

    def trace_input(self, prompts: Sequence[Prompt]) -> Any:
        # A request is one prompt's tokens, unpadded: several prompts in one request would be one flat sequence,
        # so several become an invoke each, every one running the trace's body (`StandardizedVLLM.trace`).
        return prompts[0] if len(prompts) == 1 else seam.EachPrompt(prompts)

    def run(self, prompts: Sequence[Prompt], body: Body, seq_axes: Sequence[tuple[int, ...]]) -> list[list[torch.Tensor]]:
        # A request holds its prompt's tokens only: nothing to cut, whatever the seq axes.
        model = self.model
        with model.trace(**ONE_FORWARD) as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    found = nnsight.save(list(body()))
        return _per_invoke(found, len(prompts))

    def run_each(self, prompt: str, bodies: Sequence[Body]) -> list[list[torch.Tensor]]:
        model = self.model
        with model.trace(**ONE_FORWARD) as tracer:
            for body in bodies:
                with tracer.invoke(prompt):
                    found = nnsight.save(list(body()))
        return _per_invoke(found, len(bodies))

    def set_each(self, prompt: str, edits: Sequence[tuple[str, int, int, torch.Tensor]]) -> list[torch.Tensor]:
        # Requests of one bulk run, each with its own `set` steer (`streamscope.vllm.bulk.set_each`): no trace.

        return set_each(self.model, prompt, edits)

    def settable(self, value: str, block: int) -> Optional[str]:
        return settable(self.model, value, block)

    def batch(self, asked: Optional[int], default: int, count: int) -> int:
        # The engine schedules a trace's requests into its steps itself (as many as its batch holds, the rest in
        # the next steps): by default a workflow submits all of them in one trace.
        return super().batch(asked, default, count) if asked is not None else max(count, 1)

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        # In the worker: the engine's own head, soft cap and scale (its logits processor's).
        return engine_logits(seam.module_of(self.model), normed)

    def norm_parameters(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        return _rpc(self.model, "streamscope_norm_parameters")

    def unembedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        # as plain ints: vLLM's broadcast to worker processes cannot pickle a tensor's storage
        return _rpc(self.model, "streamscope_unembedding_rows", [int(i) for i in ids.flatten()]).reshape(
            *ids.shape, -1)

    def head_parameters(self) -> tuple[Optional[torch.Tensor], float, Optional[float]]:
        return _rpc(self.model, "streamscope_head_parameters")

    def output_projections(self) -> list[torch.Tensor | str]:
        model = self.model
        return join_shards(_every_rank(model, "streamscope_output_projections", model.num_layers,
                                       model.num_heads * model.head_dim))

    def down_projections(self) -> list[torch.Tensor | str]:
        return join_shards(_every_rank(self.model, "streamscope_down_projections", self.model.num_layers))

    def close(self) -> None:
        self.model.close()


def _per_invoke(saved: Any, count: int) -> list:
    """What a trace of `count` invokes saved under one name, one entry per invoke.

    nnsight's vLLM client returns a name saved by several invokes as a list
    in submission order, and one saved by a single invoke as that value.
    """
    return [saved] if count == 1 else list(saved)


def _rpc(model: Any, method: str, *args: Any) -> Any:
    """The first worker's answer to its method `method` (`streamscope.vllm.bulk_worker.BulkRPC`).

    Under tensor parallelism every rank answers; an engine in another process
    sends its answer pickled.
    """
    return _every_rank(model, method, *args)[0]


def _every_rank(model: Any, method: str, *args: Any) -> list:
    """Every worker's answer to its method `method`, in rank order (vLLM's `collective_rpc` answers so)."""
    inline = not envs.VLLM_ENABLE_V1_MULTIPROCESSING
    answers = model.vllm_entrypoint.collective_rpc(method, args=(inline, model.config.model_type, *args))
    return [answer if inline else pickle.loads(answer) for answer in answers]
