"""The sublayers of a block: what each adds to the residual stream."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch

from .. import nnsight_seam as seam
from ..values import INPUT, OUTPUT, Host, StreamValue
from .envoy import StreamEnvoy
from .head_results import HEAD_RESULTS, HeadResults, projection_reason
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
    `internals_to_engine` and the values' descriptors are that part's); and each head's result after the output
    projection (`streamscope.blocks.head_results`), computed from the projection's input on either engine."""

    ROLE = "self_attn"
    ORDER = (*INTERNALS, HEAD_RESULTS, Mixer.CONTRIBUTION)

    head_results = HeadResults(description=(
        "Each head's contribution to the attention's output, [batch, seq, heads, hidden_size] (TransformerLens's "
        "attn.hook_result): what the output projection reads, per head, times that head's columns, no bias."))
    head_results.__doc__ = """Each head's result after the output projection, ``[batch, seq, heads, hidden_size]``.

    TransformerLens's ``attn.hook_result``: the output projection's input split
    per head times that head's columns of the projection, without its bias, so
    the heads' sum plus the bias is the projection's output (before any
    post-attention norm, and unscaled by Granite's residual multiplier). An
    in-place edit or an assignment adds what it changes, summed over heads, to
    the projection's output: the stream sees exactly the edited results.
    """

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
        if own is None and name == HEAD_RESULTS:
            return self.kernel_reason() or projection_reason(self) or self.head_results_reason()
        return own

    def head_results_reason(self) -> Optional[str]:
        """Why this engine cannot serve head_results here beyond a missing kernel or projection, or None."""
        return None

    def join_result_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """Every head's slice from this process's, along the heads axis (``[..., heads, last]``: results, or the
        output projection's columns): an engine that splits the heads over processes (vLLM's tensor
        parallelism) joins them in head order; one process holds them all."""
        return per_head

    def result_heads(self) -> int:
        """How many heads the output projection's input holds."""
        module = seam.module_of(self)
        config = getattr(module, "config", None)
        heads = getattr(config, "num_attention_heads", None) if config is not None else None
        for name in ("num_heads", "num_attention_heads", "n_head"):
            if heads is None:
                heads = getattr(module, name, None)
        if heads is None:
            raise ValueError(f"{self.where()}: no head count on {type(module).__name__}")
        return int(heads)

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


#: A dense MLP's neurons: before its nonlinearity, and after it (the input of its down projection).
NEURONS = ("neurons_pre", "neurons")
#: The module whose input is a dense MLP's neurons (its down projection), by the names the families give it.
DOWN_PROJECTIONS = ("down_proj", "c_proj", "fc_out", "dense_4h_to_h")
#: The module whose output is the nonlinearity's input: a gated MLP's gate, or its gate and up projection fused
#: into one (`FUSED_GATE_UP`, the gate first); a plain MLP's up projection.
PRE_ACTIVATIONS = ("gate_proj", "gate_up_proj", "c_fc", "fc_in", "dense_h_to_4h")
FUSED_GATE_UP = "gate_up_proj"
#: A block whose MLP is its own two linears, the second served as `mlp` (OPT): the first's name on the block.
BLOCK_UP_PROJECTION = "fc1"
#: Why a mixture of experts serves no neurons.
MOE_NEURONS = ("a mixture of experts: each expert has neurons of its own and a token goes through its chosen "
               "experts only, so there is no one hidden activation of the block; read mlp_output, or the shared "
               "expert's mlp_output where the family has one")
#: Why an MLP with no down projection streamscope knows serves no neurons.
UNKNOWN_NEURONS = (f"no down projection streamscope knows on this MLP (it looks for "
                   f"{', '.join(DOWN_PROJECTIONS)} and {', '.join(PRE_ACTIVATIONS)})")


class NeuronValue(StreamValue):
    """A dense MLP's hidden activation, at the module the MLP names it (`Mlp.neuron_sites`).

    A linear that leaves its bias for the caller to add (vLLM's, built with
    ``skip_bias_add``: Falcon's up projection) returns ``(output, bias)``: the
    value is served with the bias added, as the nonlinearity receives it, and
    an edit goes back less the bias.
    """

    def site(self, host: Host) -> tuple:
        module, where = host.neuron_sites()[self.name]  # type: ignore[attr-defined]
        return module, where, None

    @staticmethod
    def skipped_bias(raw: Any) -> Optional[torch.Tensor]:
        """The bias a linear's output ``(output, bias)`` leaves for its caller to add, or None."""
        if isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[1], torch.Tensor):
            return raw[1]
        return None

    def _read(self, host: Host, raw: Any) -> torch.Tensor:
        value = super()._read(host, raw)
        bias = self.skipped_bias(raw)
        if bias is None:
            return value
        with torch.inference_mode(False):
            return value + bias.to(value.dtype)

    def write(self, host: Host, raw: Any, value: torch.Tensor) -> None:
        bias = self.skipped_bias(raw)
        super().write(host, raw, value if bias is None else value - bias.to(value.dtype))


