"""Check a checkpoint: every value streamscope serves, on each engine, against transformers' own forward.

    python -m streamscope check PATH --engines transformers,vllm

The reference is transformers' forward in float32 read with plain torch hooks
on the modules where each value is computed (below, per family, in the names of
the transformers implementation), not streamscope's code. Each served value's
worst relative error over the blocks (largest absolute difference over the
reference's largest magnitude) is held to a stated tolerance.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

#: Relative tolerances: float32 on CPU agrees to about 1e-6 on the same kernels; vLLM's kernels differ
#: in their order of operations (and Gemma 2's attention soft cap is compiled), hence more room.
TOLERANCES = {"transformers": 1e-5, "vllm": 1e-4}

_PRE = {"layer_input": ("", "in"), "attention_norm_output": ("input_layernorm", "out"),
        "attention_output": ("self_attn", "out"), "layer_mid": ("post_attention_layernorm", "in"),
        "mlp_norm_output": ("post_attention_layernorm", "out"), "mlp_input": ("mlp", "in"),
        "mlp_output": ("mlp", "out"), "layer_output": ("", "out")}
_LLAMA = {"layers": "model.layers", "token_embeddings": ("model.embed_tokens", "out"),
          "final_norm_output": ("model.norm", "out"), **_PRE}
_SANDWICH = {**_LLAMA, "attention_output": ("post_attention_layernorm", "out"),
             "layer_mid": ("pre_feedforward_layernorm", "in"), "mlp_norm_output": ("pre_feedforward_layernorm", "out"),
             "mlp_output": ("post_feedforward_layernorm", "out")}
_POST = {**_LLAMA, "attention_norm_output": None, "mlp_norm_output": None,
         "attention_output": ("post_attention_layernorm", "out"), "layer_mid": ("mlp", "in"),
         "mlp_output": ("post_feedforward_layernorm", "out")}
_GPT = {"layers": "transformer.h", "token_embeddings": ("transformer.wte", "out"),
        "final_norm_output": ("transformer.ln_f", "out"), **_PRE, "attention_norm_output": ("ln_1", "out"),
        "attention_output": ("attn", "out")}


def _times_residual(config: Any) -> float:
    return config.residual_multiplier


#: Where each value is computed: (module path relative to the block, "in"|"out"[, scale of the config]),
#: a tuple of alternatives where blocks differ, None where the block has no such value.
SITES: dict[str, dict[str, Any]] = {
    **{family: _LLAMA for family in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma", "phi3",
                                     "stablelm")},
    "gemma2": _SANDWICH, "gemma3_text": _SANDWICH, "olmo2": _POST, "exaone4": _POST,
    "granite": {**_LLAMA, "token_embeddings": ("model.layers.0", "in"),
                "attention_output": ("self_attn", "out", _times_residual),
                "mlp_output": ("mlp", "out", _times_residual)},
    "cohere": {**_LLAMA, "layer_mid": None, "mlp_norm_output": ("input_layernorm", "out")},
    "llama4_text": {**_LLAMA, "mlp_input": ("feed_forward", "in"), "mlp_output": ("feed_forward", "out")},
    "qwen3_next": {**_LLAMA, "attention_output": (("self_attn", "out"), ("linear_attn", "out"))},
    "gpt2": {**_GPT, "layer_mid": ("ln_2", "in"), "mlp_norm_output": ("ln_2", "out")},
    "gptj": {**_GPT, "layer_mid": None, "mlp_norm_output": ("ln_1", "out")},
    "gpt_neox": {"layers": "gpt_neox.layers", "token_embeddings": ("gpt_neox.embed_in", "out"),
                 "final_norm_output": ("gpt_neox.final_layer_norm", "out"), **_PRE,
                 "attention_output": ("attention", "out"), "layer_mid": None},
    "opt": {"layers": "model.decoder.layers", "token_embeddings": ("model.decoder.embed_tokens", "out"),
            "final_norm_output": ("model.decoder.final_layer_norm", "out"), **_PRE,
            "attention_norm_output": ("self_attn_layer_norm", "out"), "layer_mid": ("final_layer_norm", "in"),
            "mlp_norm_output": ("final_layer_norm", "out"), "mlp_input": ("fc1", "in"), "mlp_output": ("fc2", "out")},
    # by the norms a block has: parallel (ln_attn, ln_mlp; or input_layernorm alone) or sequential (Falcon-RW)
    "falcon": {**_GPT, "token_embeddings": ("transformer.word_embeddings", "out"),
               "attention_norm_output": (("ln_attn", "out"), ("input_layernorm", "out")),
               "attention_output": ("self_attention", "out"), "layer_mid": ("post_attention_layernorm", "in"),
               "mlp_norm_output": (("ln_mlp", "out"), ("post_attention_layernorm", "out"), ("input_layernorm", "out"))},
    "mamba": {"layers": "backbone.layers", "token_embeddings": ("backbone.embeddings", "out"),
              "final_norm_output": ("backbone.norm_f", "out"), **_PRE, "attention_norm_output": ("norm", "out"),
              "attention_output": ("mixer", "out"), "layer_mid": None, "mlp_norm_output": None, "mlp_input": None,
              "mlp_output": None},
}
#: OPT with ``do_layer_norm_before=False`` (OPT-350m): a norm after each residual add and none at the end; the
#: stream between the halves is the attention half's norm output.
_OPT_POST_LN = {**SITES["opt"], "final_norm_output": None, "attention_norm_output": None, "attention_output": None,
                "layer_mid": ("self_attn_layer_norm", "out"), "mlp_norm_output": None, "mlp_output": None}
BLOCK_VALUES = ("layer_input", "attention_norm_output", "attention_output", "layer_mid", "mlp_norm_output",
                "mlp_input", "mlp_output", "layer_output")


def _module(root: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    """The submodule at dotted `path` (the root for ""), or None where the model has none."""
    try:
        return root.get_submodule(path.strip("."))
    except AttributeError:
        return None


def _site(model: torch.nn.Module, sites: dict, name: str, prefix: str) -> Optional[tuple]:
    spec = sites.get(name)
    if spec is None:
        return None
    for path, where, *scale in (spec if isinstance(spec[0], tuple) else (spec,)):
        module = _module(model, (prefix + path).rstrip("."))
        if module is not None:
            return module, where, (scale[0](model.config) if scale else None)
    return None


@contextlib.contextmanager
def _hook(module: torch.nn.Module, where: str, store: Callable[[torch.Tensor], None]) -> Iterator[None]:
    if where == "in":
        handle = module.register_forward_pre_hook(
            lambda _, args, kwargs: store(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    else:
        handle = module.register_forward_hook(
            lambda _, args, output: store(output if isinstance(output, torch.Tensor) else output[0]))
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def reference_values(path: str, prompt: str) -> tuple[dict[str, torch.Tensor], str]:
    """transformers' float32 forward on `prompt`, read with torch hooks: ``{"layers.3.layer_mid": tensor, ...}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    family = model.config.model_type
    sites = SITES.get(family, _LLAMA)
    if family == "opt" and not model.config.do_layer_norm_before:
        sites = _OPT_POST_LN
    input_ids = AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt").input_ids
    found: dict[str, torch.Tensor] = {}

    def recorder(key: str, factor: Optional[float]) -> Callable[[torch.Tensor], None]:
        def store(tensor: torch.Tensor) -> None:
            tensor = tensor.detach().clone().reshape(*input_ids.shape, tensor.shape[-1])
            found.setdefault(key, tensor * factor if factor is not None else tensor)
        return store

    with contextlib.ExitStack() as stack:
        for name in ("token_embeddings", "final_norm_output"):
            located = _site(model, sites, name, "")
            if located is not None:
                stack.enter_context(_hook(located[0], located[1], recorder(name, located[2])))
        layers = _module(model, sites["layers"])
        for index in range(len(layers)):
            for name in BLOCK_VALUES:
                located = _site(model, sites, name, f"{sites['layers']}.{index}.")
                if located is not None:
                    stack.enter_context(_hook(located[0], located[1], recorder(f"layers.{index}.{name}", located[2])))
        found["logits"] = model(input_ids).logits
    return found, family


