"""The value x family matrix both engines' suites share: every value a support table can list, its oracle, its check.

`VALUES` names every row `support()` can have (root, then block rows). A
`Reference` is the oracle's view of one checkpoint and prompt, nothing of it
from streamscope: transformers' forward read with torch hooks (oracle.py),
the tensors its attention kernels receive and return and its eager weights
(attention_oracle.py), and its routers' outputs (moe_oracle.py). `plan` lists
what a model serves in the order the model computes it, `read` reads all of it
in one trace (on vLLM the trace body runs in the engine's worker: the values
come back packed in one saved tensor), and `check` compares one value with the
oracle, by the rule its kind needs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from transformers import AutoModelForCausalLM

import attention_oracle
import moe_oracle
import oracle
from access import relative_error

#: head_results: the output projection's input per head times its columns (`attention_oracle.head_results`);
#: the pre-rotary queries and keys: the rotary's arguments (`attention_oracle.pre_rotary_tensors`); the projected
#: ones: the q/k norm's input, or the pre-rotary ones where none norms (`attention_oracle.projected_tensors`).
PRE_ROTARY = ("queries_pre_rotary", "keys_pre_rotary")
PROJECTED = ("queries_projected", "keys_projected")
INTERNALS = ("queries_projected", "queries_pre_rotary", "keys_projected", "keys_pre_rotary", "queries", "keys", "values", "scores", "pattern", "head_outputs", "head_results")
ROUTING = ("router_logits", "chosen_experts", "routing_weights")
NEURONS = oracle.NEURONS
ROOT = ("token_embeddings", "final_norm_output", "logits", "prompt_logits")
BLOCK = ("layer_input", "attention_norm_output", *(f"self_attn.{name}" for name in INTERNALS),
         "self_attn.attention_output", "linear_attn.attention_output", "layer_mid", "mlp_norm_output", "mlp_input",
         *(f"mlp.{name}" for name in ROUTING), *(f"mlp.{name}" for name in NEURONS), "mlp.shared_experts.mlp_output",
         "mlp.mlp_output", "layer_output")
#: Every value a support table can list: a row not named here is a value no test compares.
VALUES = ROOT + BLOCK


#: The largest error each (engine, case) was held to its tolerance by, and where: printed at the end of a run.
RECORD: dict[tuple[str, str], dict] = {}


def record(engine: str, case: str, name: str, error: float, tolerance: float) -> None:
    """Note `error` (of value `name`, held to `tolerance`) if it is the case's largest share of its tolerance."""
    entry = RECORD.setdefault((engine, case), {"share": -1.0})
    if tolerance > 0 and error / tolerance > entry["share"]:
        entry.update(share=error / tolerance, value=name, error=error, tolerance=tolerance)


def summary() -> list[str]:
    """One line per engine and case: the value nearest its tolerance, its error and the tolerance."""
    return [f"{engine:<12} {case:<20} {entry['value']:<30} {entry['error']:.2e} <= {entry['tolerance']:.2e}"
            for (engine, case), entry in sorted(RECORD.items()) if "value" in entry]


def reach(model, name: str, block: Optional[int]):
    """The streamscope value `name` (a support row's name) of `block`, or of the root where block is None."""
    value = model if block is None else model.layers[block]
    for part in name.split("."):
        value = getattr(value, part)
    return value


def rows(support, name: str) -> dict[Optional[int], Optional[str]]:
    """Where the support table lists `name`: {block (None: the root): None if served, else the reason}."""
    if name in ROOT:
        return {None: support.root.rows[name]} if name in support.root.rows else {}
    return {block: table.rows[name] for block, table in enumerate(support.blocks) if name in table.rows}