class Mlp(Sublayer):
    """The feed-forward of a block (`mlp`): a dense MLP or a mixture of experts.

    Every Mlp has the routing values of a mixture of experts (a dense one says
    it has no router); a family whose router streamscope maps serves them
    through a subclass (`streamscope.transformers.moe`; on vLLM, `streamscope.vllm.moe`).
    A dense MLP serves its neurons (`neurons`, `neurons_pre`), found at its
    down projection and at its gate or up projection under the names the
    families give them (`DOWN_PROJECTIONS`, `PRE_ACTIVATIONS`); a mixture of
    experts says why it has none.
    """

    ROLE = "mlp"
    #: The value that is what this sublayer adds to the residual stream.
    CONTRIBUTION: ClassVar[str] = "mlp_output"
    ORDER = (*ROUTING, *NEURONS, CONTRIBUTION)

    def is_moe(self) -> bool:
        """Whether this feed-forward is a mixture of experts (its module has `experts`)."""
        return isinstance(getattr(seam.module_of(self), "experts", None), torch.nn.Module)

    def reason(self, name: str) -> Optional[str]:
        own = super().reason(name)
        if own is None and name in ROUTING:
            return self.routing_reason(name)
        if own is None and name in NEURONS:
            return self.neurons_reason()
        return own

    def neurons_reason(self) -> Optional[str]:
        """Why the neurons are not served here, or None where they are."""
        if self.is_moe():
            return MOE_NEURONS
        return UNKNOWN_NEURONS if self.neuron_sites() is None else None

    def neuron_sites(self) -> Optional[dict[str, tuple[Optional[str], str]]]:
        """Where the neurons sit, ``{name: (module, where)}`` from this envoy; None where no module says.

        A module of the MLP's own named in `DOWN_PROJECTIONS` (its input is
        `neurons`) and one in `PRE_ACTIVATIONS` (its output, or the gate half
        of a fused gate and up projection, is `neurons_pre`); or, where the
        envoy is a block's second linear itself (OPT's fc2), its own input
        and the block's `BLOCK_UP_PROJECTION`'s output.
        """
        cached = self.__dict__.get("_streamscope_neurons", False)
        if cached is not False:
            return cached
        module = seam.module_of(self)
        children = dict(module.named_children())
        down = next((name for name in DOWN_PROJECTIONS if name in children), None)
        up = next((name for name in PRE_ACTIVATIONS if name in children), None)
        block = self.block()
        sites: Optional[dict[str, tuple[Optional[str], str]]] = None
        if down is not None and up is not None:
            sites = {"neurons": (down, INPUT), "neurons_pre": (up, OUTPUT)}
        elif not children and block is not None and BLOCK_UP_PROJECTION in block.__dict__:
            sites = {"neurons": (None, INPUT), "neurons_pre": (f"..{BLOCK_UP_PROJECTION}", OUTPUT)}
        self.__dict__["_streamscope_neurons"] = sites
        return sites

    def gate_shards(self) -> int:
        """How many shards the fused gate and up projection's output comes in, each ``[gate | up]``: one, or
        the tensor-parallel ranks' (vLLM's merged column-parallel linear, gathered in rank order); 0 where the
        gate is a module of its own."""
        sites = self.neuron_sites()
        if sites is None or not sites["neurons_pre"][0] == FUSED_GATE_UP:
            return 0
        return int(getattr(seam.module_of(self.__dict__[FUSED_GATE_UP]), "tp_size", 1))

    def to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        tensor = super().to_user(tensor, name)
        shards = self.gate_shards() if name == "neurons_pre" else 0
        if shards:
            return _gate_half(tensor, shards).flatten(-2)
        return tensor

    def to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        shards = self.gate_shards() if name == "neurons_pre" else 0
        if not shards:
            return super().to_engine(value, live, name)
        whole = live.clone()
        gate = _gate_half(whole, shards)
        gate.copy_(value.reshape(gate.shape))
        return whole

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

    neurons_pre = NeuronValue(None, OUTPUT, shape="[batch, seq, intermediate_size]", description=(
        "The MLP's neurons before its nonlinearity, [batch, seq, intermediate_size] (TransformerLens's "
        "mlp.hook_pre): a gated MLP's gate projection, a plain MLP's up projection."))
    neurons_pre.__doc__ = """The input of the MLP's nonlinearity, ``[batch, seq, intermediate_size]``.

    TransformerLens's ``mlp.hook_pre``: on a gated MLP (``act(gate(x)) *
    up(x)``) the gate projection's output, on a plain one (``act(up(x))``)
    the up projection's, with its bias. An in-place edit or an assignment
    changes what the nonlinearity receives (the gate half only, where the
    family fuses the gate and up projections into one).
    """
    neurons = NeuronValue(None, INPUT, shape="[batch, seq, intermediate_size]", description=(
        "The MLP's neurons after its nonlinearity, [batch, seq, intermediate_size] (TransformerLens's "
        "mlp.hook_post): the input of its down projection."))
    neurons.__doc__ = """The MLP's hidden activation after the nonlinearity, ``[batch, seq, intermediate_size]``.

    TransformerLens's ``mlp.hook_post``: ``act(gate(x)) * up(x)`` on a gated
    MLP, ``act(up(x))`` on a plain one; the input of the down projection, so
    ``mlp_output`` is ``neurons @ W_out + b_out`` on a pre-norm block. An
    in-place edit or an assignment changes what the down projection receives.
    """

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


def _gate_half(tensor: torch.Tensor, shards: int) -> torch.Tensor:
    """The gate half of a fused gate and up projection's output, ``[..., shards, width]``, as a view: each of
    `shards` pieces of the last dimension is ``[gate | up]``."""
    return tensor.unflatten(-1, (shards, 2, tensor.shape[-1] // (2 * shards)))[..., 0, :]
