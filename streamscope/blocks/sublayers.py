"""The sublayers of a block: what each adds to the residual stream."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from .. import nnsight_seam as seam
from ..values import OUTPUT, StreamValue
from .envoy import StreamEnvoy
from .heads import INTERNALS


class Sublayer(StreamEnvoy):
    """A sublayer of a decoder block, under the name `ROLE` on its block."""

    #: The sublayer's name on its block: self_attn, linear_attn or mlp.
    ROLE: ClassVar[str] = ""

    def block(self) -> Optional[StreamEnvoy]:
        """The decoder block this sublayer belongs to (the nearest ancestor that is a block, `IS_BLOCK`)."""
        node = self.parent
        while node is not None and not getattr(type(node), "IS_BLOCK", False):
            node = node.parent
        return node

    def reason(self, name: str) -> Optional[str]:
        own = super().reason(name)
        if own is not None:
            return own
        block = self.block()
        return block.reason(f"{self.ROLE}.{name}") if block is not None else None

    def where(self) -> str:
        block = self.block()
        return f"{block.where()}.{self.ROLE}" if block is not None else self.path


class Mixer(Sublayer):
    """A sublayer that mixes positions: softmax attention (`Attention`) or a recurrent mixer (`LinearAttention`)."""

    #: The value that is what this sublayer adds to the residual stream.
    CONTRIBUTION: ClassVar[str] = "attention_output"

    @StreamValue(None, OUTPUT)
    def attention_output(self):
        """What the attention adds to the residual stream, [batch, seq, hidden_size].

        The attention's output projection on a pre-norm block; after the
        post-norm where the family has one (Gemma 2 and 3, Olmo2, Exaone4), and
        scaled where the family scales it (Granite). In-place edits and
        assignment reach the model.
        """


class Attention(Mixer):
    """The softmax attention of a block (`self_attn`): its output, and its queries, keys, values, scores,
    pattern and head outputs (`streamscope.blocks.heads`), which each engine reads where its model holds them:
    the engine composes its part with this kind at load (`kernel_reason`, `internals_to_user`,
    `internals_to_engine` and the values' descriptors are that part's)."""

    ROLE = "self_attn"
    ORDER = (*INTERNALS, Mixer.CONTRIBUTION)

    @classmethod
    def value_names(cls) -> list[str]:
        # The internals too, where no engine's part declares them yet (a support table's row for a missing module).
        names = dict.fromkeys([*INTERNALS, *super().value_names()])
        return sorted(names, key=lambda name: cls.ORDER.index(name) if name in cls.ORDER else len(cls.ORDER))

    def kernel_reason(self) -> Optional[str]:
        """Why the internals cannot be read here (the engine's part says), or None."""
        return "no engine reads this attention's internals: its kind was not composed with an engine's part"

    def internals_to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def internals_to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        return value

    def reason(self, name: str) -> Optional[str]:
        own = super().reason(name)
        if own is None and name in INTERNALS:
            return self.kernel_reason()
        return own

    def to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if name in INTERNALS:
            return self.internals_to_user(tensor, name)
        return super().to_user(tensor, name)

    def to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        if name in INTERNALS:
            return self.internals_to_engine(value, live, name)
        return super().to_engine(value, live, name)


class LinearAttention(Mixer):
    """A recurrent mixer in the attention's place (`linear_attn`): a gated delta net, a Mamba mixer."""

    ROLE = "linear_attn"


#: Why an Mlp serves no routing values: it has no router.
DENSE = "a dense MLP: no router"
#: Why a mixture of experts of a family streamscope maps no router for serves none.
UNMAPPED_ROUTER = "a mixture of experts whose router streamscope does not map for this family"
ROUTING = ("router_logits", "chosen_experts", "routing_weights")
#: Why a shared expert serves no routing values.
SHARED_ROUTING = "the shared expert: every token goes through it, no router chooses it"


class Mlp(Sublayer):
    """The feed-forward of a block (`mlp`): a dense MLP or a mixture of experts.

    Every Mlp has the routing values of a mixture of experts (a dense one says
    it has no router); a family whose router streamscope maps serves them
    through a subclass (`streamscope.transformers.moe`; on vLLM, `streamscope.vllm.moe`).
    """

    ROLE = "mlp"
    #: The value that is what this sublayer adds to the residual stream.
    CONTRIBUTION: ClassVar[str] = "mlp_output"
    ORDER = (*ROUTING, CONTRIBUTION)

    def is_moe(self) -> bool:
        """Whether this feed-forward is a mixture of experts (its module has `experts`)."""
        return isinstance(getattr(seam.module_of(self), "experts", None), torch.nn.Module)

    def reason(self, name: str) -> Optional[str]:
        own = super().reason(name)
        if own is None and name in ROUTING:
            return self.routing_reason(name)
        return own

    def routing_reason(self, name: str) -> Optional[str]:
        """Why routing value `name` is not served here, or None where a family's subclass serves it."""
        return UNMAPPED_ROUTER if self.is_moe() else DENSE

    # Declared here so the names exist on every Mlp; routing_reason answers before the location is used.
    router_logits = StreamValue("experts", OUTPUT, shape="[batch, seq, num_experts]", description=(
        "The router's logits for each token, before its top-k, [batch, seq, num_experts]."))
    chosen_experts = StreamValue("experts", OUTPUT, shape="[batch, seq, top_k]", description=(
        "The experts each token is sent to, as the model chose them, [batch, seq, top_k]."))
    routing_weights = StreamValue("experts", OUTPUT, shape="[batch, seq, top_k]", description=(
        "The weight of each chosen expert in the sum the mixture adds, [batch, seq, top_k]."))

    @StreamValue(None, OUTPUT)
    def mlp_output(self):
        """What the MLP adds to the residual stream, [batch, seq, hidden_size].

        The MLP's down projection on a pre-norm block (a mixture of experts:
        the routed experts' weighted sum plus any shared expert); after the
        post-norm where the family has one. In-place edits and assignment
        reach the model.
        """


class PostNormedAttention(Attention):
    """An attention whose output passes through the block's `post_attention_layernorm` before the add."""

    @StreamValue("..post_attention_layernorm", OUTPUT)
    def attention_output(self):
        """What the attention adds to the residual stream, after its post-norm, [batch, seq, hidden_size]."""


class PostNormedMlp(Mlp):
    """An MLP whose output passes through the block's `post_feedforward_layernorm` before the add."""

    @StreamValue("..post_feedforward_layernorm", OUTPUT)
    def mlp_output(self):
        """What the MLP adds to the residual stream, after its post-norm, [batch, seq, hidden_size]."""


class SharedExpert(Mlp):
    """The shared expert of a mixture of experts (`mlp.shared_experts`): a dense MLP every token goes through.

    Its mlp_output is the shared expert module's output, ``[batch, seq,
    hidden_size]``: on Llama 4 what the mixture adds besides the routed
    experts; on Qwen3-Next before its sigmoid gate (``shared_expert_gate``),
    so the mixture adds ``sigmoid(gate(x)) * mlp_output``. In-place edits and
    assignment reach the model. It has no router of its own.
    """

    ROLE = "mlp.shared_experts"

    @classmethod
    def value_names(cls) -> list[str]:
        return ["mlp_output"]

    def routing_reason(self, name: str) -> Optional[str]:
        return SHARED_ROUTING