@dataclass
class Report:
    """Worst relative error per value and engine, and whether each is within its engine's tolerance."""

    path: str
    family: str
    engines: list[str]
    errors: dict[str, dict[str, float]] = field(default_factory=dict)  # value -> engine -> worst error
    missing: dict[str, dict[str, str]] = field(default_factory=dict)   # value -> engine -> why not checked

    @property
    def passed(self) -> bool:
        return all(error <= TOLERANCES[engine] for row in self.errors.values() for engine, error in row.items())

    def __str__(self) -> str:
        width = max(map(len, [*self.errors, *self.missing, "value"]))
        tolerances = ", ".join(f"{engine} {TOLERANCES[engine]:.0e}" for engine in self.engines)
        lines = [f"{self.path} ({self.family}): worst relative error over the blocks, against transformers' "
                 f"forward read with torch hooks (tolerance: {tolerances})",
                 f"  {'value':<{width}}  " + "  ".join(f"{engine:>16}" for engine in self.engines)]
        for name in [*self.errors, *(n for n in self.missing if n not in self.errors)]:
            cells = []
            for engine in self.engines:
                error = self.errors.get(name, {}).get(engine)
                if error is None:
                    cells.append(f"{'-':>16}")
                else:
                    verdict = "ok" if error <= TOLERANCES[engine] else "FAIL"
                    cells.append(f"{error:>11.1e} {verdict:>4}")
            lines.append(f"  {name:<{width}}  " + "  ".join(cells))
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def _short(key: str) -> str:
    name = key.split(".", 2)[-1] if key.startswith("layers.") else key
    return name.rsplit(".", 1)[-1] if name.endswith(("attention_output", "mlp_output")) else name


def check(path: str, engines: tuple[str, ...] = ("transformers", "vllm"),
          prompt: str = "The Eiffel Tower is in Paris, and the quick brown fox") -> Report:
    """Read every served value of `path` on each engine and compare it with the reference.

    Returns a `Report`; ``report.passed`` is False when any value on any engine exceeds its tolerance.
    """
    import streamscope

    reference, family = reference_values(path, prompt)
    report = Report(str(path), family, list(engines))
    for engine in engines:
        model = streamscope.load(path, engine=engine)
        try:
            cache = model.cache(prompt, progress=False)
        finally:
            if engine == "vllm":
                model.close()
        got = {**cache.stored, "logits": cache.logits}
        for key, value in got.items():
            short = _short(key)
            expected = reference.get(key if short == key.split(".", 2)[-1] else f"{key.split('.')[0]}."
                                     f"{key.split('.')[1]}.{short}") if key.startswith("layers.") else reference.get(key)
            if expected is None:
                report.missing.setdefault(short, {})[engine] = "no reference"
                continue
            value = value[0, : expected.shape[1]].float()
            error = ((value - expected[0].float()).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
            row = report.errors.setdefault(short, {})
            row[engine] = max(row.get(engine, 0.0), error)
    return report
