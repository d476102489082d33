"""Gradients by name on transformers (issue 38, item 12): ``value.grad`` inside ``with loss.backward():`` for every
named value that is a tensor of the model's graph, read and edited; the values nothing in the model holds refuse
with the reason, and the model serves the next trace.

The oracle is plain torch autograd on transformers' own float32 forward: the tensors each value is read at
(`oracle.py`'s map, `attention_oracle.py`'s kernel call) caught with torch hooks that retain their gradients, the
same loss, one ``loss.backward()``. Gradients are asked for in the order that backward computed them (recorded
by hooks on the oracle's tensors), as nnsight requires.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Optional

import nnsight
import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import matrix
import oracle
from access import relative_error
import streamscope
from streamscope.nnsight_seam import OutOfOrderError

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
#: float32 on CPU, the same ops on the same model: the gradients agree to rounding.
RELATIVE = 1e-6
#: One of each block layout: pre-norm, GPT-2, parallel (GPT-J, Cohere), sandwich-norm, post-LN, a scaled residual.
CASES = {"llama": ("llama", {}), "gpt2": ("gpt2", {}), "gptj": ("gptj", {}), "cohere": ("cohere", {}),
         "gemma2": ("gemma2", {}), "opt-post-ln": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
         "granite": ("granite", {})}
#: What has no gradient in the graph (computed for the read), or is not differentiable (expert ids).
NO_GRADIENT = {"prompt_logits", "self_attn.scores", "self_attn.head_results", "mlp.chosen_experts"}
ORACLE_NAMES = {"attention_output": "self_attn.attention_output", "mlp_output": "mlp.mlp_output",
                **{name: f"mlp.{name}" for name in oracle.NEURONS}}

Key = tuple[str, Optional[int]]


class Case:
    def __init__(self, family: str, path):
        self.family = family
        self.model = streamscope.load(path)
        self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.ids = self.tokenizer(PROMPT, return_tensors="pt").input_ids
        plan = matrix.plan(self.model, matrix.Reference(
            path, family, self.ids, implementation=attention_oracle.exact_implementation(family)),
            "final_norm_output")
        self.eager = self.reference.config._attn_implementation == "eager"
        self.steps = [step for step in plan if step[0] not in NO_GRADIENT
                      and (step[0] != "self_attn.pattern" or self.eager)]
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.randn(self.ids.shape[1], self.model.vocab_size, generator=generator)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, checkpoints):
    family, overrides = CASES[request.param]
    return Case(family, checkpoints(family, **overrides))


def loss_of(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A fixed random projection of every position's logits: every value before them gets a gradient."""
    return (logits[0] * weights).sum()


def oracle_gradients(case: Case, ids: torch.Tensor, weights: torch.Tensor,
                     edits: Optional[dict[Key, Callable]] = None) -> tuple[dict[Key, torch.Tensor], list[Key]]:
    """Plain torch autograd: each value's gradient (in the value's layout) and the order backward computed them.

    `edits` replace a value's gradient as it flows (a tensor hook returning the edited one)."""
    model, family = case.reference, case.family
    kept: dict[Key, tuple[torch.Tensor, Optional[float]]] = {}
    fired: list[Key] = []

    def keep(key: Key, tensor: torch.Tensor, factor: Optional[float] = None) -> None:
        if key in kept or not tensor.requires_grad:
            return
        if edits and key in edits:
            tensor.register_hook(edits[key])
        tensor.register_hook(lambda grad, key=key: fired.append(key))
        tensor.retain_grad()
        kept[key] = (tensor, factor)

    def catch(block, kernel, before, query, key, value, *rest, **kwargs):
        output = attention_oracle._call(kernel, before, query, key, value, *rest, **kwargs)
        attended = output[0] if isinstance(output, tuple) else output
        for name, tensor in (("queries", query), ("keys", key), ("values", value), ("head_outputs", attended)):
            keep((f"self_attn.{name}", block), tensor)
        if case.eager and isinstance(output, tuple) and isinstance(output[1], torch.Tensor):
            keep(("self_attn.pattern", block), output[1])
        return output

    with ExitStack() as stack:
        for name in ("token_embeddings", "final_norm_output"):
            located = oracle.site(model, family, name)
            if located is not None:
                stack.enter_context(oracle.hooked(located[0], located[1],
                                                  lambda t, name=name, f=located[2]: keep((name, None), t, f)))
        for block in range(oracle.num_layers(model, family)):
            for name in (*oracle.BOUNDARIES, *oracle.CONTRIBUTIONS, *oracle.NEURONS):
                located = oracle.site(model, family, name, block)
                if located is not None:
                    key = (ORACLE_NAMES.get(name, name), block)
                    stack.enter_context(oracle.hooked(located[0], located[1],
                                                      lambda t, key=key, f=located[2]: keep(key, t, f)))
        stack.enter_context(attention_oracle.kernel_wrapped(model, family, catch))
        logits = model(ids).logits
    keep(("logits", None), logits)
    loss_of(logits, weights).backward()
    gradients = {}
    for (name, block), (tensor, factor) in kept.items():
        grad = tensor.grad
        if name == "self_attn.head_outputs" and family in attention_oracle.HEADS_FIRST:
            grad = grad.transpose(1, 2)
        elif grad.dim() == 2:  # a block that flattens its tokens (OPT's MLP)
            grad = grad.reshape(*ids.shape, grad.shape[-1])
        gradients[(name, block)] = grad / factor if factor is not None else grad
    return gradients, list(dict.fromkeys(fired))


