"""OPT: Llama's pre-norm block with LayerNorms (``self_attn_layer_norm``, ``final_layer_norm``) and no MLP module.

The MLP half runs ``fc2(act(fc1(.)))`` on the stream flattened to
``[batch*seq, hidden]``: `fc2` is served as `mlp`, fc1's input is mlp_input,
and every value there is served as ``[batch, seq, hidden]``. With
``do_layer_norm_before=False`` (OPT-350m) a norm follows each residual add.
"""

from typing import Any, Optional

import torch

from ...blocks import Attention, Layer, Mlp
from ...errors import POST_LN, POST_NORM_ATTENTION, POST_NORM_MLP
from ...values import INPUT, OUTPUT, Residual, StreamValue

RENAME = {
    "model.decoder.layers": "layers", "model.decoder.embed_tokens": "embed_tokens",
    "model.decoder.final_layer_norm": "norm",
    "self_attn_layer_norm": "input_layernorm", "final_layer_norm": "post_attention_layernorm", "fc2": "mlp",
}

_SHAPE = "_streamscope_stream_shape"
_POST_LN_UNSERVED = {
    "attention_norm_output": POST_NORM_ATTENTION, "mlp_norm_output": POST_NORM_MLP,
    "self_attn.attention_output": POST_LN, "mlp.mlp_output": POST_LN,
}


def _record_shape(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    stream = args[0] if args else kwargs["hidden_states"]
    object.__setattr__(module, _SHAPE, tuple(stream.shape))


def _watch(module: torch.nn.Module) -> None:
    """Record the shape of the stream each call of the block `module` is made with."""
    if not hasattr(module, _SHAPE):
        object.__setattr__(module, _SHAPE, None)
        module.register_forward_pre_hook(_record_shape, with_kwargs=True)


class OPTLayer(Layer):
    """Serves the flattened MLP half as ``[batch, seq, hidden]``, in the shape the block was called with."""

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        _watch(module)

    def _update(self, module: torch.nn.Module) -> None:
        super()._update(module)
        _watch(module)

    @StreamValue("fc1", INPUT)
    def mlp_input(self) -> Residual:
        """What the MLP's first projection fc1 is called with, [batch, seq, hidden_size]."""

    def _post_ln(self) -> bool:
        return not getattr(self._module, "do_layer_norm_before", True)

    def reason(self, name: str) -> Optional[str]:
        if self._post_ln() and name in _POST_LN_UNSERVED:
            return _POST_LN_UNSERVED[name]
        return super().reason(name)

    def relocated(self) -> dict:
        # Post-LN: the stream between the sublayers is the attention half's norm output.
        return {"layer_mid": ("input_layernorm", OUTPUT)} if self._post_ln() else {}

    def to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        shape = getattr(self._module, _SHAPE, None)
        if tensor.dim() == 2 and shape is not None:
            return tensor.reshape(*shape[:-1], tensor.shape[-1])
        return tensor

    def to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        return value.reshape(live.shape)


class OPTMlp(Mlp):
    """fc2, the MLP's last projection, served in its block's layout."""

    def to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.block().to_user(tensor, name)

    def to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        return self.block().to_engine(value, live, name)


ENVOYS = {"layers.*": OPTLayer, "self_attn": Attention, "mlp": OPTMlp}
