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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from safetensors.torch import load_file, save_file

from .bulk.operations import ClampFeature, check_clamp  # noqa: F401  (the sae_clamp operation, by its module)
from .bulk.results import Harvest
from .bulk.sites import ROOT_VALUES, locate
from .bulk.spec import token_ids
from .bulk.steer import Steer
from .directions import Direction, identity
from .workflows.cache import TL_BLOCK, TL_ROOT
from .workflows.features import top_examples as examples_of

ACTIVATIONS = ("relu", "jumprelu", "topk")
#: dictionary_learning's submodule names (``resid_post_layer_3``) -> streamscope's values.
DICTIONARY_LEARNING_SITES = {"resid_post": "layer_output", "resid_pre": "layer_input", "resid_mid": "layer_mid",
                             "mlp_out": "mlp_output", "attn_out": "attention_output", "embed": "token_embeddings"}


def value_of_hook(hook_name: str) -> tuple[str, Optional[int]]:
    """A TransformerLens hook name (``blocks.5.hook_resid_post``) as streamscope's (value, block)."""
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
        log_sparsity: ``[d_sae]``, log10 of each feature's firing rate on the SAE's training data, where the
            folder has it (SAELens's ``sparsity.safetensors``); None otherwise. Not used to compute anything.
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
    log_sparsity: Optional[torch.Tensor] = None

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
        if self.log_sparsity is not None and tuple(self.log_sparsity.shape) != (d_sae,):
            raise ValueError(f"SAE log_sparsity has shape {tuple(self.log_sparsity.shape)}; it must be ({d_sae},).")
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
                   k=self.k, apply_b_dec_to_input=self.apply_b_dec_to_input, source=dict(self.source),
                   log_sparsity=self.log_sparsity)

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


#: SAELens before 6.0 named these config keys otherwise (its own `handle_pre_6_0_config` renames them alike).
_PRE_6_NAMES = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
                "hook_point_layer": "hook_layer", "activation_fn_str": "activation_fn"}
SAE_LENS_CONFIG, SAE_LENS_WEIGHTS, SAE_LENS_SPARSITY = "cfg.json", "sae_weights.safetensors", "sparsity.safetensors"


def sae_lens_folders(root: Union[str, Path]) -> dict[str, Path]:
    """The SAELens SAEs under `root` (a release downloaded whole, or a training run's checkpoints): ``{sae_id:
    folder}``, each folder holding ``cfg.json`` and ``sae_weights.safetensors``, its id the path below `root`."""
    root = Path(root)
    found = {}
    for config in sorted(root.rglob(SAE_LENS_CONFIG)):
        if (config.parent / SAE_LENS_WEIGHTS).exists():
            found[config.parent.relative_to(root).as_posix()] = config.parent
    return found


def _sae_lens_folder(root: Path, sae_id: Optional[str]) -> Path:
    folder = root / sae_id if sae_id is not None else root
    if (folder / SAE_LENS_CONFIG).exists():
        if not (folder / SAE_LENS_WEIGHTS).exists():
            raise FileNotFoundError(f"{folder} has {SAE_LENS_CONFIG} but no {SAE_LENS_WEIGHTS}: the download is "
                                    f"incomplete; fetch the SAE's folder again.")
        return folder
    inside = sae_lens_folders(root) if root.is_dir() else {}
    if inside:
        listed = ", ".join(repr(name) for name in list(inside)[:12]) + (", ..." if len(inside) > 12 else "")
        wrong = f"no SAE {sae_id!r} in it" if sae_id is not None else "no cfg.json of its own"
        raise FileNotFoundError(f"{root} holds {len(inside)} SAELens SAEs and {wrong}: pass sae_id= one of "
                                f"{listed} (streamscope.sae.sae_lens_folders lists them).")
    raise FileNotFoundError(f"{folder} holds no SAELens SAE ({SAE_LENS_CONFIG} and {SAE_LENS_WEIGHTS}): give the "
                            f"folder SAELens saved, or the folder a release was downloaded to with sae_id=.")


