"""benchmarks/sharpness_probe.py: the power iteration and the thresholds, against hand-computed values."""

import math

import pytest
import torch

from benchmarks.sharpness_probe import ProbeArgs, adam_scale, probe_run, threshold, top_eigenvalue


def _quadratic(matrix: list[list[float]]) -> tuple[callable, list[torch.Tensor]]:
    """``0.5 xᵀAx`` over ``x`` split into two parameter tensors (the first entry, then the rest): its Hessian is
    ``A`` whatever ``x`` is."""
    a = torch.tensor(matrix, dtype=torch.float64)
    x0 = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    x1 = torch.tensor([-0.2] * (len(matrix) - 1), dtype=torch.float64, requires_grad=True)

    def loss() -> torch.Tensor:
        x = torch.cat([x0, x1])
        return 0.5 * x @ a @ x

    return loss, [x0, x1]


def test_top_eigenvalue_of_a_known_hessian():
    # [[2, 1], [1, 2]] has eigenvalues 3 and 1 (eigenvectors (1, 1) and (1, -1)); the third axis has 0.5
    loss, params = _quadratic([[2.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 0.5]])
    eig = top_eigenvalue(loss, params, iters=100, tol=1e-12)
    assert eig.value == pytest.approx(3.0, rel=1e-9)
    assert eig.iterations < 100  # converged before the cap: 1/3 per step
    quick = top_eigenvalue(loss, params, iters=20, tol=1e-3)  # the probe's defaults reach it within 0.1 %
    assert quick.value == pytest.approx(3.0, rel=1e-3) and quick.rel_change < 1e-3


def test_top_eigenvalue_is_the_most_positive_even_where_a_negative_one_is_larger():
    # eigenvalues 3, 1, -6: plain power iteration finds -6; the shifted second run must find 3
    loss, params = _quadratic([[3.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -6.0]])
    eig = top_eigenvalue(loss, params, iters=200, tol=1e-12)
    assert eig.value == pytest.approx(3.0, rel=1e-8)


def test_scaled_eigenvalue_is_that_of_the_preconditioned_hessian():
    # H = diag(2, 8, 1), S = diag(1, 0.5, 2): S H S = diag(2, 2, 4), so λ(P⁻¹H) with P⁻¹ = S² is 4 (not H's 8)
    loss, params = _quadratic([[2.0, 0.0, 0.0], [0.0, 8.0, 0.0], [0.0, 0.0, 1.0]])
    scale = [torch.tensor([1.0], dtype=torch.float64), torch.tensor([0.5, 2.0], dtype=torch.float64)]
    assert top_eigenvalue(loss, params, iters=200, tol=1e-12, scale=scale).value == pytest.approx(4.0, rel=1e-8)


def test_thresholds():
    assert threshold("sgd", 0.1) == pytest.approx(38.0)  # 2 (1 + 0.9) / 0.1
    assert threshold("adamw", 0.01) == pytest.approx(3800.0)  # (2 + 1.8) / (0.1 × 0.01)
    with pytest.raises(ValueError, match="optimizer='prodigy'"):
        threshold("prodigy", 1.0)


def test_adam_scale_after_one_step():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.AdamW([p], lr=0.1, eps=1e-8)
    assert adam_scale(opt, [p]) is None  # no state before the first step
    p.grad = torch.tensor([0.25, -4.0])
    opt.step()
    # after one step v̂ = g², so P^-1/2 = 1 / sqrt(|g| + eps)
    assert adam_scale(opt, [p])[0].tolist() == pytest.approx([2.0, 0.5], rel=1e-6)


def test_probe_run_records_r_as_lambda_over_the_threshold():
    args = ProbeArgs(steps=4, every=2, batch=16, sharp_items=32, iters=5, tol=1e-3)
    run = probe_run("tabular_small", "sgd", 0.01, 0, args)
    assert [row["step"] for row in run["rows"]] == [0, 2, 4]
    for row in run["rows"]:
        assert row["r"] == pytest.approx(row["lam"] * 0.01 / 3.8)
        assert math.isfinite(row["test"]) and 1 <= row["iters"] <= 10
    assert run["final_test"] == run["rows"][-1]["test"]


def test_probe_run_switch_multiplies_the_lr_and_r_follows_it():
    args = ProbeArgs(steps=4, every=2, batch=16, sharp_items=32, iters=5, tol=1e-3)
    run = probe_run("tabular_small", "sgd", 0.01, 0, args, switch=(2, 3.0))
    plain = probe_run("tabular_small", "sgd", 0.01, 0, args)
    assert run["rows"][1]["lam"] == pytest.approx(plain["rows"][1]["lam"])  # the same weights at the switch
    assert [row["r"] * 3.8 / row["lam"] for row in run["rows"]] == pytest.approx([0.01, 0.03, 0.03])
    assert run["rows"][2]["lam"] != pytest.approx(plain["rows"][2]["lam"])  # two steps at 3x moved the weights
