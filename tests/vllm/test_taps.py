"""Taps: a vLLM engine started with taps= serves those values, in traces and bulk runs, and refuses the others.

On a GPU the tapped engine replays CUDA graphs for its decode steps (vLLM's
breakable graphs, broken at each tap), so every value read, edit and steer at a
decode step here goes through a replayed graph; it is held to an eager engine
of the same checkpoint, which runs every step from Python. On this CPU there
are no graphs: the tapped engine runs eagerly, serves its taps alone, and must
equal the eager engine bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import precision
from access import relative_error
from bulk_checks import BULK_FAMILIES, PROMPTS, RELATIVE
import streamscope
from streamscope.errors import Unavailable
from streamscope.families import FAMILIES, VLLM
from streamscope.vllm.blocks import Summed
from streamscope.vllm.taps import tap_locations

STEPS = 4
#: Every family vLLM runs on a GPU, where graphs are replayed; the bulk suites' three block shapes on a CPU.
TAP_FAMILIES = ([family.name for family in FAMILIES if VLLM in family.engines and family.model_type]
                if precision.ON_GPU else list(BULK_FAMILIES))
if precision.FAMILIES:
    TAP_FAMILIES = [family for family in TAP_FAMILIES if family in precision.FAMILIES]


def close(tapped: torch.Tensor, eager: torch.Tensor) -> bool:
    """Bit-equal on the CPU (the same eager code runs); within the GPU engine tolerance where graphs replay."""
    tapped, eager = tapped.float().cpu(), eager.float().cpu()
    if not precision.ON_GPU:
        return torch.equal(tapped, eager)
    return relative_error(tapped, eager) <= RELATIVE


class Pair:
    """An eager engine and a tapped one on the same checkpoint."""

    def __init__(self, family: str, path) -> None:
        self.family = family
        # Qwen3-Next runs bfloat16 in every run of the suite (its CPU kernels have no float32).
        options = precision.engine_kwargs("bfloat16" if family == "qwen3_next" else None)
        self.eager = streamscope.load(path, engine="vllm", **options)
        self.block = self.eager.num_layers // 2
        self.taps = ["layers.*.layer_output", "final_norm_output"]
        try:
            tap_locations(self.eager, ["layers.0.self_attn.queries"])
            self.taps.append("layers.0.self_attn.queries")
        except Unavailable:  # a family without attention heads (Mamba)
            pass
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.tapped = streamscope.load(path, engine="vllm", taps=self.taps, **options)
        self.load_warnings = [str(warning.message) for warning in caught]
        self.heads = "layers.0.self_attn.queries" in self.taps

    def close(self) -> None:
        self.eager.close()
        self.tapped.close()


@pytest.fixture(scope="module", params=TAP_FAMILIES)
def pair(request, checkpoints):
    pair = Pair(request.param, checkpoints(request.param))
    yield pair
    pair.close()


def steps_read(model, prompt: str, heads: bool, edit: torch.Tensor | None = None, block: int = 0) -> dict:
    """Every block's layer_output, the final norm's output and the logits at each of STEPS steps (and block 0's
    queries where `heads`), with `edit` added to block `block`'s layer_output at each step."""
    with model.trace(prompt, temperature=0.0, max_tokens=STEPS, ignore_eos=True) as tracer:
        outputs, norms, logits, queries = list().save(), list().save(), list().save(), list().save()
        for step in tracer.iter[:STEPS]:
            if heads:
                queries.append(model.layers[0].self_attn.queries.clone())
            reads = []
            for index, layer in enumerate(model.layers):
                if edit is not None and index == block:
                    current = layer.layer_output
                    current[:, :] += edit.to(device=current.device, dtype=current.dtype)
                reads.append(layer.layer_output.clone())
            outputs.append(torch.stack(reads))
            norms.append(model.final_norm_output.clone())
            logits.append(model.logits.clone())
    return {"layer_output": list(outputs), "final_norm_output": list(norms), "logits": list(logits),
            "queries": list(queries)}


#: Families whose test checkpoint vLLM runs with no CUDA graphs even when tapped: Llama 4's rotary blocks attend
#: within chunks, and vLLM's chunked local attention backend declares it can never be captured
#: (``AttentionCGSupport.NEVER``), so vLLM lowers ``FULL_DECODE_ONLY`` to ``NONE``.
UNCAPTURED = {"llama4_text"}


