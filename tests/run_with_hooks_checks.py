"""Checks of `model.run_with_hooks` and `model.run_with_cache` shared by both engines' tests (issue 41).

The oracle is transformers' own float32 forward of each prompt alone, edited with plain torch hooks at the
modules where transformers computes each value (`oracle.py`'s map; the head's slice of the output projection's
input, `attention_oracle.py`), and torch's ``cross_entropy`` for the loss. A batch of prompts of different lengths
runs at once: every real position of each prompt must equal that prompt's run alone, padding read as nothing.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

import attention_oracle
import oracle
from access import difference_tolerance, relative_error
from streamscope.errors import Unavailable

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
SCALE = 0.5  # blocks.1.hook_resid_pre is scaled by this
HEAD = 1  # blocks.0.attn.hook_z's head that is zeroed


class Pair:
    """A streamscope model and transformers' float32 model of the same checkpoint, and each prompt's ids."""

    def __init__(self, family: str, model, reference, tokenizer, tolerance: float) -> None:
        self.family, self.model, self.reference, self.tolerance = family, model, reference, tolerance
        self.ids = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        assert len({ids.shape[1] for ids in self.ids}) == 2  # two lengths: the batch is padded
        generator = torch.Generator().manual_seed(0)
        self.vector = torch.randn(model.hidden_size, generator=generator)

    def hooks(self) -> list:
        """Three edits, each position-independent (so padding cannot move them): a TransformerLens name whose
        hook returns a new tensor, a streamscope name edited in place, a TL head value (TL's layout) in place."""
        vector = self.vector

        def add(value, hook):
            value += vector

        def zero_head(z, hook):
            assert z.shape[-2] == self.model.num_heads  # TL's [batch, pos, head, d_head]
            z[:, :, HEAD] = 0

        return [("blocks.1.hook_resid_pre", lambda resid, hook: resid * SCALE), ("layers.0.mlp_output", add),
                ("blocks.0.attn.hook_z", zero_head)]

    @contextmanager
    def oracle_edits(self) -> Iterator[None]:
        """The same three edits on the transformers model, with torch hooks."""
        model, family = self.reference, self.family
        with ExitStack() as stack:
            def scale(stream: torch.Tensor) -> None:
                stream.mul_(SCALE)

            def shift(stream: torch.Tensor) -> None:
                stream.add_(self.vector)

            for name, block, edit in (("layer_input", 1, scale), ("mlp_output", 0, shift)):
                module, where, factor = oracle.site(model, family, name, block)
                assert factor is None
                stack.enter_context(oracle.hooked(module, where, edit))
            head_dim = self.model.head_dim

            def zero(_, args):
                args[0][..., HEAD * head_dim:(HEAD + 1) * head_dim] = 0

            projection = attention_oracle.output_projection(attention_oracle.attention_modules(model)[0])
            stack.callback(projection.register_forward_pre_hook(zero).remove)
            yield

    @torch.no_grad()
    def oracle_logits(self, edited: bool) -> list[torch.Tensor]:
        """Each prompt's logits alone, ``[seq, vocab]``, with or without the edits."""
        with ExitStack() as stack:
            if edited:
                stack.enter_context(self.oracle_edits())
            return [self.reference(ids).logits[0] for ids in self.ids]


def _each_prompt(pair: Pair, logits: torch.Tensor, expected: list[torch.Tensor]) -> None:
    """Left-padded ``[batch, seq, vocab]`` logits against each prompt's alone; padding is zeros."""
    longest = logits.shape[1]
    assert logits.shape[0] == len(expected)
    for row, reference in enumerate(expected):
        start = longest - reference.shape[0]
        assert relative_error(logits[row, start:], reference) <= pair.tolerance, row
        assert not logits[row, :start].any()


def edits_reach_the_model(pair: Pair, **run) -> None:
    edited = pair.oracle_logits(edited=True)
    unedited = pair.oracle_logits(edited=False)
    assert relative_error(edited[0], unedited[0]) > 1e-2  # the edits change the answer
    _each_prompt(pair, pair.model.run_with_hooks(PROMPTS, fwd_hooks=pair.hooks(), **run), edited)
    _each_prompt(pair, pair.model.run_with_hooks(PROMPTS, **run), unedited)


def _cross_entropy(expected: list[torch.Tensor], ids: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.cross_entropy(logits[:-1], tokens[0, 1:], reduction="none") for logits, tokens in zip(expected, ids)]


def loss_is_tl_cross_entropy(pair: Pair) -> None:
    """TL's loss: the mean over every real next-token prediction of the batch; per token ``[batch, seq - 1]``."""
    expected_logits = pair.oracle_logits(edited=True)
    per_prompt = _cross_entropy(expected_logits, pair.ids)
    expected = torch.cat(per_prompt).mean()
    # Each log-probability is a logit minus a logsumexp, each off by at most the logits' error: twice it.
    bound = max(difference_tolerance(logits, pair.tolerance) for logits in expected_logits)
    loss = pair.model.run_with_hooks(PROMPTS, fwd_hooks=pair.hooks(), return_type="loss")
    assert loss.dim() == 0 and abs(float(loss) - float(expected)) <= bound
    logits, both = pair.model.run_with_hooks(PROMPTS, fwd_hooks=pair.hooks(), return_type="both")
    assert torch.equal(both, loss)
    _each_prompt(pair, logits, expected_logits)
    tokens = pair.model.run_with_hooks(PROMPTS, fwd_hooks=pair.hooks(), return_type="loss", loss_per_token=True)
    longest = max(ids.shape[1] for ids in pair.ids)
    assert tokens.shape == (len(PROMPTS), longest - 1)
    for row, reference in enumerate(per_prompt):
        start = longest - 1 - reference.shape[0]
        assert (tokens[row, start:] - reference).abs().max() <= bound, row
        assert not tokens[row, :start].any()  # a prediction of or from padding counts as nothing
    assert pair.model.run_with_hooks(PROMPTS, fwd_hooks=pair.hooks(), return_type=None) is None


def filters_names_and_layouts(pair: Pair, in_process: bool) -> None:
    """A filter over TL names edits every value it matches, ``hook.name``/``hook.layer()`` say which, and a TL
    per-head layout is edited by a returned tensor. `in_process`: the hook functions run in this process (a
    transformers run), so what they record stays (a vLLM worker runs a copy of them)."""
    model = pair.model

    def grown(value, hook):  # each block's output scaled by its own factor: the filter must reach every one
        return value * (1 + 0.1 * hook.layer())

    logits = model.run_with_hooks(PROMPTS[0], fwd_hooks=[(lambda name: name.endswith("hook_resid_post"), grown)])
    def scaled(block: int):
        def scale(stream: torch.Tensor) -> None:
            stream.mul_(1 + 0.1 * block)
        return scale

    with ExitStack() as stack:
        for block in range(model.num_layers):
            module, where, factor = oracle.site(pair.reference, pair.family, "layer_output", block)
            assert factor is None
            stack.enter_context(oracle.hooked(module, where, scaled(block)))
        with torch.no_grad():
            expected = pair.reference(pair.ids[0]).logits
    assert relative_error(logits[0], expected[0]) <= pair.tolerance
    if in_process:
        seen: list = []
        model.run_with_hooks(PROMPTS[0], fwd_hooks=[(lambda name: name.endswith("hook_resid_post"),
                                                     lambda value, hook: seen.append((hook.name, value.clone())))])
        alone = oracle.values(pair.reference, pair.family, pair.ids[0])
        assert [name for name, _ in seen] == [f"blocks.{i}.hook_resid_post" for i in range(model.num_layers)]
        for block, (name, value) in enumerate(seen):
            assert relative_error(value, alone["layer_output"][block]) <= pair.tolerance, name

    def doubled(q, hook):  # TL's [batch, pos, head, d_head]: head 0's queries doubled, returned
        q = q.clone()
        q[:, :, 0] *= 2
        return q

    def oracle_doubled(query):  # the kernel's [batch, head, seq, d]
        query[:, 0] *= 2

    logits = model.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.0.attn.hook_rot_q", doubled)])
    expected = attention_oracle.logits_with_query_edit(pair.reference, pair.family, pair.ids[0], 0, oracle_doubled)
    assert relative_error(expected, pair.oracle_logits(edited=False)[0]) > 1e-3
    assert relative_error(logits[0], expected[0]) <= pair.tolerance


def refusals_name_the_fix(pair: Pair) -> None:
    """Bad names, computed TL hooks, a hook of the wrong shape and TL arguments not taken are refused with the
    fix; the model serves the next run."""
    model = pair.model
    with pytest.raises(ValueError, match="neither a TransformerLens hook name"):
        model.run_with_hooks(PROMPTS[0], fwd_hooks=[("resid_pre", lambda v, h: None)])
    with pytest.raises(ValueError, match="computed from other values.*hook the value it is computed from"):
        model.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.0.attn.hook_result", lambda v, h: None)])
    with pytest.raises(Unavailable, match="hook_pre_linear"):
        model.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.0.mlp.hook_pre_linear", lambda v, h: None)])
    with pytest.raises(ValueError, match="out of range"):
        model.run_with_hooks(PROMPTS[0], fwd_hooks=[(f"blocks.{model.num_layers}.hook_resid_pre", lambda v, h: None)])
    with pytest.raises(ValueError, match="return_type"):
        model.run_with_hooks(PROMPTS[0], return_type="probs")
    with pytest.raises(ValueError, match="bwd_hooks.*loss.backward"):
        model.run_with_hooks(PROMPTS[0], bwd_hooks=[("blocks.0.hook_resid_pre", lambda v, h: None)])
    with pytest.raises(ValueError, match=r"returned \(3,\).*tensor of the value's shape"):
        model.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.0.hook_resid_pre", lambda v, h: torch.zeros(3))])
    with pytest.raises(TypeError, match="wrap the one pair in a list"):
        model.run_with_hooks(PROMPTS[0], fwd_hooks=("blocks.0.hook_resid_pre", lambda v, h: None))
    expected = pair.oracle_logits(edited=False)[0]
    assert relative_error(model.run_with_hooks(PROMPTS[0])[0], expected) <= pair.tolerance


def run_with_cache_as_tl(pair: Pair) -> None:
    """``(logits, cache)``: the run's logits (whole, whatever pos_slice keeps in the cache) and its cache."""
    model = pair.model
    logits, cache = model.run_with_cache(PROMPTS)
    assert torch.equal(logits, cache.logits)
    _each_prompt(pair, logits, pair.oracle_logits(edited=False))
    loss, _ = model.run_with_cache(PROMPTS, return_type="loss", values=["layer_output"])
    expected = torch.cat(_cross_entropy(pair.oracle_logits(edited=False), pair.ids)).mean()
    assert abs(float(loss) - float(expected)) <= difference_tolerance(logits, pair.tolerance)
    whole, sliced = model.run_with_cache(PROMPTS[0], pos_slice=-1, remove_batch_dim=True, values=["layer_output"])
    assert whole.shape[:2] == (1, pair.ids[0].shape[1])
    alone = oracle.values(pair.reference, pair.family, pair.ids[0])
    assert sliced["blocks.1.hook_resid_post"].shape == (1, model.hidden_size)
    assert relative_error(sliced["blocks.1.hook_resid_post"], alone["layer_output"][1][0, -1:]) <= pair.tolerance
    with pytest.raises(ValueError, match="remove_batch_dim=True needs one prompt"):
        model.run_with_cache(PROMPTS, remove_batch_dim=True)
    _, plain = model.run_with_cache(PROMPTS[0], return_type=None, return_cache_object=False, values=["layer_output"])
    assert isinstance(plain, dict) and "blocks.0.hook_resid_post" in plain
