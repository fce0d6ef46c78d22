import copy
import io

import pytest
import torch

from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterovOptimizer as DelayedNesterov


def _push(opt: DelayedNesterov, p: torch.Tensor, g: torch.Tensor) -> None:
    p.grad = g.clone()
    opt.step()


@pytest.mark.parametrize("n", [1, 3, 4])
def test_n_pushes_equal_one_sgd_nesterov_step(n):
    torch.manual_seed(0)
    theta0 = torch.randn(7)
    grads = [torch.randn(7) for _ in range(3)]
    p_dn, p_sgd = theta0.clone(), theta0.clone()
    dn = DelayedNesterov([p_dn], lr=0.7, momentum=0.9, buffer_size=n)
    sgd = torch.optim.SGD([p_sgd], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:  # several momentum updates, so momentum carries over
        for _ in range(n):
            _push(dn, p_dn, g)
        p_sgd.grad = g.clone()
        sgd.step()
        torch.testing.assert_close(p_dn, p_sgd)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_n_1_holds_only_the_momentum_buffer_and_resumes_an_sgd_state(momentum):
    """DiLoCo's outer step is DN with N = 1: it keeps one model of momentum (none at momentum 0, no ``delta``),
    and a state saved by the ``torch.optim.SGD(nesterov=True)`` it replaced resumes to the same next steps."""
    torch.manual_seed(1)
    theta0, grads = torch.randn(6), [torch.randn(6) for _ in range(4)]
    p_sgd, p_dn = theta0.clone(), theta0.clone()
    sgd = torch.optim.SGD([p_sgd], lr=0.7, momentum=momentum, nesterov=momentum > 0)
    for g in grads[:2]:
        p_sgd.grad = g.clone()
        sgd.step()
    dn = DelayedNesterov([p_dn], lr=0.1, momentum=0.5, buffer_size=1)  # lr, momentum: the saved ones win
    p_dn.copy_(p_sgd)
    dn.load_state_dict(copy.deepcopy(sgd.state_dict()))  # as from a file: no buffer shared with sgd
    assert (dn.param_groups[0]["lr"], dn.param_groups[0]["momentum"]) == (0.7, momentum)
    for g in grads[2:]:
        p_sgd.grad = g.clone()
        sgd.step()
        _push(dn, p_dn, g)
        torch.testing.assert_close(p_dn, p_sgd)
    state = dn.state[p_dn]
    assert "delta" not in state
    assert ("momentum_buffer" in state) == (momentum > 0)


def test_intermediate_push_moves_by_lr_g_over_n():
    p = torch.zeros(5)
    dn = DelayedNesterov([p], lr=0.5, momentum=0.9, buffer_size=4)
    g = torch.arange(5.0)
    # first a full buffer so that the momentum is non-zero; intermediate pushes must still ignore it (c = 0)
    for _ in range(4):
        _push(dn, p, g)
    for _ in range(3):
        before = p.clone()
        _push(dn, p, g)
        torch.testing.assert_close(p - before, -0.5 * g / 4)


def test_resize_waits_for_a_momentum_boundary():
    p = torch.zeros(2)
    dn = DelayedNesterov([p], lr=1.0, momentum=0.5, buffer_size=2)
    assert dn.resize(3) and dn.param_groups[0]["buffer_size"] == 3  # no state yet: a boundary
    _push(dn, p, torch.ones(2))  # one push buffered of 3
    assert not dn.resize(1) and dn.param_groups[0]["buffer_size"] == 3
    _push(dn, p, torch.ones(2)), _push(dn, p, torch.ones(2))  # the third updates the momentum: a boundary again
    assert dn.resize(1) and dn.param_groups[0]["buffer_size"] == 1
    with pytest.raises(ValueError, match="size"):
        dn.resize(0)


def test_momentum_activation_formula():
    lr, beta, n, c = 0.3, 0.8, 2, 0.25
    p = torch.zeros(3)
    dn = DelayedNesterov([p], lr=lr, momentum=beta, buffer_size=n, momentum_activation=c)
    g1, g2, g3 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 0.5, 2.0]), torch.tensor([0.3, 0.3, -0.7])
    m = torch.zeros(3)
    expected = torch.zeros(3)
    # push 1: intermediate, m = 0
    _push(dn, p, g1)
    expected -= lr * (c * beta * m + g1 / n)
    torch.testing.assert_close(p, expected)
    # push 2: N-th push, momentum update with the buffer mean
    _push(dn, p, g2)
    m = beta * m + (g1 + g2) / n
    expected -= lr * ((1 - c * n + c) * beta * m + g2 / n)
    torch.testing.assert_close(p, expected)
    # push 3: intermediate, uses the current momentum
    _push(dn, p, g3)
    expected -= lr * (c * beta * m + g3 / n)
    torch.testing.assert_close(p, expected)


