"""The NaN/inf scan of writes on its own (`streamscope.nonfinite`): what it warns, when it reads, what it holds.

The engines' tests (tests/misuse.py, run on both) check the scan inside traces; these check its rules directly,
against a count made here with plain torch, read at the write and deferred, and the line a warning points at,
against a plain walk of the stack.
"""

from __future__ import annotations

import sys
import sysconfig
import threading
import warnings

import pytest
import torch

from streamscope import nonfinite


@pytest.fixture(autouse=True, params=["read at once", "deferred"])
def reading(request, monkeypatch):
    """Both ways a scan is read: at the write (host tensors), and deferred to the invoke's end (device tensors,
    forced here on host tensors): the same warnings either way."""
    nonfinite.warn_pending(raising=False)
    if request.param == "deferred":
        monkeypatch.setattr(nonfinite, "READ_ON_THE_HOST", False)
    yield request.param
    nonfinite.warn_pending(raising=False)


def warned() -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nonfinite.warn_pending()
    return caught


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_count_is_the_entries_brought_in_and_the_line_is_the_writes(dtype):
    current = torch.randn(3, 5, 8).to(dtype)
    value = current.clone()
    value[0, 1, :3] = float("nan")
    value[2, 4, 7] = float("-inf")
    nonfinite.scan_write("model.layers[0].layer_output", value, current); line = sys._getframe().f_lineno  # noqa: E702
    caught = warned()
    assert len(caught) == 1
    expected = int((~torch.isfinite(value)).sum())
    assert str(caught[0].message).startswith(
        f"model.layers[0].layer_output is written with NaN or inf at {expected} of its {value.numel()} entries")
    assert (caught[0].filename, caught[0].lineno, caught[0].category) == (__file__, line, RuntimeWarning)


def test_finite_writes_and_sums_that_only_overflow_warn_nothing():
    big = torch.full((4, 16), 3.0e38)  # finite entries whose float32 sum is inf
    assert not torch.isfinite(big.sum())
    nonfinite.scan_write("model.layers[0].layer_mid", big, torch.zeros(4, 16))
    nonfinite.scan_write("model.layers[1].layer_mid", torch.ones(4, 16), torch.zeros(4, 16))
    assert warned() == []


def test_a_write_over_the_models_own_non_finite_values_warns_nothing():
    current = torch.zeros(2, 4)
    current[0, 0] = float("nan")
    nonfinite.scan_write("model.layers[2].layer_input", current * 2, current)
    assert warned() == []


def test_a_write_with_nothing_to_compare_warns_on_any_non_finite_entry():
    logits = torch.zeros(1, 10)
    logits[0, 3] = float("inf")
    nonfinite.scan_write("model.logits", logits, None)
    messages = [str(warning.message) for warning in warned()]
    assert len(messages) == 1 and "at 1 of its 10 entries" in messages[0]


def test_a_tensor_changed_in_place_after_its_write_is_not_given_a_wrong_count(reading):
    value = torch.zeros(2, 4)
    value[1, 1] = float("nan")
    nonfinite.scan_write("model.layers[0].layer_output", value, torch.zeros(2, 4))
    value.zero_()  # the caller's buffer, refilled before the warnings are given
    messages = [str(warning.message) for warning in warned()]
    # Read at the write, the count is the write's; deferred, it cannot be known any more, and says so.
    expected = "at 1 of its 8 entries" if reading == "read at once" else "at some of its 8 entries"
    assert len(messages) == 1 and expected in messages[0], messages


def test_scans_are_read_once_they_hold_too_much(reading):
    if reading != "deferred":  # read at the write, a host tensor's scan holds nothing, however many writes
        for _ in range(nonfinite.HOLD_COUNT + 1):
            nonfinite.scan_write("model.layers[0].layer_output", torch.ones(2), torch.ones(2))
            assert nonfinite.pending() == 0
        return
    count = nonfinite.HOLD_COUNT + 1
    for _ in range(count):
        nonfinite.scan_write("model.layers[0].layer_output", torch.ones(2), torch.ones(2))
    assert nonfinite.pending() == 0  # read at the last write, with nothing to warn about
    per_write = 1 << 20  # 4 MiB of float32
    writes = nonfinite.HOLD_BYTES // (4 * per_write) + 1
    for _ in range(writes - 1):
        nonfinite.scan_write("model.layers[0].layer_output", torch.ones(per_write), None)
    assert nonfinite.pending() == writes - 1
    nonfinite.scan_write("model.layers[0].layer_output", torch.ones(per_write), None)
    assert nonfinite.pending() == 0


