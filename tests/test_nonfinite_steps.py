"""The per-step non-finite check: decided on the device, no host sync (single process; the multi-process
behaviour is in tests/test_fake_collectives.py and tests/test_reliability.py::test_nan_gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet._tensors import finite
from lightning_hdet.hdet.execution.comm import ProcessGroupCommunicator
from lightning_hdet.hdet.execution.guard import NonFiniteSteps, skips_on_device, zero_grads


def _step(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, steps: NonFiniteSteps, grad: float) -> None:
    def closure() -> torch.Tensor:
        param.grad = torch.full_like(param, grad)
        return (param * grad).sum()

    exact = skips_on_device(optimizer)
    checked = steps.wrap(closure, optimizer, None, True, None, 1, exact)
    if exact:
        with steps.found_inf(optimizer):
            optimizer.step(checked)
    else:
        optimizer.step(checked)


def _state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    return {"param": param.detach().clone(), **{k: v.clone() for k, v in optimizer.state[param].items()}}


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW([p], lr=0.1, fused=True),
    lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True),
], ids=["adamw", "sgd"])
def test_fused_optimizer_skips_on_the_device_and_leaves_its_state_untouched(make) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer, steps = make(param), NonFiniteSteps(torch.device("cpu"), ProcessGroupCommunicator())
    assert skips_on_device(optimizer)
    _step(optimizer, param, steps, 1.0)
    before = _state(optimizer, param)
    _step(optimizer, param, steps, math.nan)
    after = _state(optimizer, param)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)  # step count too
    assert not hasattr(optimizer, "found_inf")  # handed back after the step
    _step(optimizer, param, steps, 1.0)
    assert not torch.equal(param.detach(), before["param"]) and bool(torch.isfinite(param).all())
    assert steps.interval() == 1 and steps.interval() == 0 and steps.total() == 1


def test_other_optimizers_step_on_a_zeroed_gradient_and_the_flag_waits_for_the_vote() -> None:
    """Deferred: the optimizer steps (its state moves), but nothing non-finite reaches the parameters."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer, steps = torch.optim.SGD([param], lr=0.1, momentum=0.9), NonFiniteSteps(torch.device("cpu"), ProcessGroupCommunicator())
    assert not skips_on_device(optimizer)
    _step(optimizer, param, steps, 1.0)  # momentum buffer 1 -> param 0.9
    _step(optimizer, param, steps, math.inf)  # zeroed: momentum 0.9 * 1 + 0 -> param 0.9 - 0.09
    torch.testing.assert_close(param.detach(), torch.full((3,), 0.81))
    torch.testing.assert_close(optimizer.state[param]["momentum_buffer"], torch.full((3,), 0.9))
    assert steps.total() == 1


@pytest.mark.parametrize(
    ("values", "dtype", "expected"),
    [
        ([1.0, -2.0, 3.0], torch.float32, True),
        ([1.0, math.nan, 3.0], torch.float32, False),
        ([math.inf, 1.0], torch.float32, False),
        ([math.inf, -math.inf], torch.float32, False),  # the sum is NaN, not 0
        ([3e38, 3e38], torch.float32, False),  # finite elements whose sum overflows float32: counted as non-finite
        ([6e4, 6e4], torch.float16, True),  # half precision is summed in float32: 1.2e5 does not overflow
        ([6e4, math.inf], torch.float16, False),
        ([1e38, 2e38], torch.bfloat16, True),  # 3e38 < float32's max
    ],
)
def test_finite_reads_one_sum(values: list[float], dtype: torch.dtype, expected: bool) -> None:
    result = finite(torch.tensor(values, dtype=dtype))
    assert result.dtype == torch.bool and result.dim() == 0
    assert bool(result) is expected


def test_zero_grads_clears_non_finite_gradients_only_when_flagged() -> None:
    """The flag zeroes every gradient, NaN and inf included (0 * inf is NaN, then 0); unflagged (hence finite)
    gradients stay bit-equal."""
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([a, b], lr=0.1)
    a.grad, b.grad = torch.tensor([1.5, 1e-30, -7.0]), torch.tensor([0.25, -3.0])
    zero_grads(optimizer, torch.tensor(False))
    assert torch.equal(a.grad, torch.tensor([1.5, 1e-30, -7.0])) and torch.equal(b.grad, torch.tensor([0.25, -3.0]))
    a.grad = torch.tensor([1.5, math.nan, -math.inf])
    zero_grads(optimizer, torch.tensor(True))
    assert torch.equal(a.grad, torch.zeros(3)) and torch.equal(b.grad, torch.zeros(2))
