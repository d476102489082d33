"""Mixtures of experts on transformers: the router's values and the shared expert against plain torch hooks.

For each family with a mixture of experts: router_logits is the router's
logits, chosen_experts the model's own choice, routing_weights the weights it
gives the chosen experts, and `mlp.shared_experts.mlp_output` the shared
expert module's output, each within 1e-5 of what a torch hook on
transformers' module sees; an edit of router_logits that sends the last token
to another expert gives the logits of the same edit made in a hook on the
router (which re-runs the router's own forward on the edited logits); a dense
block's `mlp` says it has no router, as its support table does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import streamscope
from access import relative_error
from moe_oracle import MOE  # per family: the feed-forward, its router, where its output holds the logits, shared

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
RELATIVE = 1e-5

OVERRIDES = {"llama4_text": {"num_experts_per_tok": 2}}  # top-2, so the weights are not all one expert's


class Family:
    def __init__(self, name: str, path):
        self.name, self.spec = name, MOE[name]
        self.model = streamscope.load(path)
        self.reference = attention_oracle.reference_model(path)
        self.input_ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
        layers = self.reference.model.layers
        self.moe_blocks = [i for i, layer in enumerate(layers) if hasattr(self.feed_forward(i), "experts")]
        self.dense_blocks = [i for i in range(len(layers)) if i not in self.moe_blocks]
        assert self.moe_blocks

    def feed_forward(self, block: int) -> torch.nn.Module:
        return getattr(self.reference.model.layers[block], self.spec["mlp"])

    def router(self, block: int) -> torch.nn.Module:
        return getattr(self.feed_forward(block), self.spec["router"])

    def shape(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(*self.input_ids.shape, tensor.shape[-1])

    @torch.no_grad()
    def hooked(self, block: int) -> dict[str, torch.Tensor]:
        """What torch hooks see on block's router and shared expert, and the logits."""
        seen: dict[str, torch.Tensor] = {}
        router = self.router(block)

        def on_router(_, args, output):
            logits = output[self.spec["logits"]]
            seen["router_logits"] = self.shape(logits.clone())
            if self.name == "llama4_text":  # (scores, logits): the chosen experts' scores are the non-zero ones
                seen["scores"] = self.shape(output[0].clone())
            else:  # (logits, weights, experts)
                seen["routing_weights"] = self.shape(output[1].clone())
                seen["chosen_experts"] = self.shape(output[2].clone())

        handles = [router.register_forward_hook(on_router)]
        if self.spec["shared"]:
            shared = getattr(self.feed_forward(block), self.spec["shared"])
            handles.append(shared.register_forward_hook(
                lambda _, args, output: seen.__setitem__("shared", self.shape(output.clone()))))
        try:
            seen["logits"] = self.reference(self.input_ids).logits
        finally:
            for handle in handles:
                handle.remove()
        return seen

    @torch.no_grad()
    def logits_with_router_edit(self, block: int, edit) -> torch.Tensor:
        """The logits when `edit` changes block's router logits in a hook, the router's own forward re-run on them.

        The router's forward is run again with an identity projection in place of
        its weight, on the edited logits: transformers' own top-k, not a copy.
        """
        router = self.router(block)
        experts = router.weight.shape[0]
        stand_in = copy.deepcopy(router)
        stand_in.weight.data = torch.eye(experts)
        if hasattr(stand_in, "hidden_dim"):
            stand_in.hidden_dim = experts

        def on_router(_, args, output):
            logits = self.shape(output[self.spec["logits"]].clone())
            edit(logits)
            return stand_in.forward(logits.reshape(-1, experts))  # forward, not __call__: no hooks

        handle = router.register_forward_hook(on_router)
        try:
            return self.reference(self.input_ids).logits
        finally:
            handle.remove()


@pytest.fixture(scope="module", params=list(MOE))
def family(request, checkpoints):
    return Family(request.param, checkpoints(request.param, **OVERRIDES.get(request.param, {})))