class Reference:
    """The oracle's every value for one checkpoint and prompt, in `dtype` on `device`, inside `context`.

    The stream, kernel tensors and routers are read off the `implementation`
    forward (`sdpa`: the model transformers loads by default); the attention
    weights off an eager model, with `eager_overrides` on its config (the eager
    twin of an sdpa forward that differs from eager: Gemma 2's, soft cap off).
    `experts`: transformers' experts implementation for a mixture of experts
    (None: its default).
    """

    def __init__(self, path, family: str, input_ids: torch.Tensor, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", build: Callable[[], Any] = contextlib.nullcontext,
                 context: Callable[[], Any] = contextlib.nullcontext, implementation: str = "sdpa",
                 eager_overrides: Optional[dict] = None, experts: Optional[str] = None):
        self.family = family
        self.input_ids = input_ids = input_ids.to(device)
        chosen = {"experts_implementation": experts} if experts else {}
        with build():  # (beside a vLLM engine: its Transformers backend patched transformers' classes)
            self.model = AutoModelForCausalLM.from_pretrained(
                path, **{**attention_oracle.load_kwargs(family, implementation), "dtype": dtype, **chosen}
            ).to(device).eval()
            self.eager = AutoModelForCausalLM.from_pretrained(
                path, **{**attention_oracle.load_kwargs(family, "eager"), "dtype": dtype, **(eager_overrides or {}),
                         **chosen}).to(device).eval()
        self.attention_blocks = sorted(attention_oracle.attention_modules(self.model))
        with context(), torch.no_grad():
            self.stream = oracle.values(self.model, family, input_ids)
            self.kernel = attention_oracle.kernel_tensors(self.model, family, input_ids)
            self.results = attention_oracle.head_results(self.model, input_ids, self.kernel)
            self.pre_rotary = attention_oracle.pre_rotary_tensors(self.model, family, input_ids, self.kernel)
            self.projected = attention_oracle.projected_tensors(self.model, family, input_ids, self.pre_rotary)
            if not self.attention_blocks:
                self.weights = {}
            elif attention_oracle.eager_adds_alibi_twice(family, self.model.config):
                self.weights = attention_oracle.kernel_weights(self.model, family, input_ids)
            else:
                self.weights = attention_oracle.eager_weights(self.eager, input_ids)
            self.routing = moe_oracle.router_outputs(self.model, family, input_ids)

    def expected(self, name: str, block: Optional[int]) -> Optional[torch.Tensor]:
        """The oracle's tensor for `name` on `block` (all positions), None where the model has no such value."""
        if block is None:
            return self.stream["logits"] if name in ("logits", "prompt_logits") else self.stream.get(name)
        *owner, leaf = name.split(".")
        if owner == ["self_attn"] and leaf in INTERNALS:
            if block not in self.kernel:
                return None
            if leaf == "head_results":
                return self.results.get(block)
            if leaf in PRE_ROTARY:
                return self.pre_rotary[block][leaf]
            if leaf in PROJECTED:
                return self.projected[block][leaf]
            return self.weights[block] if leaf in ("scores", "pattern") else self.kernel[block][leaf]
        if owner == ["mlp"] and leaf in ROUTING:
            return self.routing.get(block, {}).get(leaf)
        if owner == ["mlp"] and leaf in NEURONS:
            by_block = self.stream.get(leaf)
            return None if by_block is None else by_block[block]
        if owner == ["mlp", "shared_experts"]:
            return self.routing.get(block, {}).get("shared")
        by_block = self.stream.get(leaf)
        return None if by_block is None else by_block[block]

    def order(self) -> list[tuple[str, Optional[int]]]:
        """(oracle name, block) in the order the model computed them, once each."""
        seen: list = []
        for entry in self.stream["order"]:
            if entry not in seen:
                seen.append(entry)
        return seen


#: Block values every block computes after its attention (not a parallel block's MLP norm, computed beside it).
AFTER_ATTENTION = ("layer_mid", "mlp_input", "mlp_output", "layer_output")


def plan(model, reference: Reference, prompt_logits_after: str) -> list[tuple[str, Optional[int]]]:
    """Every (value, block) the model serves that the oracle computes, in the order the model computes them.

    Attention internals come just before their block's attention output, the
    router's values just before the MLP's output (a shared expert that runs
    first, first), `prompt_logits` after the root value it is computed from
    (before the logits where the model has no such value).
    """
    support = model.support()
    steps: list[tuple[str, Optional[int]]] = []
    order = reference.order()
    attended: set[int] = set()
    # a post-LN block adds no tensor of the oracle's forward (the norm follows the add): its internals come
    # before the first value computed after the attention
    added = {block for name, block in order if name == "attention_output"}
    # a model without that root value (no final norm: OPT-350m) computes prompt_logits just before its logits
    has_source = (prompt_logits_after, None) in order
    for name, block in order:
        if block is None:
            if name == "logits" and not has_source:
                steps.append(("prompt_logits", None))
            steps.append((name, None))
            if name == prompt_logits_after:
                steps.append(("prompt_logits", None))
            continue
        if block not in attended and (name == "attention_output" or block not in added and name in AFTER_ATTENTION):
            attended.add(block)
            steps += [(f"self_attn.{leaf}", block) for leaf in INTERNALS]
        if name == "attention_output":
            mixer = "self_attn" if block in reference.attention_blocks else "linear_attn"
            steps.append((f"{mixer}.attention_output", block))
        elif name in NEURONS:
            steps.append((f"mlp.{name}", block))
        elif name == "mlp_output":
            routing = [(f"mlp.{leaf}", block) for leaf in ROUTING]
            shared = [("mlp.shared_experts.mlp_output", block)]
            steps += (shared + routing) if moe_oracle.shared_first(reference.family) else (routing + shared)
            steps.append(("mlp.mlp_output", block))
        else:
            steps.append((name, block))
    return [(name, block) for name, block in steps
            if (support.root.rows if block is None else support[block].rows).get(name, "absent") is None
            and reference.expected(name, block) is not None]


