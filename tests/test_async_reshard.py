"""Resharding a worker's inner optimizer state to another ``ranks_per_worker`` (issue 42), in one process against
hand-computed tensors: FSDP2 gives shard ``j`` of ``k`` rows ``[j * ceil(n / k), ...)`` of every dim 0."""

import pytest
import torch

from lightning_hdet.asynchronous.exchange.reshard import reshard_optimizer_state, shard_rows


def _adam_shards(rows: list[list[float]], sizes: list[int]) -> list[dict]:
    """The Adam state dicts of a 5-row ``exp_avg`` (and a 1-row bias' one) as ``len(sizes)`` ranks saved them."""
    full = torch.tensor(rows)
    bias = torch.tensor([7.0])
    out, lo = [], 0
    for j, size in enumerate(sizes):
        blo, bhi = shard_rows(1, len(sizes), j)
        out.append({"state": {0: {"step": torch.tensor(3.0), "exp_avg": full[lo : lo + size].clone()},
                              1: {"step": torch.tensor(3.0), "exp_avg": bias[blo:bhi].clone()}},
                    "param_groups": [{"lr": 0.05, "params": [0, 1]}]})
        lo += size
    return out


ROWS = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]


def test_shard_rows_follow_fsdp2_and_refuse_a_bad_index():
    assert [shard_rows(5, 2, j) for j in range(2)] == [(0, 3), (3, 5)]
    assert [shard_rows(5, 3, j) for j in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [shard_rows(1, 3, j) for j in range(3)] == [(0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match=r"`index=3` must be in \[0, 3\)"):
        shard_rows(5, 3, 3)


def test_two_shards_to_three():
    old = _adam_shards(ROWS, [3, 2])
    new = [reshard_optimizer_state(old, 3, j) for j in range(3)]
    expected = [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]], [[8.0, 9.0]]]
    for j in range(3):
        assert torch.equal(new[j]["state"][0]["exp_avg"], torch.tensor(expected[j]))
        assert torch.equal(new[j]["state"][0]["step"], torch.tensor(3.0))  # scalar: shard 0's
        assert new[j]["param_groups"] == old[0]["param_groups"]
    # the 1-row bias: rows 0 / none / none (empty shards keep their trailing shape)
    assert [tuple(n["state"][1]["exp_avg"].shape) for n in new] == [(1,), (0,), (0,)]
    assert torch.equal(new[0]["state"][1]["exp_avg"], torch.tensor([7.0]))


def test_three_shards_to_two():
    old = _adam_shards(ROWS, [2, 2, 1])
    new = [reshard_optimizer_state(old, 2, j) for j in range(2)]
    assert torch.equal(new[0]["state"][0]["exp_avg"], torch.tensor(ROWS[:3]))
    assert torch.equal(new[1]["state"][0]["exp_avg"], torch.tensor(ROWS[3:]))
    assert [tuple(n["state"][1]["exp_avg"].shape) for n in new] == [(1,), (0,)]
    assert new[1]["state"][0]["step"] == 3


def test_same_k_gives_each_shard_back_and_mismatched_shards_are_refused():
    old = _adam_shards(ROWS, [3, 2])
    for j in range(2):
        assert torch.equal(reshard_optimizer_state(old, 2, j)["state"][0]["exp_avg"], old[j]["state"][0]["exp_avg"])
    old[1]["state"][0]["exp_avg"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="do not agree beyond dim 0"):
        reshard_optimizer_state(old, 3, 0)
    with pytest.raises(ValueError, match="at least one shard"):
        reshard_optimizer_state([], 3, 0)