def _sae_lens_settings(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """SAELens's config (6.x, or the flat one of earlier versions) as what streamscope runs: the hook, the
    activation and its k, refusing what streamscope cannot run with the reason."""
    config = {_PRE_6_NAMES.get(key, key): item for key, item in raw.items()}
    metadata = config.get("metadata") or {}
    hook_name = metadata.get("hook_name") or config.get("hook_name")
    if metadata.get("hook_head_index", config.get("hook_head_index")) is not None:
        raise ValueError(f"{where}: the SAE reads one attention head ({hook_name}, head "
                         f"{metadata.get('hook_head_index', config.get('hook_head_index'))}); SAEs on the map read "
                         f"a value of the residual stream's width.")
    normalization = config.get("normalize_activations")
    if isinstance(normalization, bool):  # SAELens before 6.0 stored a flag
        normalization = "expected_average_only_in" if normalization else "none"
    if normalization not in (None, "none"):
        raise ValueError(f"{where}: the SAE normalizes its input ({normalization!r}), which streamscope does not "
                         f"apply in the engine; fold the normalization into the weights, or train with "
                         f"normalize_activations='none'.")
    architecture = config.get("architecture") or "standard"
    function = config.get("activation_fn")
    k = config.get("k")
    if function == "topk":  # before 6.0: a standard SAE whose activation is top-k, its k in the kwargs
        architecture, k = "topk", k or (config.get("activation_fn_kwargs") or {}).get("k")
    elif function not in (None, "relu") and architecture == "standard":
        raise ValueError(f"{where}: activation {function!r}: streamscope runs ReLU, JumpReLU and top-k SAEs.")
    activation = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}.get(architecture)
    if activation is None:
        raise ValueError(f"{where}: SAELens architecture {architecture!r}: streamscope loads standard, jumprelu "
                         f"and topk SAEs (and those saved as one of them, e.g. batchtopk as jumprelu).")
    model_name = metadata.get("model_name") or config.get("model_name") or ""
    return {"hook_name": hook_name, "activation": activation, "k": k, "model": model_name,
            "apply_b_dec_to_input": bool(config.get("apply_b_dec_to_input", True)),
            "rescale": bool(config.get("rescale_acts_by_decoder_norm"))}


def _sae_lens_weights(weights: dict[str, torch.Tensor], rescale: bool, where: str) -> dict[str, torch.Tensor]:
    """SAELens's tensors as the SAE's float32 weights (and threshold), with SAELens's own folds applied."""
    weights = {name: tensor.float() for name, tensor in weights.items()}
    if "log_threshold" in weights:  # a JumpReLU training checkpoint: SAELens loads exp(log_threshold)
        weights["threshold"] = torch.exp(weights.pop("log_threshold"))
    scaling = weights.pop("scaling_factor", None)
    if scaling is not None and not torch.equal(scaling, torch.ones_like(scaling)):
        raise ValueError(f"{where}: the SAE scales its features before decoding (scaling_factor), which SAELens 6 "
                         f"does not load either; fold it into W_dec's rows first.")
    missing = [name for name in ("W_enc", "b_enc", "W_dec", "b_dec") if name not in weights]
    if missing:
        raise ValueError(f"{where}: the weights lack {missing} (they hold {sorted(weights)}): not a standard, "
                         f"JumpReLU or top-k SAE.")
    if rescale:
        # A top-k SAE that ranks features scaled by decoder norm: scaling W_enc's columns and b_enc by the norms
        # and dividing W_dec's rows by them gives the same features and reconstruction (SAELens's fold_W_dec_norm).
        norms = weights["W_dec"].norm(dim=-1)
        weights["W_enc"], weights["b_enc"] = weights["W_enc"] * norms, weights["b_enc"] * norms
        weights["W_dec"] = weights["W_dec"] / norms[:, None]
    return weights