def test_a_tapped_engine_says_whether_it_replays_graphs(pair):
    """`graph_mode` is the mode vLLM resolved: decode graphs on a GPU, none on a CPU or where vLLM cannot capture
    the attention, and then a warning at load says the taps buy no speed."""
    uncaptured = not precision.ON_GPU or pair.family in UNCAPTURED
    assert pair.tapped.graph_mode == ("NONE" if uncaptured else "FULL_DECODE_ONLY"), pair.tapped.graph_mode
    assert pair.eager.graph_mode == "NONE"
    said = [message for message in pair.load_warnings if "records no CUDA graphs" in message]
    assert len(said) == (1 if precision.ON_GPU and uncaptured else 0), pair.load_warnings


@pytest.mark.parametrize("settings, off", [
    ({}, False), ({"compilation_config": {}}, False), ({"compilation_config": {"cudagraph_mode": "PIECEWISE"}}, False),
    ({"enforce_eager": True}, True), ({"compilation_config": {"cudagraph_mode": "NONE"}}, True),
    ({"compilation_config": {"cudagraph_mode": "none"}}, True)])
def test_graphs_the_caller_turned_off_are_not_warned_about(settings, off):
    """A tapped engine warns that it records no graphs only where the caller's settings did not ask for none."""
    from vllm.config import CompilationConfig, CUDAGraphMode

    from streamscope.vllm.model import _asks_for_no_graphs

    assert _asks_for_no_graphs(settings) == off
    assert _asks_for_no_graphs({"compilation_config": CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE)})


def test_a_tapped_engine_serves_its_values_at_every_step_as_the_eager_engine_does(pair):
    tapped = steps_read(pair.tapped, PROMPTS[1], pair.heads)
    eager = steps_read(pair.eager, PROMPTS[1], pair.heads)
    for name in tapped:
        assert len(tapped[name]) == len(eager[name]), name
        for step, (mine, theirs) in enumerate(zip(tapped[name], eager[name])):
            assert mine.shape == theirs.shape, (name, step)
            assert close(mine, theirs), (name, step, relative_error(mine.float().cpu(), theirs.float().cpu()))
    assert len(tapped["layer_output"]) == STEPS


def test_an_edit_at_a_tap_lands_at_every_step(pair):
    torch.manual_seed(0)
    vector = torch.randn(pair.eager.hidden_size) * 4
    tapped = steps_read(pair.tapped, PROMPTS[0], False, vector, pair.block)
    eager = steps_read(pair.eager, PROMPTS[0], False, vector, pair.block)
    plain = steps_read(pair.tapped, PROMPTS[0], False)
    for step in range(STEPS):
        assert close(tapped["logits"][step], eager["logits"][step]), step
        assert (tapped["logits"][step].float() - plain["logits"][step].float()).abs().max() > 1e-3, step


def test_a_steered_generation_on_a_tapped_engine_equals_the_eager_engine(pair):
    torch.manual_seed(1)
    steer = streamscope.Steer("layer_output", pair.block, torch.randn(pair.eager.hidden_size), scale=3.0,
                              prompts=[1])
    options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False}
    tapped = pair.tapped.generate(PROMPTS, steer=[steer], **options)
    eager = pair.eager.generate(PROMPTS, steer=[steer], **options)
    plain = pair.tapped.generate(PROMPTS, harvest={"values": "layer_output", "layers": [0]}, **options)
    for index in range(len(PROMPTS)):
        assert tapped.logits[index].shape == (STEPS, pair.eager.vocab_size)
        assert close(tapped.logits[index], eager.logits[index]), index
        # Other requests in the batch are untouched: a replayed step steers the steered request's rows only.
        assert torch.equal(tapped.logits[index], plain.logits[index]) == (index != 1), index