def read(model, steps: list[tuple[str, Optional[int]]], trace_input, **trace_kwargs) -> dict:
    """Every value in `steps`, read in one trace: {(name, block): tensor}.

    On vLLM the body runs in the engine's worker and saves come back by name:
    the values, of many shapes and dtypes, come back as one float32 tensor and
    a table of their shapes (exact for every dtype the values come in:
    bfloat16, float32 and expert indices below 2**24).
    """
    with model.trace(trace_input, **trace_kwargs):
        values = [reach(model, name, block) for name, block in steps]
        packed = torch.cat([value.detach().float().flatten() for value in values]).save()
        shapes = torch.tensor([[value.dim(), *value.shape, *[0] * (5 - value.dim())] for value in values]).save()
        kinds = torch.tensor([value.dtype.is_floating_point for value in values]).save()
    found, offset = {}, 0
    for (name, block), shape, floating in zip(steps, shapes.tolist(), kinds.tolist()):
        size = tuple(shape[1:1 + shape[0]])
        count = int(torch.tensor(size).prod().item()) if size else 1
        value = packed[offset:offset + count].reshape(size)
        found[(name, block)] = value if floating else value.long()
        offset += count
    assert offset == packed.numel()
    return found


def attention_kernel_error(model, saved: dict) -> float:
    """How far the engine's attention kernel keeps from torch's arithmetic on the kernel's own inputs, relative,
    the worst block: its `head_outputs` against `pattern @ values` in float64, all three read in one run (`saved`,
    as `read` returns it; the pattern is the softmax of the kernel's queries and keys with the family's scale,
    soft cap and mask). 0 where no block serves all three."""
    worst = 0.0
    for block in range(model.num_layers):
        keys = [(f"self_attn.{name}", block) for name in ("pattern", "values", "head_outputs")]
        if not all(key in saved for key in keys):
            continue
        pattern, values, outputs = (saved[key].double() for key in keys)
        values = values.repeat_interleave(pattern.shape[1] // values.shape[1], dim=1)
        mixed = (pattern @ values).transpose(1, 2)
        worst = max(worst, ((outputs - mixed).abs().max() / mixed.abs().max().clamp_min(1e-30)).item())
    return worst


def attention_steps(model) -> list[tuple[str, Optional[int]]]:
    """The `read` steps `attention_kernel_error` needs: each block's pattern, values and head_outputs it serves."""
    steps: list[tuple[str, Optional[int]]] = []
    for block in range(model.num_layers):
        rows = model.layers[block].support().rows
        names = [f"self_attn.{name}" for name in ("values", "pattern", "head_outputs")]  # the order they are computed
        if all(rows.get(name, "absent") is None for name in names):
            steps += [(name, block) for name in names]
    return steps


class Tolerances:
    """What a family's values are held to: relative for tensors, absolute for attention weights in [0, 1]."""

    def __init__(self, relative: float, pattern: float):
        self.relative, self.pattern = relative, pattern

    def of(self, name: str) -> float:
        """The tolerance value `name` is held to."""
        return self.pattern if name.endswith((".scores", ".pattern")) else self.relative

    @classmethod
    def measured(cls, low: Reference, exact: Reference, factor: float) -> "Tolerances":
        """`factor` times the distance `low` (transformers at a lower precision) keeps from `exact`."""
        relative = [relative_error(low.stream["logits"], exact.stream["logits"])]
        for name, block in exact.order():
            reference = exact.stream[name] if block is None else exact.stream[name][block]
            value = low.stream[name] if block is None else low.stream[name][block]
            relative.append(relative_error(value, reference))
        for block, tensors in exact.kernel.items():
            relative += [relative_error(low.kernel[block][name], tensor) for name, tensor in tensors.items()]
        relative += [relative_error(low.results[block], results) for block, results in exact.results.items()]
        relative += [relative_error(low.pre_rotary[block][name], tensor)
                     for block, tensors in exact.pre_rotary.items() for name, tensor in tensors.items()]
        relative += [relative_error(low.projected[block][name], tensor)
                     for block, tensors in exact.projected.items() for name, tensor in tensors.items()]
        pattern = [(low.weights[block].float() - weights.float()).abs().max().item()
                   for block, weights in exact.weights.items()]
        return cls(factor * max(relative), factor * max(pattern, default=0.0))


def check(name: str, value: torch.Tensor, reference: Reference, block: Optional[int], tolerances: Tolerances,
          sampled: bool = False) -> float:
    """Assert that `value` is the oracle's `name` on `block`; return the error it was held to the tolerance by.

    `sampled`: `logits` are the sampled (last) position only, as vLLM serves them.
    """
    expected = reference.expected(name, block)
    leaf = name.rsplit(".", 1)[-1]
    where = (name, block)
    if name == "logits" and sampled:
        expected = expected[:, -1]
    # its kernel gets each kv head per query head (so do its pre-rotary keys on a block that rotates nothing)
    if leaf in ("keys", "values", "keys_pre_rotary", "keys_projected") and reference.family == "falcon":
        expected = expected[:, ::expected.shape[1] // value.shape[1]]
    assert tuple(value.shape) == tuple(expected.shape), (where, tuple(value.shape), tuple(expected.shape))
    if leaf in ("scores", "pattern"):
        weights = expected.float().cpu()
        value = value.float().cpu()
        masked = weights == 0
        assert masked.any(), where  # causal at least
        if leaf == "scores":  # -inf exactly where masked; their softmax is the model's weights
            assert torch.all(torch.isinf(value[masked]) & (value[masked] < 0)), where
            assert torch.all(torch.isfinite(value[~masked])), where
            value = torch.softmax(value, dim=-1)
        assert torch.all(value[masked] == 0), where
        error = (value - weights).abs().max().item()
        assert error <= tolerances.of(name), (where, error, tolerances.of(name))
        return error
    if leaf == "chosen_experts":
        assert torch.equal(value.long().cpu(), expected.long().cpu()), where
        return 0.0
    error = relative_error(value, expected)
    assert error <= tolerances.of(name), (where, error, tolerances.of(name))
    return error


def head_results_edit_error(model, reference: Reference, trace_input, tolerance: float, sampled: bool = False,
                            **trace_kwargs) -> float:
    """Scale one head's `head_results` (the last head, each block that serves it in turn) by 10 and assert the
    logits are the oracle's with that head's result scaled by a hook on its output projection
    (`attention_oracle.logits_with_head_scaled`), held to `tolerance`, and that those differ from the unedited
    logits by more than twice it (so a dropped edit fails); return the largest error. `sampled`: the engine
    serves the last position's logits only (vLLM)."""
    worst = 0.0
    for block, reason in rows(model.support(), "self_attn.head_results").items():
        if reason is not None:
            continue
        heads = reference.results[block].shape[-2]
        with model.trace(trace_input, **trace_kwargs):
            results = model.layers[block].self_attn.head_results
            results[:, :, heads - 1] *= 10.0
            logits = model.logits.save()
        expected = attention_oracle.logits_with_head_scaled(reference.model, reference.input_ids, block, heads - 1,
                                                            heads, 10.0)
        if sampled:
            expected = expected[:, -1]
        unedited = reference.stream["logits"][:, -1] if sampled else reference.stream["logits"]
        assert relative_error(expected, unedited) > 2 * tolerance, (block, "an edit dropped would pass")
        error = relative_error(logits, expected)
        assert error <= tolerance, (block, error, tolerance)
        worst = max(worst, error)
    return worst


def head_results_harvest_error(model, reference: Reference, trace_input, tolerance: float) -> float:
    """Harvest `self_attn.head_results` at every position of `trace_input` on every block that serves it and
    assert each block's ``[positions, heads, hidden]`` is the oracle's (`attention_oracle.head_results`: the output
    projection's input read with a torch hook, per head times its columns), held to `tolerance`; every block that
    does not serve it refuses the harvest before the engine runs, with support()'s reason. Returns the largest
    error."""
    import pytest

    from streamscope.errors import Unavailable

    where = rows(model.support(), "self_attn.head_results")
    served = [block for block, reason in where.items() if reason is None]
    worst = 0.0
    if served:
        harvest = model.harvest([trace_input], "self_attn.head_results", layers=served, positions="all",
                                progress=False)
        got = harvest["self_attn.head_results"][0]  # [blocks, positions, heads, hidden]
        for slot, block in enumerate(served):
            expected = reference.results[block][0]
            assert tuple(got[slot].shape) == tuple(expected.shape), (block, tuple(got.shape), tuple(expected.shape))
            error = relative_error(got[slot], expected)
            assert error <= tolerance, (block, error, tolerance)
            worst = max(worst, error)
    for reason, block in {reason: block for block, reason in where.items() if reason is not None}.items():
        with pytest.raises(Unavailable) as raised:
            model.harvest([trace_input], "self_attn.head_results", layers=[block], progress=False)
        assert raised.value.reason == reason, block
    return worst