def from_sae_lens(source: Any, value: Optional[str] = None, layer: Optional[int] = None,
                  sae_id: Optional[str] = None) -> SAE:
    """An SAE from SAELens: an SAE object (a training SAE too), or a folder SAELens saved or a release was
    downloaded to.

    A folder holds ``cfg.json`` and ``sae_weights.safetensors`` (and
    ``sparsity.safetensors``, kept as `SAE.log_sparsity`), as SAELens's
    ``save_model``, ``save_inference_model`` and trainer checkpoints write
    them and as ``SAE.from_pretrained`` downloads a release's SAE; configs of
    SAELens 6 and of earlier versions are read. For a folder holding a whole
    release (one folder per SAE), `sae_id` names the SAE's folder below it
    (`sae_lens_folders` lists them). Its hook name (``blocks.5.hook_resid_post``)
    is mapped to streamscope's value and block unless `value` is given.
    Architectures: standard (ReLU), JumpReLU and top-k (a top-k SAE that ranks
    by decoder norm is loaded with the norms folded in, as SAELens's
    ``fold_W_dec_norm`` does: the same features and reconstruction), without
    activation normalization.
    """
    sparsity = None
    if isinstance(source, (str, Path)):
        folder = _sae_lens_folder(Path(source), sae_id)
        raw = json.loads((folder / SAE_LENS_CONFIG).read_text())
        tensors = load_file(str(folder / SAE_LENS_WEIGHTS))
        if (folder / SAE_LENS_SPARSITY).exists():
            sparsity = load_file(str(folder / SAE_LENS_SPARSITY)).get("sparsity")
        where = str(folder)
    else:
        if sae_id is not None:
            raise TypeError("sae_id= names an SAE's folder inside a release's folder; an SAE object needs none.")
        tensors = {name: tensor.detach().cpu().clone() for name, tensor in source.state_dict().items()}
        if hasattr(source.cfg, "get_inference_sae_cfg_dict"):  # a training SAE: as it would save for inference
            source.process_state_dict_for_saving_inference(tensors)
            raw = source.cfg.get_inference_sae_cfg_dict()
        else:
            raw = source.cfg.to_dict()
        where = "sae_lens SAE object"
    settings = _sae_lens_settings(raw, where)
    weights = _sae_lens_weights(tensors, settings["rescale"], where)
    site = _site(value, layer, settings["hook_name"], where)
    return SAE(weights["W_enc"], weights["b_enc"], weights["W_dec"], weights["b_dec"], site[0], site[1],
               settings["activation"], threshold=weights.get("threshold"), k=settings["k"],
               apply_b_dec_to_input=settings["apply_b_dec_to_input"],
               source={"format": "sae_lens", "path": where, "hook_name": settings["hook_name"] or "",
                       "model": settings["model"]},
               log_sparsity=None if sparsity is None else sparsity.float().reshape(-1))


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
    value, layer = value_of_hook(hook_name)
    ids = token_ids(model, prompts)
    harvest = model.harvest(ids, value, layers=None if layer is None else [layer], positions="all", **options)
    return write_sae_lens_cache(harvest, ids, folder, hook_name, context_size, value)



# ---------------------------------------------------------------- training with SAELens

#: ``architecture=`` of `train`: SAELens's training architectures that save as an SAE streamscope runs.
TRAINABLE = ("standard", "topk", "jumprelu", "batchtopk")


