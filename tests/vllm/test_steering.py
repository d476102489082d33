"""Steering operations on vLLM, eager and tapped engines: the bulk path and traces against the oracle.

See tests/steer_checks.py. One engine at a time: the bulk suites' three
block shapes eagerly, and Llama started with taps at the steered values
(on a GPU its decode steps replay CUDA graphs, the steers run at the taps;
on this CPU it runs eagerly but serves only its taps).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bulk_engines
import steer_checks
from access import relative_error
from bulk_checks import BULK_FAMILIES, PROMPTS
from steer_checks import CASES, STEPS
import streamscope
from streamscope.bulk.apply import Applier
from streamscope.bulk.spec import Site, locate, stream_norms
from streamscope.values import OUTPUT
from streamscope.vllm.blocks import Summed

TAPS = ["layers.*.layer_input", "layers.*.layer_output", "layers.*.mlp.mlp_output",
        "layers.*.self_attn.attention_output"]
ENGINES = [*BULK_FAMILIES, "llama-tapped"]


engine = bulk_engines.fixture("vllm", ENGINES, taps=TAPS)


@pytest.mark.parametrize("case", list(CASES))
def test_a_steered_generation_equals_the_oracle_edited_by_plain_hooks(engine, case):
    steer_checks.check_case(engine.model, engine.reference, engine.tokenizer, engine.family, case)


def traced_logits(model, prompt: str, steers, steps: int) -> torch.Tensor:
    """A trace that applies the steers at every step with `streamscope.apply_steers`."""
    with model.trace(prompt, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        logits = list().save()
        for step in tracer.iter[:steps]:
            streamscope.apply_steers(model, steers, step)
            logits.append(model.logits[0].clone())
    return torch.stack(list(logits)).cpu()


@pytest.mark.parametrize("case", ["ablate_half_from_step_2", "clamp_norm_match_generated_only",
                                  "set_norm_match_prompt_positions", "several_blocks"])
def test_a_trace_applying_the_steers_equals_the_bulk_path(engine, case):
    model = engine.model
    steers = CASES[case](model)
    result = model.generate(PROMPTS[1:2], max_tokens=STEPS, steer=steers, return_logits=True, ignore_eos=True,
                            progress=False)
    traced = traced_logits(model, PROMPTS[1], steers, STEPS)
    assert relative_error(traced, result.logits[0]) <= 1e-6


def test_bad_steers_are_refused_before_the_engine_runs_and_it_serves_on(engine):
    steer_checks.check_bad_steers(engine.model)


def test_a_harvest_reads_the_values_under_steers(engine):
    steer_checks.check_harvest_under_steers(engine.model)


# The route of an ablation on vLLM's fused blocks, counted: the fewest tensor operations per hook call.


class DispatchedOps(TorchDispatchMode):
    """The tensor operations dispatched while it is on, by name (a view counts: it is host work on a GPU too)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def summed_halves(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    return (torch.randn(rows, width, generator=generator) * 0.1, torch.randn(rows, width, generator=generator))


#: (a direction's edit, the rows it edits) -> the exact operations of one edit of the
#: hidden half: the projection from both halves (mv, addmv_), then the change in one rank-one update; a slice of
#: the batch where the step has padding rows past its tokens, a gather and index_add_ where rows are scattered.
ROUTES = {
    ("ablate", "whole"): ["mv", "addmv_", "addr_"],
    ("ablate", "padded"): ["slice", "slice", "mv", "addmv_", "addr_"],
    ("ablate", "scattered"): ["index", "index", "mv", "addmv_", "outer", "index_add_"],
    ("clamp", "whole"): ["mv", "addmv_", "rsub", "addr_"],
    ("clamp", "padded"): ["slice", "slice", "mv", "addmv_", "rsub", "addr_"],
    ("clamp", "scattered"): ["index", "index", "mv", "addmv_", "rsub", "outer", "index_add_"],
    ("ablate", "one half"): ["mv", "addr_"],  # block 0's input: the embeddings, no residual yet
}


@pytest.mark.parametrize("mode, rows", list(ROUTES))
def test_a_direction_edits_fused_halves_in_the_fewest_operations_and_equals_plain_torch(mode, rows):
    """`Summed.row_editor` (what a bulk steer's hook calls on vLLM's fused blocks) on halves ``[12, 64]``: the exact
    operations of `ROUTES`, and the stream ``hidden + residual`` afterwards equal to plain torch's edit of it
    (steer_checks.plain_operation) at the chosen rows, the others unchanged bit for bit."""
    chosen = {"whole": slice(0, 12), "padded": slice(0, 9), "scattered": torch.tensor([1, 4, 5, 10]),
              "one half": slice(0, 12)}[rows]
    steer = streamscope.Steer("layer_output", 0, torch.randn(64, generator=torch.Generator().manual_seed(3)) * 5,
                              mode=mode, **({"scale": 0.75} if mode == "ablate" else {"projection": -2.5}))
    hidden, residual = summed_halves(12, 64)
    if rows == "one half":
        residual = torch.zeros_like(hidden)  # only for the sums below: the call gets None
    before = hidden + residual
    expected = before.clone()
    expected[chosen] = steer_checks.plain_operation(before[chosen], steer)

    def refused(raw, rows):
        raise AssertionError("the general route was taken")
    editor = Summed(None, OUTPUT).row_editor(steer.operation(torch.float32, "cpu"), refused)
    with torch.inference_mode(), DispatchedOps() as ops:
        editor((hidden, None if rows == "one half" else residual), chosen)
    assert ops.names == ROUTES[(mode, rows)]
    after = hidden + residual
    # The projection is a sum of 64 products, taken over the two halves apart here and over their sum in plain torch:
    # the two orders differ by at most 64 float32 roundings of the largest term (a reduction's n * eps bound).
    assert relative_error(after, expected) <= 64 * torch.finfo(torch.float32).eps
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[chosen] = False
    assert torch.equal(after[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["add", "set"])
@pytest.mark.parametrize("rows", ["whole", "padded", "scattered", "one half"])
@pytest.mark.parametrize("per_row", [False, True])
def test_a_batched_add_or_set_on_fused_halves_is_the_whole_batch_write_back_at_its_rows(dtype, mode, rows, per_row):
    """A server's add or set batched over its requests (`Site.edit_rows` with a mode, on vLLM's fused halves
    ``[12, 64]``): the hidden half afterwards is bit for bit what the write-back of the whole batch's edited copy
    (a trace's edit, `Summed.write`) leaves, at the edited rows, and every other row is untouched."""
    chosen = {"whole": slice(0, 12), "padded": slice(0, 9), "scattered": torch.tensor([1, 4, 5, 10]),
              "one half": slice(0, 12)}[rows]
    count = len(range(12)[chosen]) if isinstance(chosen, slice) else len(chosen)
    generator = torch.Generator().manual_seed(7)
    vectors = torch.randn(count if per_row else 64, *([64] if per_row else []), generator=generator).to(dtype)
    hidden, residual = (half.to(dtype) for half in summed_halves(12, 64))
    if rows == "one half":
        residual = None
    raw = (hidden, residual)
    stream = hidden.clone() if residual is None else hidden + residual
    if mode == "add":
        stream[chosen] += vectors
    else:
        stream[chosen] = vectors
    expected = stream if residual is None else hidden + (stream - (hidden + residual))
    before = hidden.clone()
    site = SimpleNamespace(descriptor=Summed(None, OUTPUT))
    with torch.inference_mode():
        Site.edit_rows(site, raw, chosen, vectors, mode)  # a Summed value takes it at its rows, not the whole batch
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[chosen] = False
    assert torch.equal(hidden[~untouched], expected[~untouched])
    assert torch.equal(hidden[untouched], before[untouched])  # not even a zero added


def test_an_ablation_at_every_block_runs_three_operations_a_hook_call_on_fused_blocks(engine, monkeypatch):
    """A bulk generation with an ablation at every block's layer_output, every row steered: on a family whose
    blocks hand the stream on in two halves (`Summed`), each hook call dispatches exactly mv, addmv_ and addr_
    (eager and tapped engines; prompt and decode steps); on a whole-stream family each takes the general route
    (the batch read, edited and written back), once a call. The steered logits are the oracle's
    (test_a_steered_generation_equals_the_oracle_edited_by_plain_hooks)."""
    model = engine.model
    steers = [streamscope.Steer("layer_output", block, steer_checks.vector(model, 12), mode="ablate", positions="all")
              for block in range(model.num_layers)]
    calls: list[list[str]] = []
    general: list[int] = []
    original_apply, original_write = Applier._apply_all, Site._write_rows

    def counted(self, work, raw, editors):
        with DispatchedOps() as ops:
            original_apply(self, work, raw, editors)
        calls.append(ops.names)

    def write_rows(self, *args):
        general.append(1)
        return original_write(self, *args)

    # The dose check's stream norms are measured (a harvest, once per model) before the counted run.
    stream_norms(model, [("layer_output", block) for block in range(model.num_layers)])
    monkeypatch.setattr(Applier, "_apply_all", counted)
    monkeypatch.setattr(Site, "_write_rows", write_rows)
    result = model.generate(PROMPTS[:2], max_tokens=STEPS, steer=steers, ignore_eos=True, progress=False)
    assert [len(tokens) for tokens in result.tokens] == [STEPS, STEPS]
    # One call a block a step: the prompts' step, then a decode step for each token after the first.
    assert len(calls) == model.num_layers * STEPS
    if isinstance(locate(model, "layer_output", 0).descriptor, Summed):
        assert all(names == ["mv", "addmv_", "addr_"] for names in calls), calls[:3]
        assert not general
    else:
        assert len(general) == len(calls)