def test_router_values_and_the_shared_expert_equal_the_hooks(family):
    model = family.model
    for block in family.moe_blocks:
        expected = family.hooked(block)
        shared, shared_first = None, family.name == "qwen3_next"  # read in the order the model computes
        with model.trace(PROMPT):
            mlp = model.layers[block].mlp
            if shared_first:
                shared = mlp.shared_experts.mlp_output.save()
            logits = mlp.router_logits.save()
            chosen = mlp.chosen_experts.save()
            weights = mlp.routing_weights.save()
            if family.spec["shared"] and not shared_first:
                shared = mlp.shared_experts.mlp_output.save()
            output = model.logits.save()
        assert logits.shape == (*family.input_ids.shape, family.router(block).weight.shape[0])
        assert relative_error(logits, expected["router_logits"]) <= RELATIVE, block
        top_k = family.router(block).top_k
        assert chosen.shape == weights.shape == (*family.input_ids.shape, top_k)
        assert chosen.dtype == torch.int64
        if family.name == "llama4_text":
            # The model's own choice: the experts its scores leave non-zero, weighted by those scores.
            chosen_mask = torch.zeros_like(expected["scores"], dtype=torch.bool).scatter_(-1, chosen, True)
            assert torch.equal(chosen_mask, expected["scores"] != 0), block
            assert relative_error(weights, expected["scores"].gather(-1, chosen)) <= RELATIVE, block
        else:
            assert torch.equal(chosen, expected["chosen_experts"]), block
            assert relative_error(weights, expected["routing_weights"]) <= RELATIVE, block
        if shared is not None:
            assert relative_error(shared, expected["shared"]) <= RELATIVE, block
        assert relative_error(output, expected["logits"]) <= RELATIVE


def test_an_edit_of_router_logits_reroutes_as_the_router_would(family):
    model, block = family.model, family.moe_blocks[-1]
    with model.trace(PROMPT):
        before = model.layers[block].mlp.router_logits.save()
    # Send the last token to the expert its router likes least, far ahead of the others.
    least = before[0, -1].argmin().item()
    boost = (before[0, -1].max() - before[0, -1].min()).item() + 5.0

    def edit(logits):
        logits[0, -1, least] += boost

    with model.trace(PROMPT):
        mlp = model.layers[block].mlp
        mlp.router_logits[0, -1, least] += boost
        logits = model.logits.save()
    with model.trace(PROMPT):
        plain = model.logits.save()
    expected = family.logits_with_router_edit(block, edit)
    assert not torch.allclose(expected, plain)
    assert relative_error(logits, expected) <= RELATIVE
    # The choice the model made is the edited one.
    with model.trace(PROMPT):
        mlp = model.layers[block].mlp
        mlp.router_logits[0, -1, least] += boost
        chosen = mlp.chosen_experts.save()
    assert chosen[0, -1, 0].item() == least


def test_an_edit_of_the_shared_experts_output_reaches_the_model(family):
    if not family.spec["shared"]:
        pytest.skip("no shared expert")
    model, block = family.model, family.moe_blocks[-1]
    vector = torch.linspace(-1.0, 1.0, model.hidden_size)
    with model.trace(PROMPT):
        model.layers[block].mlp.shared_experts.mlp_output[:, -1] += vector
        logits = model.logits.save()
    shared = getattr(family.feed_forward(block), family.spec["shared"])

    def add(_, args, output):
        family.shape(output)[:, -1] += vector

    handle = shared.register_forward_hook(add)
    try:
        with torch.no_grad():
            expected = family.reference(family.input_ids).logits
    finally:
        handle.remove()
    assert relative_error(logits, expected) <= RELATIVE


#: Prompts of other lengths for batched invokes (transformers pads them, on the left, into one batch).
INVOKE_PROMPTS = [PROMPT, "Rome is in Italy", "Attention heads move information between positions"]


def _routing_reads(family, block: int) -> dict:
    """Inside a trace or an invoke: the block's routing values and shared expert output, saved, in model order."""
    mlp = family.model.layers[block].mlp
    shared = family.spec["shared"] is not None
    reads = {}
    if shared and family.name == "qwen3_next":  # its shared expert runs before its router
        reads["shared"] = mlp.shared_experts.mlp_output.save()
    for name in ("router_logits", "chosen_experts", "routing_weights"):
        reads[name] = getattr(mlp, name).save()
    if shared and family.name != "qwen3_next":
        reads["shared"] = mlp.shared_experts.mlp_output.save()
    return reads


