"""Check a checkpoint: every value streamscope serves, on each engine, against transformers' own forward.

    python -m streamscope check PATH --engines transformers,vllm

The reference is transformers' forward in float32 read with plain torch hooks
on the modules where each value is computed (`streamscope.testing.oracle`, per
family, in the names of the transformers implementation; the test suite's
oracle reads the same map), not streamscope's code. A family the map does not
know is refused with the reason (`UnknownFamily`), not checked against another's. Each served value's
worst relative error over the blocks (largest absolute difference over the
reference's largest magnitude) is held to a tolerance: a stated one where the
engine runs float32 on a CPU (the reference's own arithmetic, in another order
at most), else one measured on this checkpoint and prompt, per value: twice the
distance transformers' own forward at the engine's precision (bfloat16, or
TF32 matmuls for vLLM in float32 on a GPU) keeps from the float32 reference
(`streamscope.testing.precision`), as the GPU test suite measures its own.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import transformers

import streamscope

from .blocks import SHORT_CONTRIBUTIONS
from .engine_registry import DEVICE_OPTIONS
from .errors import UnsupportedCheckpoint
from .families.spec import spec_of
from .testing import oracle, precision
from .transformers import families

#: Stated relative tolerances for float32 on a CPU: the same kernels agree to about 1e-6; vLLM's kernels differ
#: in their order of operations, hence more room. A measured tolerance is never below its engine's.
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
    config = transformers.AutoConfig.from_pretrained(path)
    spec = spec_of(families.family_for(config.model_type))
    return dict(spec.checkpoint_defaults(config, {})) if spec.checkpoint_defaults is not None else {}


@torch.no_grad()
def reference_values(path: str, prompt: str, device: str = "cpu",
                     at: Optional[precision.Measuring] = None) -> tuple[dict[str, torch.Tensor], str]:
    """transformers' float32 forward on `prompt`, read with torch hooks: ``{"layers.3.layer_mid": tensor, ...}``;
    with `at`, its forward at that precision instead (the values in float32)."""
    settings = _as_loaded(path)
    if at is not None and at.experts is not None:
        settings["experts_implementation"] = at.experts
    dtype = at.dtype if at is not None else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **settings).to(device).eval()
    family = model.config.model_type
    sites = oracle.sites(model, family)  # UnknownFamily where the map has none
    input_ids = transformers.AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt").input_ids.to(device)
    found: dict[str, torch.Tensor] = {}

    def recorder(key: str, factor: Optional[float]) -> Callable[[torch.Tensor], None]:
        def store(tensor: torch.Tensor) -> None:
            tensor = tensor.detach().float().reshape(*input_ids.shape, tensor.shape[-1])
            found.setdefault(key, tensor * factor if factor is not None else tensor.clone())
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
        with precision.tf32_matmuls(at is not None and at.tf32):
            found["logits"] = model(input_ids).logits.float()
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
    #: value -> engine -> the tolerance measured for it; an engine absent here is held to its stated `TOLERANCES`.
    measured: dict[str, dict[str, float]] = field(default_factory=dict)
    #: engine -> how its tolerance was set (the stated number, or the precision it was measured at).
    rules: dict[str, str] = field(default_factory=dict)

    def tolerance(self, name: str, engine: str) -> float:
        return self.measured.get(name, {}).get(engine, TOLERANCES[engine])

    @property
    def passed(self) -> bool:
        return all(error <= self.tolerance(name, engine)
                   for name, row in self.errors.items() for engine, error in row.items())

    def __str__(self) -> str:
        width = max(map(len, [*self.errors, *self.missing, "value"]))
        tolerances = "; ".join(f"{engine} {self.rules.get(engine, f'{TOLERANCES[engine]:.0e}')}"
                               for engine in self.engines)
        measured = {engine for row in self.measured.values() for engine in row}
        cell = {engine: 28 if engine in measured else 16 for engine in self.engines}
        lines = [f"{self.path} ({self.family}): worst relative error over the blocks, against transformers' "
                 f"float32 forward read with torch hooks (tolerance: {tolerances})",
                 f"  {'value':<{width}}  " + "  ".join(f"{engine:>{cell[engine]}}" for engine in self.engines)]
        for name in [*self.errors, *(n for n in self.missing if n not in self.errors)]:
            cells = []
            for engine in self.engines:
                error = self.errors.get(name, {}).get(engine)
                if error is None:
                    cells.append(f"{'-':>{cell[engine]}}")
                    continue
                tolerance = self.tolerance(name, engine)
                verdict = "ok" if error <= tolerance else "FAIL"
                shown = f"{error:.1e} <= {tolerance:.1e}" if engine in measured else f"{error:.1e}"
                cells.append(f"{shown:>{cell[engine] - 5}} {verdict:>4}")
            lines.append(f"  {name:<{width}}  " + "  ".join(cells))
        lines += [f"  {engine} cannot run this checkpoint, so nothing of it is checked: {reason}"
                  for engine, reason in self.refused.items()]
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def _short(key: str) -> str:
    name = key.split(".", 2)[-1] if key.startswith("layers.") else key
    return name.rsplit(".", 1)[-1] if name.endswith((*SHORT_CONTRIBUTIONS, *oracle.NEURONS)) else name


def check(path: str, engines: tuple[str, ...] = ("transformers", "vllm"),
          prompt: str = "The Eiffel Tower is in Paris, and the quick brown fox", dtype: str = "float32",
          device: Optional[str] = None) -> Report:
    """Read every served value of `path` on each engine, run in `dtype`, and compare it with the reference.

    The reference is transformers' float32 forward on `device` (the GPU where
    torch has one, else the CPU; TF32 off), where the transformers engine
    runs too (vLLM runs where its build does). Returns a `Report`;
    ``report.passed`` is False when any value on any engine exceeds its
    tolerance: stated for float32 on a CPU, else measured per value (the module
    docstring). An engine that refuses the checkpoint (`UnsupportedCheckpoint`)
    is reported with its reason, and the others are checked.
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r}: check runs the engines in float32, bfloat16 or float16.")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with precision.tf32_matmuls(False):  # the reference is float32 proper
        reference, family = reference_values(path, prompt, device)
    report = Report(str(path), family, list(engines))
    distances: dict[precision.Measuring, dict[str, float]] = {}
    for engine in engines:
        options: dict = {"dtype": dtype}
        if device != "cpu":  # the engine beside the reference (where the engine can be placed)
            options.update({key: value.format(device=device) for key, value in DEVICE_OPTIONS.get(engine, {}).items()})
        try:
            model = streamscope.load(path, engine=engine, **options)
        except UnsupportedCheckpoint as refusal:
            report.refused[engine] = str(refusal)
            continue
        try:
            where, computed_in = model.engine.precision()
            at = precision.measuring(where, computed_in, family, model.engine.reference_kernels)
            if at is None:
                report.rules[engine] = f"{TOLERANCES[engine]:.0e}, stated ({dtype} on {where})"
            else:
                if at not in distances:
                    distances[at] = _distances(reference, reference_values(path, prompt, device, at)[0])
                report.rules[engine] = (f"{precision.MEASURED_FACTOR:g}x transformers' own distance in {at}, per "
                                        f"value, at least {TOLERANCES[engine]:.0e}")
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
            row = report.errors.setdefault(short, {})
            row[engine] = max(row.get(engine, 0.0), _relative(value[0, : expected.shape[1]], expected[0]))
            if at is not None:
                report.measured.setdefault(short, {})[engine] = max(
                    TOLERANCES[engine], precision.MEASURED_FACTOR * distances[at].get(short, 0.0))
    return report


def _relative(value: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest absolute difference over the reference's largest magnitude."""
    expected = expected.float()
    value = value.float().to(expected.device)
    return ((value - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _distances(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per value (worst over the blocks), how far `other` (transformers at an engine's precision) is from the
    float32 `reference`."""
    found: dict[str, float] = {}
    for key, expected in reference.items():
        if key in other:
            short = _short(key)
            found[short] = max(found.get(short, 0.0), _relative(other[key][0], expected[0]))
    return found
