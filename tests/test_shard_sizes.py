"""How a harvest written to disk is cut into shards (`streamscope.bulk.results`): by `shard_size` where given, else
by the bytes of its rows, so a shard's host memory is bounded whatever the prompts' lengths and values."""

from __future__ import annotations

import pytest
import torch

from streamscope.bulk import results
from streamscope.bulk.results import Harvest, ShardCutter, estimated_row_bytes, shard_fits
from streamscope.bulk.spec import HarvestSpec


def spec_of(lengths: list[int], reduce: str | None = None) -> HarvestSpec:
    return HarvestSpec(["layer_output"], [0, 1], [list(range(length)) for length in lengths], reduce=reduce)


def test_shard_size_given_is_prompts_whatever_their_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "SHARD_BYTES", 10)
    cut = list(ShardCutter(spec_of([100] * 7), 7, 3, row_bytes=1_000))
    assert cut == [[0, 1, 2], [3, 4, 5], [6]]


def test_by_default_a_shard_holds_at_most_shard_bytes_of_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "SHARD_BYTES", 1_000)
    lengths = [3, 5, 2, 20, 4, 4, 4, 1]
    cutter = ShardCutter(spec_of(lengths), len(lengths), None, row_bytes=50)
    cut = list(cutter)
    assert [prompt for shard in cut for prompt in shard] == list(range(len(lengths)))  # each once, in order
    for shard in cut:
        held = sum(lengths[prompt] * 50 for prompt in shard)
        assert held <= 1_000 or len(shard) == 1, (shard, held)  # one prompt larger than the limit: a shard alone
        following = shard[-1] + 1
        if following < len(lengths):  # greedy: the next prompt would not have fit
            assert held + lengths[following] * 50 > 1_000, (shard, held)
    assert [3] in cut  # 1,000 bytes: a shard of its own


def test_by_default_a_shard_holds_at_most_shard_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "SHARD_PROMPTS", 4)
    cut = list(ShardCutter(spec_of([1] * 10), 10, None, row_bytes=1))
    assert cut == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_reduced_prompts_count_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "SHARD_BYTES", 300)
    cut = list(ShardCutter(spec_of([50] * 6, reduce="mean"), 6, None, row_bytes=100))
    assert cut == [[0, 1, 2], [3, 4, 5]]


def test_later_shards_use_the_measured_row_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An estimate too small (a value wider than the hidden size) oversizes the first shard only."""
    monkeypatch.setattr(results, "SHARD_BYTES", 4_000)
    lengths = [10] * 12
    cutter = ShardCutter(spec_of(lengths), len(lengths), None, row_bytes=100)
    shards = []
    for shard in cutter:
        shards.append(shard)
        # Each row is really 400 bytes: [2 sites, positions, 50 wide] float32.
        rows = {"layer_output": [torch.zeros(2, lengths[prompt], 50) for prompt in shard]}
        cutter.measure(Harvest(rows, [0, 1], [list(range(lengths[p])) for p in shard], shard))
    assert shards[0] == [0, 1, 2, 3]  # 4 prompts x 10 rows x 100 estimated bytes
    assert all(len(shard) == 1 for shard in shards[1:])  # 10 rows x 400 measured bytes fill a shard
    assert cutter.row_bytes == 400


def test_fits_by_prompts_and_bytes() -> None:
    assert shard_fits(3, 10**12, 3) and not shard_fits(4, 0, 3)  # shard_size given: prompts alone count
    assert shard_fits(results.SHARD_PROMPTS, results.SHARD_BYTES, None)
    assert not shard_fits(results.SHARD_PROMPTS + 1, 0, None) and not shard_fits(1, results.SHARD_BYTES + 1, None)


def test_the_estimate_counts_every_site_at_its_width() -> None:
    spec = HarvestSpec(["layer_output", "token_embeddings", "self_attn.head_results"], [0, 1, 2], [[0]])
    spec.shapes["self_attn.head_results"] = (4, 64)
    # 3 blocks + the root + 3 blocks of [4, 64], bfloat16
    assert estimated_row_bytes(spec, 64, torch.bfloat16) == (3 * 64 + 64 + 3 * 256) * 2


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_a_bad_shard_size_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="shard_size"):
        ShardCutter(spec_of([1]), 1, bad, row_bytes=1)  # type: ignore[arg-type]
