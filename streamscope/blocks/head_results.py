"""Each head's result: its contribution to the attention's output, after the output projection (TL's hook_result).

``head_results`` is ``[batch, seq, heads, hidden_size]``: what the output
projection reads, split per head, times that head's columns of the projection,
without the projection's bias (TransformerLens 4.3 keeps the bias out of
``attn.hook_result`` too), so the heads' sum plus the bias is the projection's
output. It is read where the output projection returns: its input (fetched
first, in the same run) gives the heads, and an edit adds the difference it
makes, summed over heads, to the projection's output, before any post-attention
norm or residual multiplier, so the stream sees exactly the edited results.

Under tensor parallelism (vLLM) each rank's projection holds its own heads'
columns. In a trace nnsight hands every rank the projection's whole input
(every rank's heads, gathered) and its whole output (reduced, where the
projection leaves the reduction to its block, as Falcon's does, and split back
after), so the ranks' columns are joined in head order (`join_result_heads`)
and each rank computes the whole value and adds an edit's change to the whole
output, which nnsight shares out again.

The bulk path (`model.harvest`) reads it at the projection's input with a plain
hook (`bulk_site`, `read_rows`), where each rank holds its own heads: each rank
multiplies its heads by its columns, read once per run (`columns`), at the
harvested rows only, and the ranks' results are joined in head order.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import gradients
from .. import nnsight_seam as seam
from ..engine import OUTPUT_PROJECTIONS, linear_weight
from ..values import INPUT, OUTPUT, Host, StreamValue, first_tensor, in_trace, require_tapped

#: The value's name on the attention.
HEAD_RESULTS = "head_results"
#: What a read of head_results keeps on the trace's mediator until its write-back: the projection's input.
STASH = "_streamscope_head_results_inputs"
#: Why head results have no gradient: the model never forms them (formatted with the value's full name).
NO_GRADIENT = ("{name} is computed for the read from the output projection's input and weights: the model sums "
               "the heads in one matmul and never holds each head's result, so no gradient flows through it. "
               "Read .grad of head_outputs (each head's part of the projection's input) or attention_output.")

#: Why a bulk steer refuses it; formatted with the value's name (``name``).
STEER_REFUSAL = ("a steer of {name} is refused: a steer's vector is one hidden_size row, and {name} holds one such "
                 "row per head, computed from the output projection's input and written into its output. Edit one "
                 "head's result in a trace (`model.layers[i].{name}[:, :, head] += vector`), or steer "
                 "self_attn.attention_output with the vector (what that change adds to it). model.harvest reads "
                 "{name}.")

NO_PROJECTION = ("its attention has none of the output projections streamscope knows ({names}), so its heads' "
                 "results cannot be computed")


def output_projection_name(module: torch.nn.Module) -> Optional[str]:
    """The name of `module`'s output projection child (`streamscope.engine.OUTPUT_PROJECTIONS`), or None."""
    children = dict(module.named_children())
    return next((name for name in OUTPUT_PROJECTIONS if isinstance(children.get(name), torch.nn.Module)), None)


def input_width(projection: torch.nn.Module) -> int:
    """How wide `projection`'s input is in this process: a vLLM row-parallel linear's share
    (``input_size_per_partition``), a Linear's ``in_features``, GPT-2's Conv1D's ``nx``."""
    for name in ("input_size_per_partition", "in_features", "nx"):
        width = getattr(projection, name, None)
        if isinstance(width, int):
            return width
    raise ValueError(f"{type(projection).__name__}: no input width (input_size_per_partition, in_features, nx)")


def projection_reason(host: Any) -> Optional[str]:
    """Why `host` (an attention envoy) has no output projection to compute head results with, or None."""
    if output_projection_name(seam.module_of(host)) is None:
        return NO_PROJECTION.format(names=", ".join(OUTPUT_PROJECTIONS))
    return None