def train(model: Any, prompts: Sequence[Any], hook_name: str, out: Union[str, Path], d_sae: int, *,
          architecture: str = "standard", steps: Optional[int] = None, batch_size: int = 4096,
          context_size: Optional[int] = None, lr: float = 3e-4, device: Optional[str] = None, seed: int = 0,
          cache: Union[str, Path, None] = None, progress: bool = True, **sae_options: Any) -> SAE:
    """Train an SAE on `model`'s activations over `prompts` with SAELens's own trainer, save it in SAELens's
    format to `out`, and return it loaded (`from_sae_lens(out)`).

    The prompts are harvested at `hook_name` (``blocks.N.hook_resid_post``
    and the other stream hooks `value_of_hook` maps) on either engine and
    written as SAELens's cached activations (`harvest_for_sae_lens`), each
    prompt cut into contexts of `context_size` tokens (default: the shortest
    prompt's length; a tail shorter than a context is left out). SAELens's
    ``ActivationsStore`` reads them back and its ``SAETrainer`` trains a fresh
    SAE of SAELens's `architecture` (``"standard"``, ``"topk"``, ``"jumprelu"``,
    ``"batchtopk"``), ``d_in`` the model's width and `d_sae` features, for
    `steps` steps of `batch_size` tokens (default: one pass over the harvested
    tokens) at learning rate `lr` on `device` (default: CUDA where there is
    one). `sae_options` go to the architecture's SAELens training config
    (``l1_coefficient=`` for standard, ``k=`` for top-k, ``l0_coefficient=``
    for JumpReLU, ...). `out` receives what SAELens writes for a release:
    ``cfg.json`` (the hook and model named in its metadata),
    ``sae_weights.safetensors`` (``save_inference_model``) and
    ``sparsity.safetensors`` (each feature's log10 firing rate in training).
    The cached activations go to `cache` (kept) or a temporary folder
    (removed); `seed` seeds the SAE's initialization; `progress` shows the
    harvest's progress bar (SAELens's trainer shows its own). Needs the
    ``sae`` extra (``pip install "streamscope[sae]"``).
    """
    from sae_lens import SAETrainer
    from sae_lens.config import SAETrainerConfig
    from sae_lens.saes.sae import SAEMetadata, get_sae_training_class
    from sae_lens.training.activations_store import ActivationsStore

    if architecture not in TRAINABLE:
        raise ValueError(f"architecture={architecture!r}: train takes one of {', '.join(TRAINABLE)}.")
    value, layer = value_of_hook(hook_name)
    locate(model, value, layer)  # Unavailable with the family's reason, before anything runs
    ids = token_ids(model, prompts)
    context = context_size if context_size is not None else min(len(row) for row in ids)
    contexts = sum(len(row) // context for row in ids)
    if context < 1 or contexts == 0:
        raise ValueError(f"context_size={context}: no prompt has that many tokens; give longer prompts or a "
                         f"smaller context_size.")
    if contexts * context < batch_size:
        # SAELens reads whole batches of contexts from its cache: fewer than one batch fails inside it.
        raise ValueError(f"{contexts * context} training tokens ({contexts} contexts of {context}) is less than one "
                         f"batch of {batch_size}: give more prompts, or a smaller batch_size.")
    total = steps * batch_size if steps is not None else contexts * context
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    classes = get_sae_training_class(architecture)
    torch.manual_seed(seed)
    metadata = SAEMetadata(hook_name=hook_name, model_name=str(getattr(model.config, "_name_or_path", "") or ""),
                           context_size=context, prepend_bos=bool(getattr(model.tokenizer, "bos_token", None)))
    trained_sae = classes[0](classes[1](d_in=model.hidden_size, d_sae=d_sae, device=device, metadata=metadata,
                                        **sae_options))
    buffer = max(4, -(-2 * batch_size // context))  # SAELens mixes a buffer of this many contexts: two batches
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(cache) if cache is not None else Path(scratch) / "activations"
        harvest_for_sae_lens(model, ids, folder, hook_name, context, progress=progress)
        store = ActivationsStore(model=None, dataset=None, streaming=False, hook_name=hook_name, hook_head_index=None,
                                 context_size=context, d_in=model.hidden_size, n_batches_in_buffer=buffer,
                                 total_training_tokens=total, store_batch_size_prompts=max(1, -(-batch_size // context)),
                                 train_batch_size_tokens=batch_size, prepend_bos=False, normalize_activations="none",
                                 device=torch.device(device), dtype="float32", cached_activations_path=str(folder))
        trainer = SAETrainer(SAETrainerConfig(total_training_samples=total, train_batch_size_samples=batch_size,
                                              lr=lr, lr_end=lr, device=device), trained_sae, store)
        trained_sae = trainer.fit()
    out = Path(out)
    trained_sae.save_inference_model(out)
    save_file({"sparsity": trainer.log_feature_sparsity.detach().cpu().contiguous()}, str(out / SAE_LENS_SPARSITY))
    return from_sae_lens(out)



def top_examples(model: Any, prompts: Sequence[Any], sae: SAE, features: Union[int, Sequence[int], None] = None,
                 k: int = 10, **options: Any) -> Any:
    """Each feature's `k` top-activating tokens over `prompts`, with the tokens around each: a
    `streamscope.workflows.features.FeatureExamples` (``examples[f]``, ``.table()``, ``.rows``, ``.view(path)``).
    `streamscope.workflows.features.top_examples` says what each option does."""
    if not isinstance(sae, SAE):
        raise TypeError(f"top_examples takes a streamscope.sae.SAE, not a {type(sae).__name__}: load it with "
                        f"streamscope.sae.from_sae_lens (a SAELens SAE object or folder) or from_dictionary_learning.")
    return examples_of(model, prompts, sae, features, k, **options)


__all__ = ["SAE", "from_sae_lens", "from_dictionary_learning", "value_of_hook", "harvest_features",
           "write_sae_lens_cache", "harvest_for_sae_lens", "ClampFeature", "FeatureReadout", "sae_lens_folders", "train",
           "TRAINABLE", "top_examples"]