def test_a_warning_made_an_error_is_dropped_only_while_another_error_is_raised():
    value = torch.full((2,), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        nonfinite.scan_write("model.logits", value, None)
        with pytest.raises(RuntimeWarning, match="model.logits is written with NaN or inf"):
            nonfinite.warn_pending()
        nonfinite.scan_write("model.logits", value, None)
        nonfinite.warn_pending(raising=False)  # an invoke already failing keeps its own error
    assert nonfinite.pending() == 0


def overflowing(dtype: torch.dtype) -> torch.Tensor:
    """Finite entries of `dtype` whose sum in `dtype` is not finite (in float32 too, but for float16)."""
    big = torch.finfo(dtype).max / 2
    return torch.full((4, 16), big).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["nan", "+inf", "-inf", "overflow", "over the model's own NaN"])
def test_every_dtype_warns_for_nan_and_either_inf_and_never_for_an_overflow_or_the_models_own(dtype, case):
    current = torch.randn(4, 16).to(dtype)
    value = current + 1
    if case == "overflow":
        value = overflowing(dtype)
        assert not torch.isfinite(value.sum()) and torch.isfinite(value).all()
    elif case == "over the model's own NaN":
        current[2, 3] = float("nan")
        value = current * 2
    else:
        value[1, 5] = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}[case]
    nonfinite.scan_write("model.layers[3].layer_output", value, current)
    messages = [str(warning.message) for warning in warned()]
    if case in ("overflow", "over the model's own NaN"):
        assert messages == []
    else:
        assert len(messages) == 1 and "at 1 of its 64 entries" in messages[0], messages


def test_a_read_warns_for_exactly_the_writes_that_brought_nan_or_inf():
    nan = torch.full((2, 4), float("nan"))
    nonfinite.scan_write("model.layers[0].layer_output", torch.ones(2, 4), torch.zeros(2, 4))
    nonfinite.scan_write("model.layers[1].layer_output", nan, torch.zeros(2, 4))
    nonfinite.scan_write("model.layers[2].layer_output", nan, nan)  # the model's own were NaN already
    nonfinite.scan_write("model.layers[3].layer_output", torch.ones(2, 4), nan)
    nonfinite.scan_write("model.logits", torch.full((1, 10), float("inf")), None)
    messages = [str(warning.message) for warning in warned()]
    assert [message.split(" is written")[0] for message in messages] == ["model.layers[1].layer_output",
                                                                       "model.logits"], messages
    assert "at 8 of its 8 entries" in messages[0] and "at 10 of its 10 entries" in messages[1], messages