def test_an_ablation_at_every_block_on_a_tapped_engine_equals_the_eager_engine(pair):
    """Every request ablated at every block (on a GPU, each block's edit at a replayed step runs as a captured
    graph: `streamscope.vllm.graphed`), and one request of three ablated (its rows alone, edited eagerly)."""
    torch.manual_seed(2)
    direction = torch.randn(pair.eager.hidden_size)
    every = [streamscope.Steer("layer_output", layer, direction, mode="ablate") for layer in range(pair.eager.num_layers)]
    some = [streamscope.Steer("layer_output", layer, direction, mode="ablate", prompts=[1])
            for layer in range(pair.eager.num_layers)]
    options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False}
    counts = pair.tapped.vllm_entrypoint.collective_rpc("streamscope_graphed_counts")[0]
    plain = pair.tapped.generate(PROMPTS, **options)
    for steers in (every, some):
        tapped = pair.tapped.generate(PROMPTS, steer=steers, **options)
        eager = pair.eager.generate(PROMPTS, steer=steers, **options)
        for index in range(len(PROMPTS)):
            assert close(tapped.logits[index], eager.logits[index]), (index, len(steers))
            steered = steers is every or index == 1
            assert torch.equal(tapped.logits[index], plain.logits[index]) != steered, index
    after = pair.tapped.vllm_entrypoint.collective_rpc("streamscope_graphed_counts")[0]
    # Replayed graphs on a GPU where the stream is held in two halves (the fused layout; a whole stream's edit is
    # written back eagerly), none where the engine records no graphs (a CPU, or attention vLLM cannot capture):
    # each block's edit is captured the second time its buffers and row count come, at the second decode step, and
    # replayed from then on, the same graph at every step.
    graphed = pair.tapped.graph_mode != "NONE" and isinstance(getattr(type(pair.eager.layers[0]), "layer_output",
                                                                          None), Summed)
    replayed = after["replayed"] - counts["replayed"]
    captured = after["captured"] - counts["captured"]
    assert replayed >= (pair.eager.num_layers * (STEPS - 2) if graphed else 0) and (replayed > 0) == graphed, (
        counts, after)
    assert captured <= 2 * pair.eager.num_layers, (counts, after)  # a capture per block and row count seen


def test_a_harvest_on_a_tapped_engine_equals_the_eager_engine(pair):
    tapped = pair.tapped.harvest(PROMPTS, "layer_output", positions="all", progress=False)
    eager = pair.eager.harvest(PROMPTS, "layer_output", positions="all", progress=False)
    for index in range(len(PROMPTS)):
        assert close(tapped["layer_output"][index], eager["layer_output"][index]), index


def test_an_untapped_value_is_refused_with_the_fix_and_the_engine_serves_on(pair):
    model = pair.tapped
    with pytest.raises(Unavailable, match=r"taps=\[\.\.\., 'layers\.0\.layer_input'\]"):
        with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
            model.layers[0].layer_input.save()
    with pytest.raises(Unavailable, match=r"'layers\.1\.layer_input'"):
        model.harvest(PROMPTS[:1], "layer_input", layers=[1], progress=False)
    with pytest.raises(Unavailable, match="not among them"):
        model.generate(PROMPTS[:1], max_tokens=2, progress=False,
                       steer=[streamscope.Steer("layer_input", 1, torch.ones(model.hidden_size))])
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        output = model.layers[0].layer_output.save()
    assert output.shape[-1] == model.hidden_size


@pytest.mark.skipif("llama" not in TAP_FAMILIES,
                    reason="tap names resolve the same on every family, so this is checked once, on the llama "
                           "checkpoint, in the run that selects llama; this run selects other families "
                           "(STREAMSCOPE_TEST_FAMILIES), whose own taps the tests above check")
def test_tap_names_are_checked_before_the_engine_starts(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path, engine="vllm", taps=["layers.0:2.layer_output", "layers.-1.layer_mid"],
                             **precision.engine_kwargs())
    last = model.num_layers - 1
    assert model.tapped == {"model.model.layers.0.output", "model.model.layers.1.output",
                            f"model.model.layers.{last}.post_attention_layernorm.input"}
    model.close()
    cases = [("layers.99.layer_output", IndexError, "out of range"),
             ("layers.5:9.layer_output", IndexError, "select none"),
             ("layers.x.layer_output", ValueError, "an index, a range"),
             ("layers.0", ValueError, "no value"),
             ("layers.0.no_such_value", ValueError, "has no value 'no_such_value'"),
             ("logits_of_nothing", ValueError, "has no value")]
    for tap, error, message in cases:
        with pytest.raises(error, match=message):
            streamscope.load(path, engine="vllm", taps=[tap], **precision.engine_kwargs())
    with pytest.raises(ValueError, match="contradicts taps"):
        streamscope.load(path, engine="vllm", taps=["layers.0.layer_output"], enforce_eager=True,
                         **precision.engine_kwargs())