def _routing_edits(family, block: int, least: int, boost: float, vector: torch.Tensor) -> None:
    """Inside a trace or an invoke: send the last token to expert `least`, and add `vector` to the shared
    expert's output there, in model order."""
    mlp = family.model.layers[block].mlp
    shared = family.spec["shared"] is not None
    if shared and family.name == "qwen3_next":
        mlp.shared_experts.mlp_output[:, -1] += vector
    mlp.router_logits[0, -1, least] += boost
    if shared and family.name != "qwen3_next":
        mlp.shared_experts.mlp_output[:, -1] += vector


def test_each_invoke_of_a_batch_reads_and_edits_its_own_tokens_only(family):
    """The router (and the shared expert) work on the block's tokens flattened to [batch * seq, ...], which
    nnsight cannot narrow to an invoke's rows. Each invoke of a batched trace must still read its own tokens
    ([1, seq, ...], seq the batch's padded length; its own tokens the last ones), equal to its solo run's, and
    its edits must give it its solo run's logits, leaving the other invokes' alone."""
    model, block = family.model, family.moe_blocks[-1]
    solo = []
    for prompt in INVOKE_PROMPTS:
        with model.trace(prompt):
            solo.append(_routing_reads(family, block))
    batched = []
    with model.trace() as tracer:
        for prompt in INVOKE_PROMPTS:
            with tracer.invoke(prompt):
                batched.append(_routing_reads(family, block))
    width = max(alone["router_logits"].shape[1] for alone in solo)
    for alone, together in zip(solo, batched):
        length = alone["router_logits"].shape[1]
        for name, value in together.items():
            assert value.shape == (1, width, *alone[name].shape[2:]), (name, value.shape)
            own = value[:, -length:]
            if name == "chosen_experts":
                assert torch.equal(own, alone[name]), name
            else:
                assert relative_error(own, alone[name]) <= RELATIVE, name

    # Each invoke sends its last token to the expert its router likes least (and adds its own vector to the
    # shared expert's output there).
    edits = []
    for alone, scale in zip(solo, (1.0, -2.0, 0.5)):
        logits = alone["router_logits"][0, -1]
        boost = (logits.max() - logits.min()).item() + 5.0
        edits.append((logits.argmin().item(), boost, torch.linspace(-1.0, 1.0, model.hidden_size) * scale))
    expected, plain = [], []
    for prompt, edit in zip(INVOKE_PROMPTS, edits):
        with model.trace(prompt):
            _routing_edits(family, block, *edit)
            expected.append(model.logits[0, -1].save())
        with model.trace(prompt):
            plain.append(model.logits[0, -1].save())
    edited = []
    with model.trace() as tracer:
        for prompt, edit in zip(INVOKE_PROMPTS, edits):
            with tracer.invoke(prompt):
                _routing_edits(family, block, *edit)
                edited.append(model.logits[0, -1].save())
    for together, alone, unedited in zip(edited, expected, plain):
        assert not torch.allclose(alone, unedited)
        assert relative_error(together, alone) <= RELATIVE


def test_dense_blocks_have_no_router_and_support_lists_the_values(family):
    model = family.model
    support = model.support()
    for block in family.moe_blocks:
        rows = support[block].rows
        for name in ("router_logits", "chosen_experts", "routing_weights", "mlp_output"):
            assert rows[f"mlp.{name}"] is None, (block, name)
        if family.spec["shared"]:
            assert rows["mlp.shared_experts.mlp_output"] is None
        keys = list(rows)
        assert keys.index("mlp_input") < keys.index("mlp.router_logits") < keys.index("mlp.mlp_output") \
            < keys.index("layer_output")
    for block in family.dense_blocks:
        rows = support[block].rows
        with pytest.raises(streamscope.Unavailable) as raised:
            with model.trace(PROMPT):
                model.layers[block].mlp.router_logits.save()
        assert raised.value.reason == "a dense MLP: no router" == rows["mlp.router_logits"]
        assert "mlp.shared_experts.mlp_output" not in rows


def test_recomputed_routing_values_refuse_an_edit(family):
    if family.name != "llama4_text":
        pytest.skip("the router's own outputs: editable")
    with pytest.raises(ValueError, match="cannot be written"):
        with family.model.trace(PROMPT):
            family.model.layers[family.moe_blocks[0]].mlp.chosen_experts[:] = 0


def test_a_dense_family_reports_no_router(checkpoints):
    model = streamscope.load(checkpoints("llama"))
    rows = model.support()[0].rows
    assert rows["mlp.router_logits"] == rows["mlp.chosen_experts"] == "a dense MLP: no router"