def rows_scanned(writes: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """`scan_rows` as `streamscope.vllm.write_batch` calls it: writes landed together, their rows in a row."""
    values = torch.cat([value for _, value, _ in writes])
    own = torch.cat([current for _, _, current in writes])
    line = nonfinite.user_line()
    nonfinite.scan_rows([(name, value.shape[0], line) for name, value, _ in writes], values, own)


def test_writes_scanned_together_by_row_warn_as_each_scanned_alone():
    """Writes landed together are scanned from their rows' sums: each warns exactly where its own scan would."""
    nan = torch.full((2, 4), float("nan"))
    one_nan = torch.zeros(2, 4)
    one_nan[1, 2] = float("inf")
    own_nan = torch.zeros(2, 4)
    own_nan[0, 0] = float("nan")
    writes = [("model.layers[0].layer_output", torch.ones(2, 4), torch.zeros(2, 4)),
              ("model.layers[1].layer_output", one_nan, torch.zeros(2, 4)),
              ("model.layers[2].layer_output", nan, own_nan),  # a row of the model's own was NaN already
              ("model.layers[3].layer_output", nan[:1], torch.zeros(1, 4))]
    rows_scanned(writes)
    together = [str(warning.message) for warning in warned()]
    for name, value, current in writes:
        nonfinite.scan_write(name, value, current)
    assert together == [str(warning.message) for warning in warned()]
    assert [message.split(" is written")[0] for message in together] == ["model.layers[1].layer_output",
                                                                       "model.layers[3].layer_output"], together
    assert "at 1 of its 8 entries" in together[0] and "at 4 of its 4 entries" in together[1], together


def test_writes_scanned_together_and_finite_hold_nothing(reading):
    rows_scanned([(f"model.layers[{index}].layer_output", torch.ones(1, 4), torch.zeros(1, 4)) for index in range(3)])
    assert nonfinite.pending() == (3 if reading == "deferred" else 0)
    assert warned() == []


def test_a_value_of_another_shape_than_the_models_is_not_compared():
    current = torch.full((2, 4), float("nan"))  # would hide the write's NaN, were it compared
    value = torch.zeros(3, 4)
    value[0, 0] = float("nan")
    nonfinite.scan_write("model.layers[0].layer_output", value, current)
    messages = [str(warning.message) for warning in warned()]
    assert len(messages) == 1 and "at 1 of its 12 entries" in messages[0], messages


def test_an_inference_tensor_without_a_version_counter_is_counted():
    with torch.inference_mode():
        value = torch.zeros(2, 4)
        value[1, 2] = float("-inf")
        nonfinite.scan_write("model.layers[0].layer_output", value, torch.zeros(2, 4))
    messages = [str(warning.message) for warning in warned()]
    assert len(messages) == 1 and "at 1 of its 8 entries" in messages[0], messages


# The line a warning points at: the innermost frame outside the libraries, found the same way at any depth.

LIBRARY_FILE = f"{sysconfig.get_paths()['purelib']}/streamscope_tests_engine.py"  # taken for an engine's
LIBRARY: dict = {"user_line": nonfinite.user_line}
exec(compile('''
def nested(depth, then):
    if depth:
        return nested(depth - 1, then)
    return then()

def asking(depth, reference):
    """user_line and `reference` asked from `depth` library frames up (the line of the call of this)."""
    return nested(depth, lambda: (user_line(1), reference(1)))

def engine_thread(depth, reference, out):
    out.append(asking(depth, reference))
''', LIBRARY_FILE, "exec"), LIBRARY)


def walked(skip: int) -> nonfinite.Line:
    """The line `user_line(skip)` gives, walked frame by frame with nothing kept from an earlier walk."""
    caller = frame = sys._getframe(skip + 1)
    while frame is not None and frame.f_code.co_filename.startswith(nonfinite._LIBRARIES):
        frame = frame.f_back
    frame = frame or caller
    return nonfinite.Line(frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__"))


def test_the_line_is_the_users_below_any_number_of_library_frames():
    for depth in (0, 1, 70):
        found, expected = LIBRARY["asking"](depth, walked); line = sys._getframe().f_lineno  # noqa: E702
        assert found == expected == (__file__, line, __name__), (depth, found, expected)
        assert type(found) is nonfinite.Line


def test_the_line_is_the_innermost_users_between_library_frames():
    def user_frame():
        return LIBRARY["asking"](30, walked)  # the line expected

    found, expected = LIBRARY["nested"](30, user_frame)
    assert found == expected == (__file__, user_frame.__code__.co_firstlineno + 1, __name__), (found, expected)


def test_with_no_users_frame_on_the_stack_the_line_is_the_callers():
    """A write-back from inside an engine, with nothing of the user's below it (a thread of the engine's)."""
    seen: list = []
    thread = threading.Thread(target=LIBRARY["engine_thread"], args=(60, walked, seen))
    thread.start()
    thread.join()
    (found, expected), = seen
    assert found == expected and found.filename == LIBRARY_FILE, (found, expected)


def test_the_line_is_the_same_after_the_files_known_are_forgotten():
    """Each trace compiles a body of its own ("<...>", a library's): the files known are forgotten now and then."""
    lines = set()
    for index in range(4200):
        namespace: dict = {}
        exec(compile("def body(ask):\n    return ask(0)\n", f"<trace-body-{index}>", "exec"), namespace)
        lines.add(namespace["body"](nonfinite.user_line)); line = sys._getframe().f_lineno  # noqa: E702
        assert len(nonfinite._IS_LIBRARY) <= 4097
    assert lines == {(__file__, line, __name__)}, lines