def test_every_named_value_has_the_gradient_torch_autograd_computes(case):
    expected, fired = oracle_gradients(case, case.ids, case.weights)
    steps = [step for step in case.steps if step in expected]
    wanted = [key for key in fired if key in steps]
    assert len(wanted) == len(steps) and len(steps) >= 10, (steps, fired)
    model = case.model
    with model.trace(PROMPT):
        served = {step: matrix.reach(model, *step) for step in steps}
        loss = loss_of(model.logits, case.weights)
        with loss.backward():
            gradients = nnsight.save({key: served[key].grad for key in wanted})
    for key in steps:
        assert gradients[key].shape == expected[key].shape, key
        assert relative_error(gradients[key], expected[key]) <= RELATIVE, key


def test_an_edited_gradient_reaches_the_upstream_gradients(case):
    """An assignment of one value's gradient, and an in-place edit of another's, flow on to every earlier value."""
    last = case.model.num_layers - 1
    assigned, edited = ("layer_output", last - 1), ("layer_input", 1)
    scale = torch.linspace(-2.0, 3.0, case.ids.shape[1])[None, :, None]

    def last_zeroed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[:, -1] = 0
        return grad

    expected, fired = oracle_gradients(case, case.ids, case.weights,
                                       edits={assigned: lambda grad: grad * scale, edited: last_zeroed})
    upstream = [key for key in (("layer_mid", 0), ("self_attn.queries", 0), ("token_embeddings", None),
                                ("layer_input", 0)) if key in expected and key in case.steps]
    order = [key for key in fired if key in (assigned, edited, *upstream)]
    model = case.model
    with model.trace(PROMPT):
        served = {key: matrix.reach(model, *key) for key in case.steps}
        loss = loss_of(model.logits, case.weights)
        with loss.backward():
            gradients = {}
            for key in order:
                if key == assigned:
                    served[key].grad = served[key].grad * scale
                elif key == edited:
                    gradient = served[key].grad
                    gradient[:, -1] = 0
                else:
                    gradients[key] = served[key].grad
            nnsight.save(gradients)
    assert upstream and sorted(gradients, key=str) == sorted(upstream, key=str)
    unedited, _ = oracle_gradients(case, case.ids, case.weights)
    for key in upstream:
        assert relative_error(gradients[key], expected[key]) <= RELATIVE, key
        assert relative_error(gradients[key], unedited[key]) > 1e-3, key  # the edit changed it


def test_each_invoke_of_a_batched_trace_gets_its_own_rows_gradient(case):
    # Two prompts of one length (the first's tokens reversed), so the batch has no padding on any tokenizer.
    first = case.tokenizer(PROMPT, return_tensors="pt").input_ids
    second = first.flip(1)
    assert not torch.equal(first, second)
    weights = case.weights[: second.shape[1]]
    expected, _ = oracle_gradients(case, second, weights)
    model = case.model
    with model.trace() as tracer:
        with tracer.invoke(first):
            model.layers[1].layer_output.save()
        with tracer.invoke(second):
            embedded = model.token_embeddings
            middle = model.layers[1].layer_output
            loss = loss_of(model.logits, weights)
            with loss.backward():
                gradient = middle.grad.save()
                embedded_gradient = embedded.grad.save()
    assert gradient.shape == expected[("layer_output", 1)].shape
    assert relative_error(gradient, expected[("layer_output", 1)]) <= RELATIVE
    assert relative_error(embedded_gradient, expected[("token_embeddings", None)]) <= RELATIVE


def refused(model, read: Callable, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        with model.trace(PROMPT):
            value = read(model)
            loss = model.logits.sum()
            with loss.backward():
                value.grad.save()


def test_values_nothing_in_the_model_holds_refuse_their_gradient_with_the_reason(case):
    model = case.model
    refused(model, lambda m: m.prompt_logits, r"copy of model\.logits.*model\.logits\.grad")
    if not case.eager:
        refused(model, lambda m: m.layers[0].self_attn.pattern, r"recomputed.*queries.*attn_implementation")
    refused(model, lambda m: m.layers[0].self_attn.scores, "recomputed from the queries and keys")
    if "self_attn.head_results" in dict(model.support()[0].rows):
        refused(model, lambda m: m.layers[0].self_attn.head_results, "head_outputs")
    # The model serves the next trace, gradients and all.
    with model.trace(PROMPT):
        output = model.layers[1].layer_output
        loss = loss_of(model.logits, case.weights)
        with loss.backward():
            gradient = output.grad.save()
    expected, _ = oracle_gradients(case, case.ids, case.weights)
    assert relative_error(gradient, expected[("layer_output", 1)]) <= RELATIVE


def test_a_gradient_the_backward_never_computes_is_named(case):
    model = case.model
    with pytest.raises(OutOfOrderError, match=r"model\.layers\[1\]\.layer_output\.grad never came.*loss does not depend"):
        with model.trace(PROMPT):
            early = model.layers[0].layer_output
            later = model.layers[1].layer_output
            loss = early.sum()
            with loss.backward():
                early.grad.save()
                later.grad.save()
