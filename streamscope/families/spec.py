"""What a family module states, as one typed value: `FamilySpec`, checked when a model loads (`spec_of`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Callable, Optional, Union

from ..values import INPUT, OUTPUT, Relocation

#: The root's values that are residual streams, [batch, seq, hidden_size], in the order the model computes them.
ROOT_STREAMS = ("token_embeddings", "final_norm_output")
#: The values of a model's root, in the order the model computes them.
ROOT_ORDER = (*ROOT_STREAMS, "logits", "prompt_logits")
#: The sizes every model states (a family's `FamilySpec.unserved` may say why it has none of one).
SIZE_NAMES = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")

#: The names streamscope gives a family's modules: what ``rename=`` maps to, and what ``envoys=`` paths are written in.
MODULE_NAMES = (
    "layers", "embed_tokens", "norm", "lm_head",  # on the root
    "self_attn", "linear_attn", "mlp", "shared_experts", "input_layernorm", "post_attention_layernorm",  # on a block
)

@dataclass(frozen=True)
class FamilySpec:
    """What a family states for one engine: its names for the engine's module tree, its envoys, and its exceptions.

    The engine-neutral part of each model type is stated once
    (`streamscope.families.neutral.NEUTRAL`); each engine's family module sets
    ``SPEC = derive(NEUTRAL[...], ...)`` with what is that engine's own.
    Checked when a model loads (`spec_of`): a wrong field is an error naming
    the family module and the field.
    """

    #: nnsight's ``rename=``: the family's module names (path suffixes, or module classes) to streamscope's
    #: (`MODULE_NAMES`): ``{"transformer.h": "layers", "attn": "self_attn"}``.
    rename: Mapping[Union[str, type], str]
    #: nnsight's ``envoys=``: paths in streamscope's names (``"layers.*"``, ``"self_attn"``) or module classes, to the
    #: envoy kinds that serve their values (`streamscope.blocks`, and each engine's own).
    envoys: Mapping[Union[str, type], type]
    #: Root values read elsewhere than their default: ``{"token_embeddings": ("layers.0", "input")}``.
    root_sites: Mapping[str, Relocation] = field(default_factory=dict)
    #: Root values and sizes the family cannot serve, with the reason (a state-space model's heads).
    unserved: Mapping[str, str] = field(default_factory=dict)
    #: Called with the model once its tree is built (the default family warns there what it could not map).
    check: Optional[Callable[[Any], None]] = None
    #: Engine settings the family needs unless the caller sets them (vLLM: engine arguments).
    engine_defaults: Mapping[str, Any] = field(default_factory=dict)
    #: Called with the checkpoint's config before the engine starts: why this engine cannot run it, naming what
    #: to do instead (None where it can). A load it refuses raises `UnsupportedCheckpoint` and starts nothing.
    cannot_run: Optional[Callable[[Any], Optional[str]]] = None
    #: Called with the checkpoint's config and the caller's settings before the engine starts: further engine
    #: settings this checkpoint needs (a kernel that serves its layout), over `engine_defaults`, under the caller's.
    checkpoint_defaults: Optional[Callable[[Any, Mapping[str, Any]], Mapping[str, Any]]] = None
    #: Whether the family adds learned position embeddings to the token embeddings before block 0 (GPT-2, OPT):
    #: then block 0's input is not the token embeddings alone (a cache's ``hook_pos_embed`` is their difference).
    learned_positions: bool = False
    #: What the family's head does to the unembedding's output, given the config and the logits
    #: ``[..., vocab_size]`` (a soft cap, a scale): the transformers head's last step, which a lens applied to a
    #: stream repeats (`streamscope.families.logits`). None where the logits are the unembedding's output as is.
    #: vLLM's engine applies its own (its logits processor's soft cap and scale), so its families state none.
    logit_scaling: Optional[Callable[[Any, Any], Any]] = None
    #: How the engine calls the family's blocks, where that engine needs telling (vLLM: a
    #: `streamscope.vllm.blocks.Layout`, fused halves where None): the engine composes it with the block kind of
    #: ``envoys`` at load, so the kinds stay engine-neutral. transformers' families state none.
    layout: Optional[Any] = None
    #: Why a head's output (`head_outputs`) times its slice of the output projection is not what the head adds to
    #: the stream (an output gate scales it between them), or None. TransformerLens's computed results
    #: (`cache.head_results`) are then refused with it, naming the value that is right (`self_attn.head_results`).
    gated_head_outputs: Optional[str] = None
    #: vLLM: the runs of a block's values with nothing computed between their module calls, each in call order
    #: (``"next.layer_input"``: the next block's), where they differ from the layout's (`Layout.stretches`): the
    #: graph ops run each run in one launch. ``()`` where none may be joined.
    stretches: Optional[tuple[tuple[str, ...], ...]] = None

    def problems(self) -> list[str]:
        """What is wrong with this spec, one line per field that is wrong; empty where nothing is."""

        found: list[str] = []
        for name, expected in (("rename", "a dict"), ("envoys", "a dict"), ("root_sites", "a dict"),
                               ("unserved", "a dict"), ("engine_defaults", "a dict")):
            if not isinstance(getattr(self, name), Mapping):
                found.append(f"{name} is a {type(getattr(self, name)).__name__}, not {expected}")
        if found:
            return found
        for key, value in self.rename.items():
            if not isinstance(key, (str, type)) or key == "":
                found.append(f"rename has the key {key!r}: a key is a module path (a string) or a module class")
            if value not in MODULE_NAMES:
                found.append(f"rename maps {_key(key)} to {value!r}, which is not one of streamscope's module "
                             f"names ({', '.join(MODULE_NAMES)})")
        for key, kind in self.envoys.items():
            if isinstance(key, str):
                unknown = _unknown_parts(key)
                if unknown:
                    found.append(f"envoys has the key {key!r}, whose {', '.join(map(repr, unknown))} is not one of "
                                 f"streamscope's module names ({', '.join(MODULE_NAMES)}; '*' for any, a number "
                                 f"for one block): write the path in streamscope's names, as rename gives them")
            elif not isinstance(key, type):
                found.append(f"envoys has the key {key!r}: a key is a path (a string) or a module class")
            if not isinstance(kind, type):
                found.append(f"envoys maps {_key(key)} to {kind!r}, not a class (an envoy kind)")
        for name, site in self.root_sites.items():
            if name not in ROOT_ORDER:
                found.append(f"root_sites has {name!r}, not a root value ({', '.join(ROOT_ORDER)})")
            if not _is_site(site):
                found.append(f"root_sites[{name!r}] is {site!r}: a site is (module path or None, 'input' | "
                             f"'output'), with an input's argument (index, name) as an optional third item")
            elif site[0] is not None and _unknown_parts(site[0]):
                found.append(f"root_sites[{name!r}] reads {site[0]!r}, whose "
                             f"{', '.join(map(repr, _unknown_parts(site[0])))} is not one of streamscope's "
                             f"module names ({', '.join(MODULE_NAMES)})")
        for name, reason in self.unserved.items():
            if name not in (*ROOT_ORDER, *SIZE_NAMES):
                found.append(f"unserved has {name!r}, neither a root value ({', '.join(ROOT_ORDER)}) nor a size "
                             f"({', '.join(SIZE_NAMES)})")
            if not isinstance(reason, str) or not reason:
                found.append(f"unserved[{name!r}] is {reason!r}: the reason is a sentence (a string)")
        if not isinstance(self.learned_positions, bool):
            found.append(f"learned_positions is {self.learned_positions!r}, not True or False")
        if self.logit_scaling is not None and not callable(self.logit_scaling):
            found.append(f"logit_scaling is {self.logit_scaling!r}, not a function of the config and the logits "
                         f"(or None)")
        if self.layout is not None and not callable(getattr(self.layout, "namespace", None)):
            found.append(f"layout is {self.layout!r}, not an engine's block layout (streamscope.vllm.blocks: Fused(), "
                         f"WholeStream(...), Backend()) or None")
        if self.stretches is not None and not (isinstance(self.stretches, tuple) and all(
                isinstance(run, tuple) and len(run) >= 2 and all(isinstance(name, str) for name in run)
                for run in self.stretches)):
            found.append(f"stretches is {self.stretches!r}, not a tuple of runs, each a tuple of two or more values "
                         f"in call order (or None: the layout's)")
        if self.check is not None and not callable(self.check):
            found.append(f"check is {self.check!r}, not a function of the model (or None)")
        if self.cannot_run is not None and not callable(self.cannot_run):
            found.append(f"cannot_run is {self.cannot_run!r}, not a function of the config (or None)")
        if self.checkpoint_defaults is not None and not callable(self.checkpoint_defaults):
            found.append(f"checkpoint_defaults is {self.checkpoint_defaults!r}, not a function of the config and the "
                         f"caller's settings (or None)")
        found += [f"engine_defaults has the key {key!r}, not a setting's name (a string)"
                  for key in self.engine_defaults if not isinstance(key, str)]
        return found


class FamilySpecError(ValueError):
    """A family module whose `SPEC` is missing or wrong: raised when a model of the family loads."""


def spec_of(family: ModuleType) -> FamilySpec:
    """The checked `SPEC` of the family module `family`; a `FamilySpecError` naming the module and each wrong field."""
    where = getattr(family, "__name__", repr(family))
    spec = getattr(family, "SPEC", None)
    if not isinstance(spec, FamilySpec):
        stated = "states no SPEC" if spec is None else f"states SPEC = {type(spec).__name__}"
        raise FamilySpecError(f"the family module {where} {stated}: a family module sets SPEC = "
                              f"streamscope.families.FamilySpec(rename=..., envoys=...).")
    problems = spec.problems()
    if problems:
        raise FamilySpecError(f"the family module {where} states a wrong SPEC: "
                              + "; ".join(f"SPEC.{problem}" for problem in problems) + ".")
    return spec


def derive(base: FamilySpec, *, rename: Optional[Mapping[Union[str, type], Optional[str]]] = None,
           envoys: Optional[Mapping[Union[str, type], Optional[type]]] = None, **fields: Any) -> FamilySpec:
    """`base` with what one engine (or a family shaped like `base`) adds: each entry of `rename` and `envoys`
    replaces `base`'s under its key, or is added after them; a key mapped to None is removed (vLLM aliases GPT-2's
    attention by class, where the path ``attn`` would also reach its kernel). The other `fields` replace `base`'s
    (``layout=``, ``cannot_run=``), as ``dataclasses.replace`` does."""
    changed: dict[str, Any] = dict(fields)
    for name, changes in (("rename", rename), ("envoys", envoys)):
        if changes:
            merged = {**getattr(base, name), **changes}
            changed[name] = {key: value for key, value in merged.items() if value is not None}
    return replace(base, **changed)


def _key(key: Any) -> str:
    return key.__name__ if isinstance(key, type) else repr(key)


def _unknown_parts(path: str) -> list[str]:
    """The parts of a dotted path that are neither streamscope's module names, ``*``, nor a block's number."""
    return [part for part in path.split(".") if part != "*" and not part.isdigit() and part not in MODULE_NAMES]


def _is_site(site: Any) -> bool:
    if not isinstance(site, tuple) or len(site) not in (2, 3):
        return False
    module, where, *argument = site
    if not (module is None or isinstance(module, str)) or where not in (INPUT, OUTPUT):
        return False
    return not argument or (isinstance(argument[0], tuple) and len(argument[0]) == 2
                            and isinstance(argument[0][0], int) and isinstance(argument[0][1], str))
