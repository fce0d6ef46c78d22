"""The async, elastic and communication benchmarks at their quick settings (split from test_benchmarks_quick.py
so that the two pytest workers, which each run whole files, share the benchmarks' start-ups)."""

import math

import pytest

from tests.bench_quick import run_quick


@pytest.mark.timeout(360)
def test_async_published_quick_mode(tmp_path):
    from benchmarks.async_published import LEVELS, PUBLISHED

    methods = ["diloco", "async_dn_dylu"]
    data, table, _ = run_quick(tmp_path, "async_published", "--levels", "very", "--methods", *methods,
                               "--start-method", "fork")
    cfg = data["config"]
    rows = data["rows"]
    assert [(r["level"], r["method"]) for r in rows] == [("very", m) for m in methods]
    diloco, dylu = rows
    assert diloco["target"] == diloco["val_curve"][-1][1] == dylu["target"]
    assert diloco["s_to_target"] is not None  # DiLoCo reaches its own final loss
    for r in rows:
        assert math.isfinite(r["final_val_loss"]) and r["final_val_loss"] < math.log(256)
        # The budget is W x S inner steps in all, however the workers' speeds split it.
        assert sum(r["inner_steps"].values()) == cfg["world_size"] * cfg["steps"]
    # Synchronous DiLoCo gives every worker the same rounds of H steps.
    assert len(set(diloco["inner_steps"].values())) == 1
    assert all(steps == cfg["local_steps"] * diloco["rounds"][w] for w, steps in diloco["inner_steps"].items())
    assert LEVELS["very"][-1] == pytest.approx(3.33 / 0.58)
    assert len(table) == 2 + len(methods) and all(line.count("|") == 5 for line in table)
    assert f"{PUBLISHED['diloco']['very']:.2f}" in table[2]
    assert (tmp_path / "docs" / "img" / "async_published_quick.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(600)
def test_async_published_two_workers_of_two_ranks_quick_mode(tmp_path):
    """Issue 42's 2 x 2 arm on 4 processes: DiLoCo and async with workers of two ranks beside four one-rank workers
    and DDP over the same 4, at equal samples (every rank takes S steps; a two-rank worker counts each of its steps
    once, so its workers' inner steps sum to 2 x S)."""
    methods = ["ddp", "diloco", "diloco_2ranks", "async_dn_dylu", "async_dn_dylu_2ranks"]
    data, table, _ = run_quick(tmp_path, "async_published", "--world-size", "4", "--levels", "none", "--methods",
                               *methods, "--start-method", "fork")
    cfg = data["config"]
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == methods and len(table) == 2 + len(methods)
    for method in ("diloco", "async_dn_dylu"):
        assert len(rows[method]["inner_steps"]) == 4 and len(rows[f"{method}_2ranks"]["inner_steps"]) == 2
        assert sum(rows[method]["inner_steps"].values()) == 4 * cfg["steps"]
        assert sum(rows[f"{method}_2ranks"]["inner_steps"].values()) == 2 * cfg["steps"]
    assert all(math.isfinite(r["final_val_loss"]) and r["final_val_loss"] < math.log(256) for r in rows.values())


def test_async_defaults_quick_mode(tmp_path):
    """The regression task only (three forked fits): the default outer setting and the two before it start from
    the same model, and the cells are the final ÷ initial loss."""
    data, table, _ = run_quick(tmp_path, "async_defaults", "--tasks", "regression", "--start-method", "fork")
    stable, robust, published = data["runs"]
    assert (stable["outer"], robust["outer"], published["outer"]) == ("stable", "robust", "published")
    assert stable["initial"] == robust["initial"] == published["initial"] > 0
    for run in data["runs"]:
        assert run["ratio"] == pytest.approx(run["final"] / run["initial"]) and math.isfinite(run["ratio"])
    assert table[0] == "| task | outer | very |" and f"{stable['ratio']:.3f}" in table[2]


def test_async_long_horizon_table_gives_rounds_seed_spread_and_loss_over_diloco():
    from benchmarks.async_published import horizon_table, parse_args, summarise

    args = parse_args(["--long-horizon", "--seeds", "2"])
    assert (args.levels, args.local_steps, args.seeds, args.world_size) == (["very"], 4, 2, 4)
    assert parse_args(["--long-horizon", "--quick"]).methods == ["diloco", "async_dn_dylu"]

    def run(method, seed, loss, rounds):
        curve = [(10, loss + 0.5, 1.0), (20, loss, 2.0 + seed)]
        return {"method": method, "level": "very", "seed": seed, "final_val_loss": loss, "val_curve": curve,
                "fit_s": 3.0 + seed, "inner_steps": {}, "rounds": rounds}

    rows = summarise([run("diloco", 0, 2.0, {"0": 100, "1": 100}), run("async_dn_dylu", 0, 1.9, {"0": 150, "1": 101}),
                      run("diloco", 1, 2.5, {"0": 100, "1": 100}), run("async_dn_dylu", 1, 2.4, {"0": 160, "1": 99})])
    diloco, dylu = rows
    assert diloco["vs_diloco"] == 1.0 and diloco["rounds_range"] == (100, 100)
    # per seed: 1.9 / 2.0 and 2.4 / 2.5; DiLoCo's final loss reached at 2 s (seed 0) and 3 s (seed 1)
    assert dylu["rounds_range"] == (99, 160) and dylu["final_val_loss_range"] == (1.9, 2.4)
    assert dylu["vs_diloco"] == pytest.approx(0.955) and dylu["vs_diloco_range"] == pytest.approx((0.95, 0.96))
    assert dylu["s_to_target"] == pytest.approx(2.5)
    lines = horizon_table(rows).splitlines()
    assert lines[3] == "| very | async_dn_dylu | 99–160 | 2.150 (1.900–2.400) | 0.9550 (0.9500–0.9600) | 2.5 (3.5) | 41.13 |"


# Every default part at its smallest: one repeat, tiny widths, forked ranks (13 short fits; what is asserted is
# bytes and the tables' shape, not speed or a memory level). The exchange runs keep the quick budget and widths:
# below them Lightning's fixed start-up traffic is no longer small against the bytes per step.
SMALLEST_OVERHEAD = ("--intervals", "4", "--repeats", "1", "--steps", "6", "--d-model", "16", "--batch-size", "4",
                     "--local-steps", "2", "--lean-d-model", "32", "--start-method", "fork")


@pytest.mark.timeout(600)
def test_overhead_quick_mode(tmp_path):
    data, table, _ = run_quick(tmp_path, "overhead", *SMALLEST_OVERHEAD)
    cfg = data["config"]
    assert [r["arm"] for r in data["throughput"]] == ["ddp", "hdet T=4"]
    assert data["throughput"][0]["relative_to_ddp"] == 1.0
    assert (tmp_path / "docs" / "img" / "overhead_quick.png").read_bytes()[:4] == b"\x89PNG"  # drawn and linked
    assert "](img/overhead_quick.png)" in (tmp_path / "docs" / "benchmarks.md").read_text()
    assert all(r["steps_per_s"] > 0 for r in data["throughput"])
    comm = {r["arm"]: r for r in data["bytes"]}
    h = cfg["local_steps"]
    assert list(comm) == ["ddp", "hdet T=4", f"diloco H={h}", f"async H={h}", f"diloco H={h}, inner states",
                          f"diloco H={h}, bf16", f"diloco H={h}, bf16 push and pull", f"diloco H={h}, int8",
                          f"diloco H={h}, int8 push, bf16 pull"]
    ddp = comm["ddp"]
    # DDP all-reduces the float32 gradients every step: 4 bytes per parameter (plus Lightning's few-byte flags).
    assert ddp["computed_bytes_per_step"] == 4 * ddp["params"]
    assert ddp["measured_bytes_per_step"] == pytest.approx(4 * ddp["params"], rel=1e-3)
    # HDET adds a merge every T steps (and a few bytes of votes and guards).
    hdet = comm["hdet T=4"]
    assert hdet["computed_bytes_per_step"] == pytest.approx(4 * hdet["params"] * (1 + 1 / 4))
    assert hdet["measured_bytes_per_step"] >= 4 * hdet["params"]
    # DiLoCo: one push and one pull of the model per round of H steps (the char LM has no float buffers), plus
    # small headers: the bound of two models per round; the inner states row also sends AdamW's two moments
    # with each push and the last message (the first message's are still empty).
    steps = cfg["exchange_steps"]
    diloco, inner = comm[f"diloco H={h}"], comm[f"diloco H={h}, inner states"]
    model = 4 * diloco["params"]
    assert diloco["computed_bytes_per_step"] == pytest.approx(2 * model / h)
    assert inner["computed_bytes_per_step"] == pytest.approx(2 * model / h + 2 * model * (1 / h + 1 / steps))
    for row in (diloco, inner):
        assert row["measured_bytes_per_step"] == pytest.approx(row["computed_bytes_per_step"], rel=0.05)
    assert diloco["measured_over_bound"] == pytest.approx(1.0, rel=0.05)
    # compressed pushes: bf16 halves the push, int8 quarters it (plus its scales); the pull stays float32 unless
    # pull_compression="bf16" halves it too: then a round moves half the bound
    bf16, int8 = comm[f"diloco H={h}, bf16"], comm[f"diloco H={h}, int8"]
    both, int8_bf16 = comm[f"diloco H={h}, bf16 push and pull"], comm[f"diloco H={h}, int8 push, bf16 pull"]
    assert bf16["computed_bytes_per_step"] == pytest.approx(1.5 * model / h)
    assert both["computed_bytes_per_step"] == pytest.approx(model / h)
    for row in (bf16, both):
        assert row["measured_bytes_per_step"] == pytest.approx(row["computed_bytes_per_step"], rel=0.05)
    assert int8["measured_bytes_per_step"] < bf16["measured_bytes_per_step"] < diloco["measured_bytes_per_step"]
    assert int8_bf16["measured_bytes_per_step"] < both["measured_bytes_per_step"]
    assert all(math.isfinite(row["final_val_loss"]) for row in (diloco, bf16, both, int8, int8_bf16))
    assert diloco["loss_change"] == 0.0
    assert comm[f"async H={h}"]["measured_bytes_per_step"] >= diloco["measured_bytes_per_step"] * 0.95
    small, large = data["memory"]
    assert (small["width"], large["width"]) == tuple(cfg["memory_d_models"])
    assert small["model_bytes"] == 4 * diloco["params"] < large["model_bytes"]
    for m in (small, large):
        assert set(m["rank0_peak_rss_bytes"]) == {"ddp", "diloco", "async"}
        assert all(v > m["model_bytes"] for v in m["rank0_peak_rss_bytes"].values())
    assert set(data["memory_slope"]) == {"diloco", "async"}
    # lean: rank 0's peak extra memory of a merge and of a checkpoint, DDP against HDET (G = W = 2)
    lean = {r["arm"]: r for r in data["lean"]}
    assert list(lean) == ["ddp", "hdet"] and lean["ddp"]["merge_extra_bytes"] == 0
    assert all(r["checkpoint_extra_bytes"] > 0 and r["own_state_bytes"] > r["model_bytes"] for r in lean.values())
    headers = [line for line in table if "---" not in line and ("arm" in line or "peak RSS" in line)]
    assert len(headers) == 4 and len(table) == (2 + 2) + (2 + 9) + (2 + 3) + (2 + 2)


def test_comm_bytes_table_counts_bytes_to_diloco_f32s_loss_against_ddps(tmp_path):
    """Hand-made records. The target is DiLoCo f32's final loss 2.0 + 1 % = 2.02. DDP (1 MiB a step) first
    validates below it at step 15 (2.05 at step 10 is above): 15 MiB. DiLoCo f32 (64 KiB a step) reaches it at its
    last step, 20: 1.25 MiB, 12x fewer (16x fewer a step). topk2 with topk2 pulls (1 KiB a step, 60 steps) at step 40: 40 KiB, 384x
    fewer, and ends at 1.95 / 2.0 = 0.975; topk2 pushes alone never reach it. At 1 Mbit/s int8's 2.2 is divided by
    DiLoCo f32's loss at that link."""
    import argparse

    from benchmarks.comm_bytes import plot_loss_against_bytes, table

    def run(loss: float, per_step: int, curve: list[tuple[int, float]]) -> dict:
        steps = curve[-1][0]
        return {"seeds": {0: {"loss": loss, "per_step": per_step, "bytes": per_step * steps, "curve": curve,
                              "steps": steps, "wall_s": 5.0, "fit_s": 4.0}}}

    f32 = [(5, 2.6), (10, 2.3), (15, 2.1), (20, 2.0)]
    runs = {
        "ddp @ 0": {"arm": "ddp", "link": 0.0, **run(1.5, 2**20, [(5, 2.5), (10, 2.05), (15, 1.9), (20, 1.5)])},
        "diloco f32 @ 0": {"arm": "diloco f32", "link": 0.0, **run(2.0, 2**16, f32)},
        "diloco topk2 @ 0": {"arm": "diloco topk2", "link": 0.0, **run(2.5, 2**10, [(20, 2.5)])},
        "diloco topk2 + topk2 pulls @ 0": {"arm": "diloco topk2 + topk2 pulls", "link": 0.0,
                                           **run(1.95, 2**10, [(20, 2.3), (40, 2.01), (60, 1.95)])},
        "diloco f32 @ 1e+06": {"arm": "diloco f32", "link": 1e6, **run(2.0, 2**16, f32)},
        "diloco int8 @ 1e+06": {"arm": "diloco int8", "link": 1e6, **run(2.2, 2**14, [(20, 2.2)])},
        "diloco f32 overlap @ 1e+06": {"arm": "diloco f32 overlap", "link": 1e6, **run(2.0, 2**16, f32)},
    }
    runs["diloco f32 overlap @ 1e+06"]["seeds"][0]["fit_s"] = 2.8  # 0.70 of the blocking run's 4 s in fit
    args = argparse.Namespace(links=[0.0, 1e6], workload="tabular", workers=4, steps=20, local_steps=5, lr=3e-3,
                              batch_size=16, long_factor=3, overlap_steps=2)
    rows = {line.split(" | ")[0].lstrip("| ") + " " + line.split(" | ")[1]: [c.strip(" |") for c in line.split(" | ")]
            for line in table(runs, args).splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["ddp loopback"][2:8] == ["20", "1.500", "0.75", "20.00", "1x", "1x"]
    assert rows["diloco f32 loopback"][4:8] == ["1", "1.25", "16x", "12x"]
    assert rows["diloco topk2 + topk2 pulls loopback"][2:8] == ["60", "1.950", "0.975", "0.06", "1024x", "384x"]
    assert rows["diloco topk2 loopback"][4:8] == ["1.25", "0.02", "1024x", "not reached"]
    assert rows["diloco int8 1e+06 bit/s"][4:8] == ["1.1", "0.31", "64x", "not reached"]
    assert rows["diloco f32 overlap 1e+06 bit/s"][9] == "0.70" and rows["diloco f32 1e+06 bit/s"][9] == ""
    assert "overlap τ = 2; DiLoCo's loss" in table(runs, args) and "stagger" not in table(runs, args)
    without = table({k: v for k, v in runs.items() if not k.startswith("ddp")}, args)  # no DDP arm: "—"
    assert "| diloco f32 | loopback | 20 | 2.000 | 1 | 1.25 | — | — | 5 |" in without
    runs["diloco f32 @ 0"]["seeds"][1] = runs["diloco f32 @ 0"]["seeds"][0]  # a second seed: drawn faintly
    plot = plot_loss_against_bytes(tmp_path / "img" / "comm.png", runs, args)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_outer_stability_verdict_hand_computed():
    from benchmarks.outer_stability import verdict

    assert verdict([1.0, 0.5, 0.1], 1) == {"mid": 0.5, "end": pytest.approx(0.1), "rise": pytest.approx(0.2),
                                           "stable": True}
    assert not verdict([1.0, 0.1, 0.5], 1)["stable"]  # ends below the start but rose 5x over the second half
    assert verdict([1.0, 1e-6, 5e-6], 1)["stable"]  # a rise at the floor (< 1e-4 x the start) is noise
    assert not verdict([1.0, 0.5, float("nan")], 1)["stable"] and verdict([1.0, 0.5, math.inf], 1)["end"] == math.inf


def test_outer_stability_quick_mode(tmp_path):
    """20 rounds per worker, both data orders: the real outer state runs every cell; the published outer step with
    two SGD workers has already diverged there, the default has not; each worker's whole dataset is its own."""
    data, table, _ = run_quick(tmp_path, "outer_stability", "--rounds", "20")
    runs = {(r["data"], r["task"], r["mode"], r["outer"], r["workers"]): r for r in data["runs"]}
    assert len(runs) == 2 * 2 * 2 * 3 * 3 and all(len(r["curve"]) == 21 for r in runs.values())
    assert all(runs[(d, "sgd", m, "stable", w)]["stable"] for d in ("shards", "whole") for m in ("async", "sync")
               for w in (2, 4, 8))
    assert not runs[("shards", "sgd", "sync", "published", 2)]["stable"]
    assert table[0] == "| data | inner | mode | outer | W = 2 | W = 4 | W = 8 |" and len(table) == 2 + 24
    import torch

    from benchmarks.outer_stability import Workers

    shards, own = Workers(2, "sgd", 0, "shards").shards, Workers(2, "sgd", 0, "whole").shards
    assert [len(s) for s in shards] == [32, 32] and [len(s) for s in own] == [64, 64]
    assert torch.equal(own[0][1::2], shards[1]) and not torch.equal(own[1], own[0])


def test_outer_sweep_choose_hand_computed():
    """Per mode, each setting's worst ratio to its cell's best fixed setting over the model cells; stability over
    every cell (the stability check's included, its losses in no ratio): "a" is 1.0 and 1.5x the best, "b" 1.2 and
    1.0, so "b" (worst 1.2) leads "a" (1.5) — unless "b" diverged on the stability check. A lookahead lower than
    both is measured against them, not a best itself (0.9 and 0.95). A table of one mode's cells (``--modes``) sums
    up that mode alone, with the default's and the lookahead's columns."""
    from benchmarks.outer_sweep import choose, default_label, table

    a, b, look = "0.5/0.5/on", "1/0.9/off", "0.375/0.5/on/look[0.1,1]"
    assert default_label() == "0.375/0.5/on"

    def cell(workload, fa, fb, stable_b=True, ddp=1.0, fl=None):
        runs = {a: {"final": fa, "stable": True}, b: {"final": fb, "stable": stable_b}}
        return {"cell": [workload, "adamw", 2, "async", 10], "ddp": ddp,
                "runs": {**runs, **({look: {"final": fl, "stable": True}} if fl else {})}}

    results = [cell("x", 1.0, 1.2, fl=0.9), cell("y", 3.0, 2.0, fl=1.9), cell("boring", 1e-15, 1e-3, ddp=None)]
    labels = [a, b, look]
    assert choose(results, "async", [a, b]) == [(b, pytest.approx(1.2), True), (a, pytest.approx(1.5), True)]
    assert choose(results[:2], "async", labels)[0] == (look, pytest.approx(0.95), True)
    results[-1]["runs"][b]["stable"] = False
    assert [label for label, *_ in choose(results, "async", [a, b])] == [a, b]
    lines = table(results[:2], labels, [0], 20).splitlines()
    assert lines[-1] == f"- async: `{look}` 0.95, `{b}` 1.20, `{a}` 1.50"
    assert not any("DiLoCo" in line for line in lines)
    row = next(line for line in lines if line.startswith("| x |"))
    assert row.endswith(f"| `{a}` | 1.00 | 0.90 | – | 0.90 | – |"), row  # chosen, default (absent), lookahead


def test_outer_sweep_agreement_scaled_lr_hand_computed():
    """Agreement: equal pushes 1, opposite -1, orthogonal 0. The scaled lr (base 0.4, k0 0.2, in [0.25, 4] x base):
    a DiLoCo round of equal pushes gives k = 1, scale min(4, 1 / 0.2) = 4; a cancelling round k = -1, averaged with
    the last to 0: scale 0.25. Async: a worker's first push alone changes nothing; the other's orthogonal one, k = 0."""
    from types import SimpleNamespace

    import torch

    from benchmarks.outer_sweep import AgreementLR, agreement

    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert [agreement([e1, e1]), agreement([e1, -e1]), agreement([e1, e2])] == pytest.approx([1.0, -1.0, 0.0], abs=1e-6)
    assert agreement([e1, e1, -e1]) == pytest.approx((1 - 3) / (2 * 3))  # |sum|^2 = 1, sum |g|^2 = 3

    class State:
        def __init__(self):
            self.optimizer = SimpleNamespace(param_groups=[{"lr": 0.4}])
            self.lrs = []

        def process(self, pushes):
            self.lrs.append(self.optimizer.param_groups[0]["lr"])

    def push(worker, g):
        return SimpleNamespace(worker=worker, pseudo_gradient=g)

    sync = AgreementLR(State(), 0.2, 0.25, 4.0)
    sync.process([push(0, e1), push(1, e1)])
    sync.process([push(0, e1), push(1, -e1)])
    assert sync.state.lrs == pytest.approx([1.6, 0.1])
    asynchronous = AgreementLR(State(), 0.2, 0.25, 1.0)
    asynchronous.process([push(0, e1)])
    asynchronous.process([push(1, e2)])
    assert asynchronous.state.lrs == pytest.approx([0.4, 0.1])


def test_outer_sweep_lookahead_runs_the_packages_rule_with_the_held_out_score():
    """A lookahead setting builds the package's DelayedNesterov(lookahead=LookaheadLR(low, high)), scored on the
    stability check's other inputs, and learns BoringModel's task; without a score it is refused."""
    import torch

    from benchmarks import outer_sweep
    from benchmarks.outer_stability import build_outer

    outer = outer_sweep.Outer(0.375, 0.5, "on", lookahead=(0.1, 1.0))
    assert outer.optimizer.lookahead.numbers() == {"monitor": "val_loss", "mode": "min", "batches": 8,
                                                "low": 0.1, "high": 1.0}
    run = outer_sweep.boring_run("whole", 2, "sync", outer, seed=0, rounds=20)
    assert run["stable"] and run["final"] < 0.5
    with pytest.raises(ValueError, match="needs a score"):
        build_outer(torch.zeros(3), 2, "sync", 10, outer.optimizer)


def test_outer_sweep_worker_round_is_start_minus_its_local_model():
    """A fake worker copies the global parameters in (no aliasing: the start it is given stays as it was), takes H
    inner steps, and returns start - local; its inner optimizer's state carries over to its next round."""
    import torch

    from benchmarks.outer_sweep import ModelWorkers, load_flat

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(3, (8,))
    fake = ModelWorkers(model, x, y, 2, "sgd", 0.1, 0.0, local_steps=2, seed=0)
    start = torch.zeros(15)
    delta = fake.round(0, start)
    assert torch.equal(start, torch.zeros(15)) and delta.abs().sum() > 0
    local = torch.cat([p.detach().flatten() for p in fake.models[0].parameters()])
    assert torch.equal(delta, start - local)
    assert fake.opts[0].state[next(fake.models[0].parameters())]["momentum_buffer"] is not None
    load_flat(model, start)
    start.add_(1.0)
    assert float(model.weight.abs().sum()) == 0.0  # copied, not a view of ``start``


def test_outer_sweep_char_lm_cell(monkeypatch):
    """The char LM's data are benchmark 3's blocks of the stdlib corpus: targets the inputs shifted by one byte, also
    across a block's edge; the reported and the lookahead's held-out blocks are the first and the next 256 of the
    validation split. Its inner lr warms up over S/10 of each worker's own steps, then decays to 10 % (hand-computed
    factors), each worker's on its own steps. A tiny DiLoCo run (2 workers, 2 rounds of H = 2) with the lookahead
    ends below its start."""
    import torch

    from benchmarks import outer_sweep
    from lightning_hdet.demos.corpus import load_corpus

    make, x, y, vx, vy = outer_sweep.load("char_lm")
    corpus = load_corpus()
    assert x.shape == ((corpus.train.numel() - 1) // 64, 64) and vx.shape == (256, 64)
    assert torch.equal(x[0], corpus.train[:64].long()) and torch.equal(y[0, :-1], x[0, 1:]) and y[0, -1] == x[1, 0]
    lx, ly = outer_sweep.lookahead_split("char_lm")
    assert torch.equal(vx[0], corpus.val[:64].long()) and torch.equal(lx[0], corpus.val[256 * 64:257 * 64].long())
    assert ly[0, -1] == corpus.val[257 * 64] and vy[-1, -1] == lx[0, 0]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched, lrs = outer_sweep.warmup_cosine(opt, 200), []
    for _ in range(202):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [lrs[i] for i in (0, 9, 19, 20, 110, 200, 201)] == pytest.approx([0.05, 0.5, 1.0, 1.0, 0.55, 0.1, 0.1])
    workers = outer_sweep.ModelWorkers(make(), x, y, 2, "adamw", 0.01, 0.1, 3, 0, batch=16, total_steps=100)
    workers.round(0, torch.nn.utils.parameters_to_vector(workers.models[0].parameters()).detach())
    assert [o.param_groups[0]["lr"] for o in workers.opts] == pytest.approx([0.004, 0.001])
    monkeypatch.setitem(outer_sweep.STEPS, "char_lm", 4)
    monkeypatch.setattr(outer_sweep, "CHAR_HELD_OUT", 16)  # seconds, not tens of them: 16 blocks per score
    look = outer_sweep.Outer(0.375, 0.5, "on", lookahead=(0.1, 1.0))
    run = outer_sweep.model_run("char_lm", "adamw", 2, "sync", 2, look, 0)
    assert run["stable"] and run["final"] < run["start"] and 5.0 < run["start"] < 6.5


def test_outer_sweep_quick_mode(tmp_path):
    """Two settings (the old default and the published one), two workers on the small tabular set with AdamW and
    SGD, and the stability check: every cell holds both settings; the model cells a DDP reference; the published
    step with two SGD workers on BoringModel diverges; the partial file is gone once the table is written."""
    data, table, _ = run_quick(tmp_path, "outer_sweep", "--workers", "2", "--workloads", "tabular_small", "boring")
    cells = {tuple(r["cell"]): r for r in data["results"]}
    assert len(cells) == 2 * 2 + 2 * 3 * 2
    assert all(set(r["runs"]) == {"0.163/0.9/on", "0.7/0.9/off"} for r in cells.values())
    assert all((r["ddp"] is None) == (c[0] == "boring") for c, r in cells.items())
    assert not cells[("boring", "shards", 2, "async", 8)]["runs"]["0.7/0.9/off"]["stable"]
    assert cells[("boring", "shards", 2, "async", 8)]["runs"]["0.163/0.9/on"]["stable"]
    assert table[0].startswith("| workload | inner / data | W | mode | H |") and len(table) == 2 + 16  # the three best per mode: a list
    assert not (tmp_path / "results" / "outer_sweep_quick.partial.json").exists()


@pytest.mark.timeout(300)
def test_bad_worker_paths_quick_mode(tmp_path):
    """The regression task in DiLoCo and the elastic mode: each seed's faulty run (the bad worker rejected 3 times,
    stopped), its fault-free counterpart and that run with another data order spend the whole budget; the cells
    divide by the fault-free run; DiLoCo with two workers is deterministic, so only the new order moves its
    reordered run (with the same order it lands exactly where the first did)."""
    data, table, _ = run_quick(tmp_path, "bad_worker_paths", "--tasks", "regression", "--paths", "diloco", "elastic")
    budget = data["config"]["budget"]
    assert [(r["task"], r["path"]) for r in data["runs"]] == [("regression", "diloco"), ("regression", "elastic")]
    for r in data["runs"]:
        # DiLoCo's rounds wait for every worker: the bad one is rejected exactly three times. The elastic service
        # waits for no one: on a loaded machine the healthy jobs can spend the budget before the bad one's third
        # push (seen: none of its pushes arrived), but it is never rejected more often than that before it stops.
        assert r["steps"] == [budget] * 3 and (r["rejected"] == 3 if r["path"] == "diloco" else r["rejected"] <= 3)
        assert r["ratio"] == r["faulty"] / r["clean"] and r["noise"] == r["reordered"] / r["clean"]
        assert math.isfinite(r["ratio"]) and r["faulty"] < r["initial"]
    assert data["runs"][0]["noise"] != 1.0
    assert table[0].startswith("| task | path |") and len(table) == 2 + 2 and "**" in table[2]

