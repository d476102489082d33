"""Sparse autoencoders on the map: load them, harvest their features in the engine, steer and clamp by feature.

::

    sae = streamscope.sae.from_sae_lens("path/to/sae")      # cfg.json + sae_weights.safetensors, or an SAE object
    sae = streamscope.sae.from_dictionary_learning("path/to/ae")   # ae.pt + config.json
    sae.value, sae.layer            # the streamscope value it reads: blocks.5.hook_resid_post -> layer_output, 5
    features = model.harvest(prompts, sae=sae, positions="all", top_k=16)
    features["sae_values"][i], features["sae_indices"][i]    # [1, positions, 16] each (dense: "sae_features")
    model.generate(prompts, steer=[sae.steer(feature=123, scale=8.0)])      # add its decoder direction
    model.generate(prompts, steer=[sae.clamp(feature=123, value=10.0)])     # clamp it in the loop

An `SAE` is its weights and activation: ``encode(x) = act((x - b_dec) W_enc
+ b_enc)`` (``b_dec`` subtracted where the SAE says so), ``decode(f) = f
W_dec + b_dec``, with ``act`` ReLU, JumpReLU (zero below a per-feature
threshold) or top-k (the k largest pre-activations, ReLU'd). Clamping a
feature in the loop encodes the stream, sets the feature, decodes, and adds
back the SAE's error term ``x - decode(encode(x))``: the stream becomes
``x + (c - f_i(x)) W_dec[i]``, so an SAE in the loop that clamps nothing
leaves the run unchanged, bit for bit.

Harvests for SAE training: `write_sae_lens_cache` writes a harvest in the
layout SAELens's cached-activations training reads (a ``datasets`` folder
with one ``[context_size, d_in]`` row per context under the hook's name,
and ``token_ids``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from .bulk.operations import ClampFeature, check_clamp  # noqa: F401  (the sae_clamp operation, by its module)
from .bulk.spec import ROOT_VALUES, Steer, locate

ACTIVATIONS = ("relu", "jumprelu", "topk")
#: dictionary_learning's submodule names (``resid_post_layer_3``) -> streamscope's values.
DICTIONARY_LEARNING_SITES = {"resid_post": "layer_output", "resid_pre": "layer_input", "resid_mid": "layer_mid",
                             "mlp_out": "mlp_output", "attn_out": "attention_output", "embed": "token_embeddings"}


def value_of_hook(hook_name: str) -> tuple[str, Optional[int]]:
    """A TransformerLens hook name (``blocks.5.hook_resid_post``) as streamscope's (value, block)."""
    from .workflows.cache import TL_BLOCK, TL_ROOT

    if hook_name in TL_ROOT:
        return TL_ROOT[hook_name], None
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", hook_name)
    if match and match.group(2) in TL_BLOCK:
        value, layout = TL_BLOCK[match.group(2)]
        if layout is None and "." not in value:
            return value, int(match.group(1))
    streams = ", ".join(f"blocks.N.{name}" for name, (value, layout) in TL_BLOCK.items()
                        if layout is None and "." not in value)
    raise ValueError(f"an SAE on {hook_name!r} reads no value of the residual stream's width that streamscope "
                     f"serves: SAEs on the map read {streams}, {', '.join(TL_ROOT)}.")


