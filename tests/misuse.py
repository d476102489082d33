"""Misuse, as a demanding new user commits it: one table of cases, run on both engines.

Each case is a function that misuses a model (a `Runner`: the model and how a
trace is opened on its engine) and the exception it must raise, the same type
on both engines, with the words its message must hold: the value by
streamscope's name (``model.layers[1].layer_mid``, never a module path) and the
fix. `tests/transformers/test_misuse.py` and `tests/vllm/test_misuse.py` run
the whole table against their engine and check, after every case, that the
model still gives its baseline results.
"""

from __future__ import annotations

import pickle
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError

import streamscope
from streamscope.blocks.envoy import NoSuchName
from access import relative_error

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
#: Module paths that must not appear in a message instead of streamscope's names.
MODULE_PATH = re.compile(r"model\.model\.|post_attention_layernorm\.input|\.output\.i\d")


class Runner:
    """A model and how a trace is opened on its engine (vLLM: greedy, one token)."""

    def __init__(self, engine: str, model: Any) -> None:
        self.engine, self.model = engine, model
        self.sampling = {"temperature": 0.0, "max_tokens": 1} if engine == "vllm" else {}
        #: How close a repeated run's logits are on this engine: bit-equal on transformers; vLLM on CPU
        #: float32 is deterministic for the same batch, held to 1e-6 relative (its own tolerance on GPU).
        self.tolerance = 0.0 if engine == "transformers" else 1e-6

    def trace(self, prompt: Any = PROMPT, **kwargs: Any) -> Any:
        return self.model.trace(prompt, **{**self.sampling, **kwargs})

    def baseline(self) -> dict[str, torch.Tensor]:
        """What an untouched run gives: block 1's layer_mid and the logits."""
        model = self.model
        with self.trace():
            mid = model.layers[1].layer_mid.save()
            logits = model.logits.save()
        return {"mid": mid, "logits": logits}

    def assert_unchanged(self, baseline: dict[str, torch.Tensor]) -> None:
        now = self.baseline()
        for name, value in baseline.items():
            assert relative_error(now[name], value) <= self.tolerance, name
        if self.tolerance == 0.0:
            assert all(torch.equal(now[name], value) for name, value in baseline.items())


@dataclass
class Case:
    """One misuse: what it does, the exception it must raise and the words its message must hold."""

    run: Callable[[Runner], Any]
    raises: type
    says: tuple[str, ...]


def check(case: Case, runner: Runner) -> BaseException:
    """Run `case` on `runner`: it raises the case's type, its message says what the case says."""
    with pytest.raises(BaseException) as raised:
        case.run(runner)
    error = raised.value
    assert type(error) is case.raises, f"{type(error).__name__}: {error}"
    text = str(error)
    for words in case.says:
        assert words in text, f"{words!r} not in {text!r}"
    assert not MODULE_PATH.search(text), text
    return error


# The cases. Each opens its own trace; the model is `runner.model`, bound to a local name so the trace's
# body reads as a user writes it.


