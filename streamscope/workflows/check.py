"""Check a checkpoint: every value streamscope serves, on each engine, against transformers' own forward.

    python -m streamscope check PATH --engines transformers,vllm

The reference is transformers' forward in float32 read with plain torch hooks
on the modules where each value is computed (`streamscope.testing.oracle`, per
family, in the names of the transformers implementation; the test suite's
oracle reads the same map), not streamscope's code. A family the map does not
know is refused with the reason (`UnknownFamily`), not checked against another's. Each served value's
worst relative error over the blocks (largest absolute difference over the
reference's largest magnitude) is held to a stated tolerance.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from ..blocks import SHORT_CONTRIBUTIONS
from ..testing import oracle

#: Relative tolerances: float32 on CPU agrees to about 1e-6 on the same kernels; vLLM's kernels differ
#: in their order of operations, hence more room.
TOLERANCES = {"transformers": 1e-5, "vllm": 1e-4}

#: Every block value the reference places, in the order a block computes them.
BLOCK_VALUES = oracle.BLOCK_VALUES


def _site(model: torch.nn.Module, family: str, name: str, block: Optional[int]) -> Optional[tuple]:
    return oracle.site(model, family, name, block) if name in oracle.sites(model, family) else None


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


def _as_loaded(path: str) -> dict:
    """The settings streamscope's transformers engine loads `path` with beyond transformers' defaults, so the
    reference is the model both engines run (Gemma 2: the eager kernel, which applies its attention soft cap)."""
    from transformers import AutoConfig

    from ..families.spec import spec_of
    from ..transformers import families

    config = AutoConfig.from_pretrained(path)
    spec = spec_of(families.family_for(config.model_type))
    return dict(spec.checkpoint_defaults(config, {})) if spec.checkpoint_defaults is not None else {}


@torch.no_grad()
def reference_values(path: str, prompt: str) -> tuple[dict[str, torch.Tensor], str]:
    """transformers' float32 forward on `prompt`, read with torch hooks: ``{"layers.3.layer_mid": tensor, ...}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **_as_loaded(path)).eval()
    family = model.config.model_type
    sites = oracle.sites(model, family)  # UnknownFamily where the map has none
    input_ids = AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt").input_ids
    found: dict[str, torch.Tensor] = {}

    def recorder(key: str, factor: Optional[float]) -> Callable[[torch.Tensor], None]:
        def store(tensor: torch.Tensor) -> None:
            tensor = tensor.detach().clone().reshape(*input_ids.shape, tensor.shape[-1])
            found.setdefault(key, tensor * factor if factor is not None else tensor)
        return store

    with contextlib.ExitStack() as stack:
        for name in ("token_embeddings", "final_norm_output"):
            located = _site(model, family, name, None)
            if located is not None:
                stack.enter_context(_hook(located[0], located[1], recorder(name, located[2])))
        layers = oracle.module_at(model, sites["layers"])
        for index in range(len(layers)):
            for name in BLOCK_VALUES:
                located = _site(model, family, name, index)
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
    refused: dict[str, str] = field(default_factory=dict)  # engine -> why it cannot run the checkpoint

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
        lines += [f"  {engine} cannot run this checkpoint, so nothing of it is checked: {reason}"
                  for engine, reason in self.refused.items()]
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def _short(key: str) -> str:
    name = key.split(".", 2)[-1] if key.startswith("layers.") else key
    return name.rsplit(".", 1)[-1] if name.endswith((*SHORT_CONTRIBUTIONS, *oracle.NEURONS)) else name


def check(path: str, engines: tuple[str, ...] = ("transformers", "vllm"),
          prompt: str = "The Eiffel Tower is in Paris, and the quick brown fox") -> Report:
    """Read every served value of `path` on each engine and compare it with the reference.

    Returns a `Report`; ``report.passed`` is False when any value on any engine exceeds its tolerance. An
    engine that refuses the checkpoint (`UnsupportedCheckpoint`) is reported with its reason, and the others
    are checked.
    """
    import streamscope
    from ..errors import UnsupportedCheckpoint

    reference, family = reference_values(path, prompt)
    report = Report(str(path), family, list(engines))
    for engine in engines:
        try:
            model = streamscope.load(path, engine=engine)
        except UnsupportedCheckpoint as refusal:
            report.refused[engine] = str(refusal)
            continue
        try:
            cache = model.cache(prompt, progress=False)
        finally:
            model.engine.close()
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