def test_state_dict_round_trip():
    torch.manual_seed(1)
    p1 = torch.randn(4)
    p2 = p1.clone()
    a = DelayedNesterov([p1], lr=0.7, momentum=0.9, buffer_size=3, momentum_activation=0.1)
    for _ in range(4):  # mid-buffer: one momentum update, one pending push
        _push(a, p1, torch.randn(4))
    p2.copy_(p1)
    b = DelayedNesterov([p2], lr=0.7, momentum=0.9, buffer_size=3, momentum_activation=0.1)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b.load_state_dict(torch.load(buffer))
    for _ in range(5):
        g = torch.randn(4)
        _push(a, p1, g)
        _push(b, p2, g)
        torch.testing.assert_close(p1, p2)


@pytest.mark.parametrize("restart", [0, 2])
def test_c_0_keeps_no_delta_and_resumes_a_state_saved_with_one(restart):
    """With c = 0 a push goes into the momentum as it arrives: mid-cycle the state holds the momentum and no
    ``delta`` (one model less on rank 0). A state saved mid-cycle by the earlier code (momentum of the last update,
    the cycle's pushes in ``delta``) resumes to the same steps as a run that never stopped."""
    torch.manual_seed(2)
    lr, beta, n = 0.7, 0.9, 3
    grads = [torch.randn(5) for _ in range(9)]
    p_run, p_old = torch.zeros(5), torch.zeros(5)
    run = DelayedNesterov([p_run], lr=lr, momentum=beta, buffer_size=n, momentum_restart=restart)
    for g in grads[:4]:  # one momentum update, then one push of the next cycle
        _push(run, p_run, g)
    assert "delta" not in run.state[p_run] and run.state[p_run]["pushes"] == 1
    # the earlier code's state after the same 4 pushes: m = (g1 + g2 + g3) / 3 (the first update), delta = g4
    m = sum(grads[:3]) / n
    p_old.copy_(-lr * (beta * m + sum(grads[:3]) / n) - lr * grads[3] / n)
    saved = copy.deepcopy(run.state_dict())
    saved["state"][0].update(momentum_buffer=m, delta=grads[3].clone())
    old = DelayedNesterov([p_old], lr=lr, momentum=beta, buffer_size=n, momentum_restart=restart)
    old.load_state_dict(saved)
    assert "delta" not in old.state[p_old]
    for g in grads[4:]:  # the rest of the cycle and a second one
        _push(run, p_run, g)
        _push(old, p_old, g)
        torch.testing.assert_close(p_old, p_run)


def _round_robin_on_a_quadratic(buffer_size: int, momentum: float, rounds: int = 40, workers: int = 4) -> list[float]:
    """Asynchronous Local-SGD in miniature: on f(x) = |x|^2 / 2, a worker's round of local steps moves its copy
    half-way to the optimum (pseudo-gradient 0.5 * x_pulled); workers push in turn, each from the parameters it
    pulled after its previous push, so every push is ``workers - 1`` outer updates stale. Returns |x| per round."""
    x = torch.ones(1)
    opt = DelayedNesterov([x], lr=0.7, momentum=momentum, buffer_size=buffer_size)
    pulled = [x.clone() for _ in range(workers)]
    norms = []
    for _ in range(rounds):
        for w in range(workers):
            _push(opt, x, 0.5 * pulled[w])
            pulled[w] = x.clone()
        norms.append(float(x.abs()))
    return norms


def test_delayed_nesterov_tames_stale_pushes_that_break_plain_nesterov():
    """Why DN exists, and why a short run may want a smaller outer momentum (docs/async.md)."""
    plain = _round_robin_on_a_quadratic(buffer_size=1, momentum=0.9)
    delayed = _round_robin_on_a_quadratic(buffer_size=4, momentum=0.9)
    delayed_low_momentum = _round_robin_on_a_quadratic(buffer_size=4, momentum=0.5)
    assert plain[-1] > 1e6  # a full momentum step on every stale push: diverges
    assert max(delayed) < 1.0 and delayed[-1] > 1e-2  # bounded, but still oscillating after 40 rounds
    assert delayed_low_momentum[-1] < 1e-4  # converges


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lr=0.0), "`lr` must be a finite number > 0, got 0.0"),
        (dict(lr=1.0, momentum=1.0), r"`momentum` must be a number in \[0, 1\), got 1.0"),
        (dict(lr=1.0, momentum=-0.1), "`momentum`"),
        (dict(lr=1.0, buffer_size=0), "buffer_size"),
        (dict(lr=1.0, buffer_size=4, momentum_activation=0.3), "momentum_activation"),
        (dict(lr=1.0, momentum_activation=-0.1), "momentum_activation"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DelayedNesterov([torch.zeros(1)], **kwargs)