@dataclass
class SAE:
    """A sparse autoencoder on one value of one block.

    Attributes:
        W_enc: ``[d_in, d_sae]``. b_enc: ``[d_sae]``.
        W_dec: ``[d_sae, d_in]`` (row i is feature i's direction). b_dec: ``[d_in]``.
        activation: ``"relu"``, ``"jumprelu"`` (with `threshold`) or ``"topk"`` (with `k`).
        value, layer: The streamscope value and block it reads.
        apply_b_dec_to_input: Whether ``b_dec`` is subtracted before encoding.
        source: Where it came from (a path, "sae_lens", ...) and its hook name, for messages.
    """

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    value: str
    layer: Optional[int]
    activation: str = "relu"
    threshold: Optional[torch.Tensor] = None
    k: Optional[int] = None
    apply_b_dec_to_input: bool = True
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"SAE activation {self.activation!r}: streamscope runs {', '.join(ACTIVATIONS)}.")
        d_in, d_sae = self.W_enc.shape
        shapes = {"b_enc": (self.b_enc, (d_sae,)), "W_dec": (self.W_dec, (d_sae, d_in)), "b_dec": (self.b_dec, (d_in,))}
        if self.activation == "jumprelu":
            if self.threshold is None:
                raise ValueError("a JumpReLU SAE needs its threshold [d_sae].")
            shapes["threshold"] = (self.threshold, (d_sae,))
        for name, (tensor, shape) in shapes.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"SAE {name} has shape {tuple(tensor.shape)}; with W_enc {tuple(self.W_enc.shape)} "
                                 f"it must be {shape}.")
        if self.activation == "topk" and not (isinstance(self.k, int) and 0 < self.k <= d_sae):
            raise ValueError(f"a top-k SAE needs k in 1..{d_sae}, not {self.k!r}.")
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise ValueError(f"SAE {name} holds NaN or inf: the weights are damaged; load them again.")

    def __repr__(self) -> str:
        where = self.value if self.layer is None else f"layers[{self.layer}].{self.value}"
        return f"SAE({self.activation}, {self.d_in} -> {self.d_sae} features, reads {where})"

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def to(self, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> "SAE":
        """A copy with its weights in `dtype` on `device`."""
        moved = {name: getattr(self, name).to(device=device, dtype=dtype)
                 for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
        threshold = None if self.threshold is None else self.threshold.to(device=device, dtype=dtype)
        return SAE(**moved, value=self.value, layer=self.layer, activation=self.activation, threshold=threshold,
                   k=self.k, apply_b_dec_to_input=self.apply_b_dec_to_input, source=dict(self.source))

    def placed(self, device: Any) -> "SAE":
        """This SAE where its weights are float32 on `device` already (no copy, no check), else such a copy."""
        weights = [self.W_enc, self.b_enc, self.W_dec, self.b_dec] + ([self.threshold] if self.threshold is not None
                                                                       else [])
        target = torch.device(device)
        if all(tensor.dtype == torch.float32 and _same_device(tensor.device, target) for tensor in weights):
            return self
        return self.to(torch.float32, device)

    def release(self, model: Any) -> None:
        """Let `model`'s engine drop its copy of this SAE now (a vLLM engine's workers keep a few between runs)."""
        release = getattr(model, "release_saes", None)
        if release is not None:
            release(self)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_sae]`` of activations ``[..., d_in]``, in the weights' dtype."""
        x = x.to(self.W_enc.dtype)
        pre = (x - self.b_dec if self.apply_b_dec_to_input else x) @ self.W_enc + self.b_enc
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "jumprelu":
            assert self.threshold is not None
            return torch.relu(pre) * (pre > self.threshold)
        assert self.k is not None
        top = pre.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``[..., d_in]`` of feature activations ``[..., d_sae]``."""
        return features.to(self.W_dec.dtype) @ self.W_dec + self.b_dec

    def check(self, model: Any) -> None:
        """Refuse `model` unless it serves the SAE's value at its block with the SAE's width, saying why."""
        if self.d_in != model.hidden_size:
            raise ValueError(f"{self!r} reads vectors {self.d_in} wide; this model's stream is {model.hidden_size}: "
                             f"the SAE was trained on another model ({self.source.get('model') or 'unknown'}). "
                             f"Load the model it was trained on.")
        if self.layer is not None and not 0 <= self.layer < model.num_layers:
            raise ValueError(f"{self!r} reads block {self.layer}; this model has {model.num_layers} blocks: "
                             f"the SAE was trained on another model.")
        locate(model, self.value, self.layer)  # Unavailable with the family's reason where it is not served

    def feature(self, index: int, model: Any = None) -> Any:
        """Feature `index`'s decoder direction as a `streamscope.directions.Direction` (at the SAE's site)."""
        from .directions import Direction, identity

        self._check_feature(index)
        made_on = identity(model) if model is not None else {"hidden_size": self.d_in}
        return Direction(self.W_dec[index].detach().float().clone(), self.value, self.layer, "sae_feature", made_on,
                         details={"feature": index, **{k: v for k, v in self.source.items() if isinstance(v, str)}})

    def steer(self, feature: int, scale: Optional[float] = None, **options: Any) -> Steer:
        """A steer that adds ``scale`` times feature `feature`'s decoder direction at the SAE's site."""
        self._check_feature(feature)
        return Steer(self.value, self.layer, self.W_dec[feature].detach().float().clone(), scale=scale, **options)

    def clamp(self, feature: int, value: float, **options: Any) -> Steer:
        """A steer that clamps feature `feature` to `value` in the loop, the SAE's error term added back.

        Each edited row ``x`` becomes ``decode(f') + (x - decode(f))`` with
        ``f = encode(x)`` and ``f'`` equal to ``f`` but for ``f'[feature] =
        value``: ``x + (value - f[feature]) W_dec[feature]``.
        """
        self._check_feature(feature)
        return Steer(self.value, self.layer, self.W_dec[feature].detach().float().clone(), mode="sae_clamp",
                     projection=value, sae=self, feature=feature, **options)

    def _check_feature(self, index: int) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.d_sae:
            raise IndexError(f"feature {index!r} is out of range: {self!r} has features 0-{self.d_sae - 1}.")


def _same_device(have: torch.device, want: torch.device) -> bool:
    if have.type != want.type:
        return False
    if have.type != "cuda":
        return True
    current = torch.cuda.current_device()  # "cuda" is the current device, "cuda:0" a numbered one
    return (current if have.index is None else have.index) == (current if want.index is None else want.index)


class FeatureReadout:
    """What a harvest with ``sae=`` stores per row: the SAE's features, dense or the top k (values, then indices).

    Runs where the hooks run (the engine's worker on vLLM), in float32, so
    only the features leave the engine.
    """

    def __init__(self, sae: SAE, top_k: Optional[int]) -> None:
        self.sae, self.top_k = sae, top_k
        self.prepared: Optional[SAE] = None

    def __getstate__(self) -> dict:
        return {"sae": self.sae, "top_k": self.top_k, "prepared": None}

    def holding(self, sae: Any) -> "FeatureReadout":
        """The same readout over `sae` (the worker's own copy, or the key that names it in a plan)."""
        return FeatureReadout(sae, self.top_k)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.prepared is None or self.prepared.W_enc.device != rows.device:
            self.prepared = self.sae.placed(rows.device)
        features = self.prepared.encode(rows.float())
        if self.top_k is None:
            return features
        top = features.topk(self.top_k, dim=-1)
        return torch.cat([top.values, top.indices.float()], dim=-1)


def route_harvest(model: Any, prompts: Any, values: Any, layers: Any, positions: Any, out: Any,
                  options: dict, dense: Any) -> Any:
    """A model's ``harvest``: with ``sae=`` (and ``top_k=``), the SAE's features at its own site; otherwise the
    engine's dense harvest `dense` of `values`."""
    if options.get("sae") is not None:
        if values is not None or layers is not None:
            raise TypeError("a harvest with sae= reads the SAE's own value and block: leave values and layers out.")
        return harvest_features(model, prompts, options.pop("sae"), positions, options.pop("top_k", None),
                                out=out, **options)
    options.pop("sae", None)
    if values is None:
        raise TypeError("harvest needs the values to read (or sae= for an SAE's features).")
    return dense(model, prompts, values, layers, positions, out, **options)


def harvest_features(model: Any, prompts: Sequence[Any], sae: SAE, positions: Any = "last",
                     top_k: Optional[int] = None, **options: Any) -> Any:
    """A harvest of `sae`'s features at its site: ``"sae_features"`` ``[1, positions, d_sae]`` per prompt, or
    with `top_k`, ``"sae_values"`` and ``"sae_indices"`` ``[1, positions, top_k]`` (largest first)."""
    from .bulk.results import Harvest

    if not isinstance(sae, SAE):
        raise TypeError(f"sae= takes a streamscope.sae.SAE (from_sae_lens, from_dictionary_learning), "
                        f"not a {type(sae).__name__}.")
    sae.check(model)
    if top_k is not None and not (isinstance(top_k, int) and 0 < top_k <= sae.d_sae):
        raise ValueError(f"top_k={top_k!r}: give an int in 1..{sae.d_sae}, or None for every feature.")
    if options.get("out") is not None:
        raise ValueError("a harvest with sae= returns the features in memory; write them yourself, or harvest the "
                         "dense value to disk (out=) without sae=.")
    options.pop("out", None)
    layers = None if sae.value in ROOT_VALUES else [sae.layer]
    harvest = model.harvest(prompts, sae.value, layers=layers, positions=positions,
                            readout=FeatureReadout(sae, top_k), **options)
    rows = harvest.values[sae.value]
    if top_k is None:
        values = {"sae_features": rows}
    else:
        values = {"sae_values": [row[..., :top_k] for row in rows],
                  "sae_indices": [row[..., top_k:].long() for row in rows]}
    return Harvest(values, harvest.layers, harvest.positions, harvest.prompts)


# ---------------------------------------------------------------- loading


def _site(value: Optional[str], layer: Optional[int], hook_name: Optional[str], what: str) -> tuple[str, Optional[int]]:
    if value is not None:
        return value, layer
    if hook_name is None:
        raise ValueError(f"{what} does not say which value it reads: pass value= and layer=.")
    return value_of_hook(hook_name)


def from_sae_lens(source: Any, value: Optional[str] = None, layer: Optional[int] = None) -> SAE:
    """An SAE from SAELens: an SAE object, or a folder it saved (``cfg.json`` and ``sae_weights.safetensors``).

    Its hook name (``blocks.5.hook_resid_post``) is mapped to streamscope's
    value and block unless `value` is given. Architectures: standard
    (ReLU), JumpReLU and top-k, without activation normalization.
    """
    if isinstance(source, (str, Path)):
        from safetensors.torch import load_file

        folder = Path(source)
        config = json.loads((folder / "cfg.json").read_text())
        weights = load_file(str(folder / "sae_weights.safetensors"))
        where = str(folder)
    else:
        config = source.cfg.to_dict()
        weights = {name: tensor.detach().cpu() for name, tensor in source.state_dict().items()}
        where = "sae_lens SAE object"
    metadata = config.get("metadata") or {}
    hook_name = metadata.get("hook_name") or config.get("hook_name")
    normalization = config.get("normalize_activations", "none")
    if normalization not in (None, "none"):
        raise ValueError(f"{where}: the SAE normalizes its input ({normalization!r}), which streamscope does not "
                         f"apply in the engine; fold the normalization into the weights, or train with "
                         f"normalize_activations='none'.")
    architecture = config.get("architecture", "standard")
    activation = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}.get(architecture)
    if activation is None:
        raise ValueError(f"{where}: SAELens architecture {architecture!r}: streamscope loads standard, jumprelu "
                         f"and topk SAEs.")
    if config.get("rescale_acts_by_decoder_norm"):
        raise ValueError(f"{where}: a top-k SAE that ranks features by decoder norm (rescale_acts_by_decoder_norm) "
                         f"is not one streamscope runs; fold the norms into W_enc and b_enc first.")
    site = _site(value, layer, hook_name, where)
    return SAE(weights["W_enc"].float(), weights["b_enc"].float(), weights["W_dec"].float(), weights["b_dec"].float(),
               site[0], site[1], activation,
               threshold=weights["threshold"].float() if "threshold" in weights else None,
               k=config.get("k"), apply_b_dec_to_input=bool(config.get("apply_b_dec_to_input", True)),
               source={"format": "sae_lens", "path": where, "hook_name": hook_name or "",
                       "model": metadata.get("model_name") or config.get("model_name") or ""})


def from_dictionary_learning(folder: Union[str, Path], value: Optional[str] = None,
                             layer: Optional[int] = None) -> SAE:
    """An SAE saved by dictionary_learning (``ae.pt``, and ``config.json`` naming its layer and submodule).

    Its AutoEncoder (ReLU) and AutoEncoderTopK: ``encode(x) = act(encoder(x -
    b))``, ``decode(f) = decoder(f) + b``.
    """
    folder = Path(folder)
    state = torch.load(folder / "ae.pt", map_location="cpu", weights_only=True)
    config_path = folder / "config.json"
    trainer = json.loads(config_path.read_text()).get("trainer", {}) if config_path.exists() else {}
    if value is None and trainer.get("submodule_name"):
        name = str(trainer["submodule_name"])
        match = re.fullmatch(r"(.+?)(?:_layer_(\d+))?", name)
        kind = match.group(1) if match else name
        if kind not in DICTIONARY_LEARNING_SITES:
            raise ValueError(f"{folder}: submodule {name!r} is no value streamscope serves at the stream's width; "
                             f"pass value= and layer=.")
        value = DICTIONARY_LEARNING_SITES[kind]
        if value not in ROOT_VALUES:
            layer = int(match.group(2)) if match and match.group(2) else trainer.get("layer")
    if value is None:
        raise ValueError(f"{folder}: no config.json naming the submodule: pass value= and layer=.")
    if "encoder.weight" not in state or "decoder.weight" not in state:
        raise ValueError(f"{folder}/ae.pt holds {sorted(state)}: streamscope reads dictionary_learning's AutoEncoder "
                         f"and AutoEncoderTopK (encoder.weight, decoder.weight).")
    bias = state.get("bias", state.get("b_dec"))
    if bias is None:
        raise ValueError(f"{folder}/ae.pt has no decoder bias (bias or b_dec).")
    k = state.get("k")
    return SAE(state["encoder.weight"].T.float().contiguous(), state["encoder.bias"].float(),
               state["decoder.weight"].T.float().contiguous(), bias.float(), value, layer,
               "topk" if k is not None else "relu", k=int(k) if k is not None else None, apply_b_dec_to_input=True,
               source={"format": "dictionary_learning", "path": str(folder), "model": str(trainer.get("lm_name", ""))})


# ---------------------------------------------------------------- SAELens's cached activations


def write_sae_lens_cache(harvest: Any, token_ids: Sequence[Sequence[int]], folder: Union[str, Path],
                         hook_name: str, context_size: int, value: Optional[str] = None) -> Path:
    """Write a harvest (``positions="all"``) as SAELens's cached activations: a ``datasets`` folder.

    Each prompt's positions are cut into contexts of `context_size` tokens
    (a shorter tail is dropped); each context is one row, its activations
    under `hook_name` (``[context_size, d_in]``, float32) and its
    ``token_ids``. Point SAELens's ``cached_activations_path`` (or its
    `ActivationsStore`) at the folder, with the same `hook_name` and
    `context_size`.
    """
    import datasets

    value = value or value_of_hook(hook_name)[0]
    layer = value_of_hook(hook_name)[1]
    tensors = harvest[value]
    if len(tensors) != len(token_ids):
        raise ValueError(f"{len(tensors)} harvested prompts and {len(token_ids)} token lists: give each prompt's ids.")
    rows: list[torch.Tensor] = []
    ids: list[list[int]] = []
    for index, (tensor, tokens) in enumerate(zip(tensors, token_ids)):
        stream = tensor if value in ROOT_VALUES else tensor[harvest.layers.index(layer)]
        if stream.shape[0] != len(tokens):
            raise ValueError(f"prompt {index} has {stream.shape[0]} harvested positions and {len(tokens)} tokens: "
                             f"harvest with positions='all'.")
        for start in range(0, len(tokens) - context_size + 1, context_size):
            rows.append(stream[start:start + context_size].float())
            ids.append([int(token) for token in tokens[start:start + context_size]])
    if not rows:
        raise ValueError(f"no prompt has {context_size} tokens: give longer prompts or a smaller context_size.")
    width = rows[0].shape[-1]
    features = datasets.Features({hook_name: datasets.Array2D(shape=(context_size, width), dtype="float32"),
                                  "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size)})
    dataset = datasets.Dataset.from_dict({hook_name: [row.numpy() for row in rows], "token_ids": ids},
                                         features=features)
    folder = Path(folder)
    dataset.save_to_disk(str(folder))
    return folder


def harvest_for_sae_lens(model: Any, prompts: Sequence[Any], folder: Union[str, Path], hook_name: str,
                         context_size: int, **options: Any) -> Path:
    """Harvest `prompts` at the value `hook_name` names and write SAELens's cached-activations folder."""
    from .bulk.spec import token_ids

    value, layer = value_of_hook(hook_name)
    ids = token_ids(model, prompts)
    harvest = model.harvest(ids, value, layers=None if layer is None else [layer], positions="all", **options)
    return write_sae_lens_cache(harvest, ids, folder, hook_name, context_size, value)


__all__ = ["SAE", "from_sae_lens", "from_dictionary_learning", "value_of_hook", "harvest_features",
           "write_sae_lens_cache", "harvest_for_sae_lens", "ClampFeature", "FeatureReadout"]
