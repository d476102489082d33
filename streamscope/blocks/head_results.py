"""Each head's result: its contribution to the attention's output, after the output projection (TL's hook_result).

``head_results`` is ``[batch, seq, heads, hidden_size]``: what the output
projection reads, split per head, times that head's columns of the projection,
without the projection's bias (TransformerLens 4.3 keeps the bias out of
``attn.hook_result`` too), so the heads' sum plus the bias is the projection's
output. It is read where the output projection returns: its input (fetched
first, in the same run) gives the heads, and an edit adds the difference it
makes, summed over heads, to the projection's output, before any post-attention
norm or residual multiplier, so the stream sees exactly the edited results.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import nnsight_seam as seam
from ..engine import OUTPUT_PROJECTIONS, linear_weight
from ..values import INPUT, OUTPUT, Host, StreamValue, first_tensor, in_trace, require_tapped

#: The value's name on the attention.
HEAD_RESULTS = "head_results"
#: What a read of head_results keeps on the trace's mediator until its write-back: the projection's input.
STASH = "_streamscope_head_results_inputs"

#: Why the bulk path (harvest, generate's steers) refuses it; formatted with the value's name (``name``).
BULK_REFUSAL = ("{name} is not served on the bulk path (harvest, generate's steers): it is computed from the "
                "output projection's input and written into its output, and the bulk path's hooks see one point "
                "of a module's call. Read or edit it in a trace (`with model.trace(prompt): results = "
                "model.layers[i].{name}.save()`), or use model.cache(prompts).head_results(i).")

NO_PROJECTION = ("its attention has none of the output projections streamscope knows ({names}), so its heads' "
                 "results cannot be computed")


def output_projection_name(module: torch.nn.Module) -> Optional[str]:
    """The name of `module`'s output projection child (`streamscope.engine.OUTPUT_PROJECTIONS`), or None."""
    children = dict(module.named_children())
    return next((name for name in OUTPUT_PROJECTIONS if isinstance(children.get(name), torch.nn.Module)), None)


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

    def results(self, host: Host) -> torch.Tensor:
        """The heads' results of the input kept for this read, in the user's layout."""
        location = self.location(host)
        inputs = seam.mediator_at(location).__dict__.get(STASH, {}).get(location)
        if inputs is None:
            raise RuntimeError(f"{host.where()}.{self.name}: the output projection's input was not kept")
        projection = seam.module_of(self.located(host))
        width = inputs.shape[-1]
        heads = host.result_heads()  # type: ignore[attr-defined]
        with torch.inference_mode(False):
            weight = linear_weight(projection, width, in_trace=True).to(inputs.device)  # [hidden, heads * head_dim]
            per_head = inputs.detach().float().unflatten(-1, (heads, width // heads))
            if per_head.dim() == 3:  # vLLM's flat tokens: one sequence of them
                per_head = per_head.unsqueeze(0)
            columns = weight.unflatten(-1, (heads, width // heads))  # [hidden, heads, head_dim]
            return torch.einsum("bshd,mhd->bshm", per_head, columns).to(inputs.dtype)

    def _read(self, host: Host, raw: Any) -> torch.Tensor:
        return self.results(host)

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
