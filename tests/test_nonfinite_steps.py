"""The per-step non-finite check: decided on the device, no host sync (single process; the multi-process
behaviour is in tests/test_reliability.py::test_nan_gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet.hdet.guard import NonFiniteSteps, skips_on_device


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
    optimizer, steps = make(param), NonFiniteSteps(torch.device("cpu"))
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
    optimizer, steps = torch.optim.SGD([param], lr=0.1, momentum=0.9), NonFiniteSteps(torch.device("cpu"))
    assert not skips_on_device(optimizer)
    _step(optimizer, param, steps, 1.0)  # momentum buffer 1 -> param 0.9
    _step(optimizer, param, steps, math.inf)  # zeroed: momentum 0.9 * 1 + 0 -> param 0.9 - 0.09
    torch.testing.assert_close(param.detach(), torch.full((3,), 0.81))
    torch.testing.assert_close(optimizer.state[param]["momentum_buffer"], torch.full((3,), 0.9))
    assert steps.total() == 1