class HeadResults(StreamValue):
    """Each head's output times its slice of the output projection, no bias, ``[batch, seq, heads, hidden_size]``.

    The host says how many heads the projection's input holds (``result_heads``).
    """

    def __init__(self, *, description: Optional[str] = None) -> None:
        super().__init__(None, OUTPUT, shape="[batch, seq, heads, hidden_size]", description=description)

    def site(self, host: Host) -> tuple[Optional[str], str, Any]:
        return output_projection_name(seam.module_of(host)), OUTPUT, None

    def input_location(self, host: Host) -> str:
        projection = self.located(host)
        return require_tapped(host, self.name, seam.location(projection.path, INPUT))

    def __get__(self, host: Optional[Host], owner: Any = None) -> Any:
        if host is None:
            return self
        location = self.location(host)
        in_trace(f"{host.where()}.{self.name}", "read")
        if self.held(host) is None:  # a first read: the projection's input comes first in the run
            self.stash(host, location)
        return super().__get__(host, owner)

    def __set__(self, host: Host, value: Any) -> None:
        location = self.location(host)
        in_trace(f"{host.where()}.{self.name}", "written")
        if self.held(host) is None:
            self.stash(host, location)
        super().__set__(host, value)

    def stash(self, host: Host, location: str) -> None:
        """Wait for the projection's input and keep it on the mediator, for the read and its write-back."""
        raw = seam.read_at(self.input_location(host))
        mediator = seam.mediator_at(location)
        mediator.__dict__.setdefault(STASH, {})[location] = first_tensor(raw)

    def columns(self, host: Host) -> torch.Tensor:
        """This rank's heads' columns of the output projection, ``[hidden, heads here, head_dim]``, float32 on
        the CPU.

        Read through the projection's own kernel (`linear_weight`), past any hook on it; under tensor
        parallelism the projection holds this rank's heads' columns only.
        """
        projection = seam.module_of(self.located(host))
        heads = host.result_heads()  # type: ignore[attr-defined]
        width = input_width(projection)
        weight = linear_weight(projection, width, in_trace=True)  # [hidden, heads here * head_dim]
        return weight.unflatten(-1, (heads, width // heads))

    def results(self, host: Host) -> torch.Tensor:
        """The heads' results of the input kept for this read, in the user's layout (every rank's heads)."""
        location = self.location(host)
        inputs = seam.mediator_at(location).__dict__.get(STASH, {}).get(location)
        if inputs is None:
            raise RuntimeError(f"{host.where()}.{self.name}: the output projection's input was not kept")
        with torch.inference_mode(False):
            # Every rank's heads' columns: a trace sees the projection's whole input (nnsight gathers it).
            columns = host.join_result_heads(self.columns(host).to(inputs.device))  # type: ignore[attr-defined]
            per_head = inputs.detach().float().unflatten(-1, tuple(columns.shape[1:]))
            if per_head.dim() == 3:  # vLLM's flat tokens: one sequence of them
                per_head = per_head.unsqueeze(0)
            return torch.einsum("bshd,mhd->bshm", per_head, columns).to(inputs.dtype)

    # The bulk path: read at the projection's input, at the harvested rows only.

    def bulk_site(self, host: Host) -> tuple[Any, str, str]:
        """(envoy, where, location) where the bulk path reads the value: the output projection's input."""
        return self.located(host), INPUT, self.input_location(host)

    def read_rows(self, host: Host, raw: Any, rows: Any, columns: torch.Tensor) -> torch.Tensor:
        """``[rows, heads * hidden]``: the heads' results at `rows` of the flattened batch, each row's
        ``[heads, hidden]`` flattened as a harvest buffer holds it; `raw` is the projection's call input and
        `columns` this rank's `columns` on the input's device. Every rank of a tensor-parallel engine reads the
        same rows and joins its heads' results (`join_result_heads`)."""
        inputs = first_tensor(raw)
        flat = inputs.reshape(-1, inputs.shape[-1])[rows]
        with torch.inference_mode(False):
            local = torch.einsum("nhd,mhd->nhm", flat.float().unflatten(-1, tuple(columns.shape[1:])), columns)
            whole = host.join_result_heads(local)  # type: ignore[attr-defined]
        return whole.to(inputs.dtype).flatten(-2)

    def _read(self, host: Host, raw: Any) -> torch.Tensor:
        return self.results(host)

    def gradient(self, host: Host, raw: Any) -> gradients.Source:
        name = self.named(host)
        return gradients.NoGradient(name, NO_GRADIENT.format(name=name))

    def expected_shape(self, host: Host, raw: Any) -> tuple[int, ...]:
        return tuple(self.results(host).shape)

    def checked(self, host: Host, raw: Any, value: Any) -> torch.Tensor:
        self.validate(host, self.expected_shape(host, raw), value, None)
        return value

    def write(self, host: Host, raw: Any, value: torch.Tensor) -> None:
        """Add what the edit changes, summed over heads, to the projection's output, in place."""
        live = first_tensor(raw)
        with torch.inference_mode(False):
            change = (value.float() - self.results(host).float()).sum(-2)  # [batch, seq, hidden]
        with torch.no_grad():
            live.add_(change.to(live.dtype).reshape(live.shape))