def wrong_shape(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.layers[1].layer_mid = torch.zeros(1, 2, model.hidden_size)
        model.logits.save()


def not_a_tensor(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.layers[1].layer_mid = [0.0, 1.0]
        model.logits.save()


def bool_tensor(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        shape = model.layers[1].layer_mid.shape
        model.layers[1].layer_mid = torch.ones(shape, dtype=torch.bool)
        model.logits.save()


def meta_tensor(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        shape = model.layers[1].layer_mid.shape
        model.layers[1].layer_mid = torch.zeros(shape, device="meta")
        model.logits.save()


def wrong_width_in_place(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.layers[1].layer_mid[:, -1] += torch.ones(model.hidden_size // 2)
        model.logits.save()


def out_of_order(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.layers[1].layer_output.save()
        model.layers[0].layer_output.save()


def skip_after_the_block_ran(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        output = model.layers[1].layer_output.save()
        model.layers[1].skip(torch.zeros_like(output))


def late_in_place_edit(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        mid = model.layers[0].layer_mid
        model.layers[1].layer_output.save()
        mid[:, -1] = 0.0
        model.logits.save()


def saved_read_edited_after_reading_it_again(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        mid = model.layers[1].layer_mid.save()
        model.layers[1].layer_mid.save()  # a second read gets its own copy: the first keeps what was read
        mid[:, -1] += 1.0
        model.logits.save()


def prompt_logits_edited(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.prompt_logits[:, -1] = 0.0
        model.logits.save()


def block_out_of_range(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.layers[99].layer_output.save()


def negative_block_out_of_range(runner: Runner) -> None:
    runner.model.layers[-100]


def typo(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.layers[1].layer_ouput.save()


def typo_outside_a_trace(runner: Runner) -> None:
    runner.model.layers[1].self_attn.patern


def save_outside_a_trace(runner: Runner) -> None:
    runner.model.layers[1].layer_mid.save()


def write_outside_a_trace(runner: Runner) -> None:
    runner.model.layers[1].layer_mid = torch.zeros(1, 1, runner.model.hidden_size)


def token_ids_beyond_the_vocabulary(runner: Runner) -> None:
    model = runner.model
    ids = [1, 2, model.vocab_size + 7]
    with runner.trace(torch.tensor([ids]) if runner.engine == "transformers" else ids):
        model.logits.save()


def unavailable_value(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.layers[1].mlp.router_logits.save()


def skip_of_the_wrong_shape(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        model.layers[1].skip(torch.zeros(1, 2, model.hidden_size))
        model.logits.save()


def users_key_error(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        table = {"layer_mid": model.layers[1].layer_mid}
        table["layer_ouput"].save()


class ProbeFailed(Exception):
    """A user's own exception class."""


def users_own_exception(runner: Runner) -> None:
    model = runner.model
    with runner.trace():
        mid = model.layers[1].layer_mid
        if mid.abs().max() > 0:
            raise ProbeFailed("the probe found nothing at model.layers[1].layer_mid")


CASES: dict[str, Case] = {
    "wrong shape": Case(wrong_shape, ValueError, ("model.layers[1].layer_mid", "Write a tensor of that shape")),
    "not a tensor": Case(not_a_tensor, TypeError, ("model.layers[1].layer_mid", "not a list", "edit in place")),
    "bool tensor": Case(bool_tensor, TypeError, ("model.layers[1].layer_mid", "torch.bool", "mask.float()")),
    "meta tensor": Case(meta_tensor, ValueError, ("model.layers[1].layer_mid", "meta tensor", "model's device")),
    "wrong width in place": Case(wrong_width_in_place, RuntimeError,
                                 ("model.layers[1].layer_mid", "does not fit", "[:, -1] += vector")),
    "out of order": Case(out_of_order, OutOfOrderError,
                         ("model.layers[0].layer_output was read after model.layers[1].layer_output",
                          "model.support() lists each block's values in that order")),
    "skip after the block ran": Case(skip_after_the_block_ran, OutOfOrderError,
                                     ("model.layers[1].skip()", "model.layers[1].layer_output",
                                      "skip a block before reading any of its values")),
    "late in-place edit": Case(late_in_place_edit, OutOfOrderError,
                               ("model.layers[0].layer_mid was edited in place", "model.layers[1].layer_output",
                                "Make the edit before reading anything later", ".clone()")),
    "saved read edited after reading it again": Case(
        saved_read_edited_after_reading_it_again, OutOfOrderError,
        ("model.layers[1].layer_mid was edited in place", "Make the edit before reading anything later")),
    "prompt_logits edited": Case(prompt_logits_edited, ValueError, ("model.prompt_logits", "edit")),
    "block out of range": Case(block_out_of_range, IndexError,
                               ("model.layers[99] is out of range", "model.layers[0] to model.layers[2]")),
    "negative block out of range": Case(negative_block_out_of_range, IndexError,
                                        ("model.layers[-100] is out of range", "model.layers[-3] to")),
    "typo": Case(typo, NoSuchName, ("model.layers[1]", "'layer_ouput'", "Did you mean layer_output")),
    "typo outside a trace": Case(typo_outside_a_trace, NoSuchName,
                                 ("model.layers[1].self_attn", "'patern'", "Did you mean pattern")),
    "save outside a trace": Case(save_outside_a_trace, ValueError,
                                 ("model.layers[1].layer_mid can only be read inside a trace", "model.trace(")),
    "write outside a trace": Case(write_outside_a_trace, ValueError,
                                  ("model.layers[1].layer_mid can only be written inside a trace",)),
    "token ids beyond the vocabulary": Case(token_ids_beyond_the_vocabulary, ValueError,
                                            ("outside this model's vocabulary", "model.tokenizer")),
    "unavailable value": Case(unavailable_value, streamscope.Unavailable,
                              ("model.layers[1].mlp.router_logits is unavailable",)),
    "skip of the wrong shape": Case(skip_of_the_wrong_shape, ValueError, ("model.layers[1].skip",)),
    "user's KeyError": Case(users_key_error, KeyError, ("'layer_ouput'",)),
    "user's own exception": Case(users_own_exception, ProbeFailed, ("the probe found nothing",)),
}


# The tests both engines run: each engine's test module defines the `runner` fixture (one model for the
# module) and the `baseline` fixture (its untouched results), and imports these.


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_raises_a_clear_error_and_leaves_the_model_as_it_was(runner, baseline, name):
    check(CASES[name], runner)
    runner.assert_unchanged(baseline)


def test_a_probe_for_a_missing_name_writes_no_message(runner, monkeypatch):
    """``hasattr`` and ``getattr(..., default)`` on an envoy (nnsight's alias binding probes every envoy it builds)
    catch the error unread: its message, a search for the nearest names, is written only when read."""
    from streamscope.blocks import envoy

    def unread(*args):
        raise AssertionError("the message of a probed name was written")

    block = runner.model.layers[1]
    with monkeypatch.context() as patched:
        patched.setattr(envoy, "no_such_name", unread)
        assert not hasattr(block, "layer_ouput") and getattr(block.self_attn, "patern", None) is None
    with pytest.raises(NoSuchName, match="Did you mean layer_output") as raised:
        block.layer_ouput
    crossed = pickle.loads(pickle.dumps(raised.value))  # as a worker's error reaches the client
    assert type(crossed) is NoSuchName and str(crossed) == str(raised.value)


def test_a_users_key_error_keeps_its_key(runner, baseline):
    error = check(CASES["user's KeyError"], runner)
    assert error.args == ("layer_ouput",)


def test_saving_a_read_then_assigning_keeps_the_saved_copy(runner, baseline):
    model = runner.model
    with runner.trace():
        clean = model.layers[1].layer_mid.save()
        model.layers[1].layer_mid = torch.zeros_like(clean)
        patched = model.logits.save()
    with runner.trace():
        model.layers[1].layer_mid[:] = 0.0
        zeroed = model.logits.save()
    assert torch.equal(clean, baseline["mid"])
    assert torch.equal(patched, zeroed)
    assert not torch.equal(patched, baseline["logits"])
    runner.assert_unchanged(baseline)


def test_saving_a_read_then_editing_it_by_name_keeps_the_saved_copy(runner, baseline):
    model = runner.model
    with runner.trace():
        clean = model.layers[1].layer_mid.save()
        model.layers[1].layer_mid[:, -1] += 1.0
        again = model.layers[1].layer_mid.save()
        steered = model.logits.save()
    with runner.trace():
        model.layers[1].layer_mid[:, -1] += 1.0
        expected = model.logits.save()
    assert torch.equal(clean, baseline["mid"])
    assert torch.equal(again[:, -1], baseline["mid"][:, -1] + 1.0)
    assert torch.equal(steered, expected)
    runner.assert_unchanged(baseline)


def test_an_edit_of_the_saved_read_itself_reaches_the_model(runner, baseline):
    model = runner.model
    with runner.trace():
        mid = model.layers[1].layer_mid.save()
        mid[:, -1] += 1.0
        steered = model.logits.save()
    with runner.trace():
        model.layers[1].layer_mid[:, -1] += 1.0
        expected = model.logits.save()
    assert torch.equal(steered, expected)
    runner.assert_unchanged(baseline)


def test_a_non_finite_write_warns_naming_the_value(runner, baseline):
    model = runner.model
    with pytest.warns(RuntimeWarning, match=re.escape("model.layers[1].layer_mid is written with NaN or inf at 1 ")):
        with runner.trace():
            model.layers[1].layer_mid[:, 0, 0] = float("nan")
            logits = model.logits.save()
    assert logits.isnan().all()  # softmax attention carries it to every later position
    with pytest.warns(RuntimeWarning, match=re.escape("model.layers[1].layer_output is written with NaN or inf")):
        with runner.trace():
            model.layers[1].layer_output = torch.full_like(model.layers[1].layer_output, float("inf"))
            model.logits.save()
    runner.assert_unchanged(baseline)


def test_a_non_finite_write_warns_within_its_trace_even_as_the_last_statement(runner, baseline):
    """The scans are read together when an invoke ends, not at each write: a NaN written by the invoke's last
    statement (nothing read after it, so it goes to the model after the invoke's code has ended) still warns
    before the trace returns, once."""
    from streamscope import nonfinite

    model = runner.model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with runner.trace():
            model.layers[1].layer_mid[:, -1] = float("nan")
    found = [warning for warning in caught if "model.layers[1].layer_mid is written with NaN or inf" in
             str(warning.message)]
    assert len(found) == 1, [str(warning.message) for warning in caught]
    assert nonfinite.pending() == 0
    runner.assert_unchanged(baseline)


def test_a_non_finite_write_warns_the_same_when_its_scan_is_read_at_the_invokes_end(runner, baseline,
                                                                                     monkeypatch):
    """On a device the scans stay there and are read together when the invoke ends; forced here on the host, the
    same NaN writes give the same warnings, once each, before the trace returns."""
    from streamscope import nonfinite

    monkeypatch.setattr(nonfinite, "READ_ON_THE_HOST", False)
    model = runner.model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with runner.trace():
            model.layers[0].layer_mid[:, 0, 0] = float("nan")
            model.layers[1].layer_mid[:] += 1.0
            model.logits.save()
    messages = [str(warning.message) for warning in caught if "NaN or inf" in str(warning.message)]
    assert len(messages) == 1 and messages[0].startswith("model.layers[0].layer_mid is written with NaN or inf at 1 "), \
        messages
    assert nonfinite.pending() == 0
    runner.assert_unchanged(baseline)


def test_a_write_over_values_the_model_made_non_finite_does_not_warn(runner, baseline):
    """Once a write has poisoned the stream, the blocks after it hold NaN of the model's own: a later write that
    keeps them is not what brought them in, and warns nothing (the first write warns once)."""
    model = runner.model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with runner.trace():
            model.layers[0].layer_output[:, 0] = float("inf")
            model.layers[1].layer_mid[:] *= 2.0
            model.logits.save()
    messages = [str(warning.message) for warning in caught if "NaN or inf" in str(warning.message)]
    assert len(messages) == 1 and messages[0].startswith("model.layers[0].layer_output is written"), messages
    runner.assert_unchanged(baseline)


def test_a_non_finite_write_under_an_error_filter_raises_in_its_trace(runner, baseline):
    """Warnings made errors (`-W error`) raise the scan's warning out of the trace; the engine serves on."""
    model = runner.model
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match=re.escape("model.layers[1].layer_mid is written with NaN")):
            with runner.trace():
                model.layers[1].layer_mid[:, 0] = float("nan")
                model.logits.save()
    runner.assert_unchanged(baseline)


def test_a_finite_edit_does_not_warn(runner, baseline):
    import warnings

    model = runner.model
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with runner.trace():
            model.layers[1].layer_mid[:, -1] += 1.0
            model.logits.save()


def test_load_time_mistakes_are_refused_before_loading(runner, baseline, tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    engine = runner.engine
    with pytest.raises(FileNotFoundError, match="no checkpoint folder at"):
        streamscope.load(tmp_path / "missing", engine=engine)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        streamscope.load(tmp_path / "empty", engine=engine)
    folder = runner.model.config._name_or_path
    with pytest.raises(ValueError, match=r"dtype='float33' is not a floating-point dtype: use 'float32'"):
        streamscope.load(folder, engine=engine, dtype="float33")
    with pytest.raises(ValueError, match=r"no \w+ family called 'nonexistent'. Known families: .*llama"):
        streamscope.load(folder, engine=engine, family="nonexistent")
    bert = tmp_path / "bert"
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    BertForMaskedLM(config).save_pretrained(bert)
    with pytest.raises(ValueError, match="'bert' checkpoint, an encoder .*decoder-only"):
        streamscope.load(bert, engine=engine)
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        streamscope.load(folder, engine="sglang")
    runner.assert_unchanged(baseline)


#: How many tensors, and how many bytes of resident memory, 200 traces may leave behind: a trace that
#: leaked its worker would hold its reads (four tensors or more each, 800+ over the run) and its frame.
TENSOR_GROWTH, RSS_GROWTH = 16, 64 * 2**20


def resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_objects() -> dict[str, int]:
    import gc

    from nnsight.intervention.interleaver import Mediator

    gc.collect()
    objects = gc.get_objects()
    return {"tensors": sum(isinstance(item, torch.Tensor) for item in objects),
            "workers": sum(isinstance(item, Mediator) for item in objects)}


def test_200_traces_with_failures_interleaved_leave_no_growth(runner, baseline):
    model = runner.model
    failures = [wrong_shape, users_key_error, out_of_order, late_in_place_edit, bool_tensor]

    def one(index: int) -> None:
        if index % 4 == 3:
            with pytest.raises(Exception):
                failures[(index // 4) % len(failures)](runner)
            return
        with runner.trace():
            model.layers[1].layer_mid[:, -1] += 1.0
            model.layers[2].layer_output.save()
            model.logits.save()

    for index in range(20):  # warm-up: caches, allocator pools
        one(index)
    before, rss_before = live_objects(), resident_bytes()
    for index in range(200):
        one(index)
    after, rss_after = live_objects(), resident_bytes()
    print(f"{runner.engine}: 200 traces: {before} -> {after}, resident {(rss_after - rss_before) / 2**20:+.1f} MiB")
    assert after["workers"] <= before["workers"], (before, after)
    assert after["tensors"] - before["tensors"] <= TENSOR_GROWTH, (before, after)
    assert rss_after - rss_before <= RSS_GROWTH, (rss_before, rss_after)
    runner.assert_unchanged(baseline)
