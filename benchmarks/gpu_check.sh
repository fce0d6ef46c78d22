#!/usr/bin/env bash
# GPU check (one GPU, no network, PyTorch + Lightning preinstalled; run from the repository root, about 10 min; the first run, on an H200, passed 500 s):
# run the quick benchmarks twice, on CPU and with CUDA tensors (several processes sharing cuda:0 over gloo,
# since NCCL needs one GPU per rank; the two halves run side by side), check that they agree, and keep both
# sets of JSON and the step times; then HDET's per-step path on the GPU over NCCL (benchmarks/sync_check.py:
# synchronising CUDA calls per step and steps/s against DDP, float32 and bf16-mixed); with 2 GPUs, also HDET
# vs DDP steps/s over NCCL (one process per GPU); and a 2 x k run of workers of several ranks (async and DiLoCo),
# DDP and FSDP2 inside.
#   usage: bash benchmarks/gpu_check.sh [OUT_DIR]      (default: $OUT, else ./gpu_check_out)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"
"$PY" -c "import torch, lightning; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(0))" \
  | tee "$OUT_DIR/versions.txt"

run() {  # run <accelerator> <script> [args...]
  local acc=$1 script=$2; shift 2
  local dir="$OUT_DIR/$acc"
  mkdir -p "$dir/docs"
  BENCH_ACCELERATOR=$acc timeout 300 "$PY" "benchmarks/$script.py" --quick "$@" \
    --results-dir "$dir" --docs-dir "$dir/docs" > "$dir/$script.log" 2>&1 \
    || { echo "$acc $script failed:"; tail -30 "$dir/$script.log"; return 1; }
  echo "$acc $script ok"
}

half() {  # the three quick benchmarks on one accelerator
  run "$1" hdet_published --arms ddp_low hdet_full && run "$1" async_published --levels very --methods diloco \
    async_dn_dylu && run "$1" overhead
}
half cpu & cpu_half=$!
cuda_rc=0; half cuda || cuda_rc=$?
cpu_rc=0; wait "$cpu_half" || cpu_rc=$?

# HDET's per-step path on the GPU over NCCL (one rank): no synchronising call per step beyond DDP's, steps/s.
sync_rc=0
timeout 300 "$PY" benchmarks/sync_check.py --out "$OUT_DIR/sync" --repeats 2 > "$OUT_DIR/sync_check.log" 2>&1 \
  || sync_rc=$?
grep -E '^[|]|HDET adds|sync_check' "$OUT_DIR/sync_check.log" || tail -30 "$OUT_DIR/sync_check.log"

# HDET vs DDP steps/s over NCCL (T = 100): NCCL needs one GPU per rank, so this needs 2 GPUs.
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  mkdir -p "$OUT_DIR/nccl/docs"
  BENCH_ACCELERATOR=cuda BENCH_BACKEND=nccl timeout 300 "$PY" benchmarks/overhead.py --parts throughput \
    --intervals 100 --steps 300 --repeats 2 --results-dir "$OUT_DIR/nccl" --docs-dir "$OUT_DIR/nccl/docs" \
    > "$OUT_DIR/nccl/overhead.log" 2>&1 && echo "nccl overhead ok" || { echo "nccl overhead failed:"; tail -30 "$OUT_DIR/nccl/overhead.log"; }
else
  echo "nccl overhead skipped: HDET vs DDP over NCCL needs 2 GPUs (one per rank); the cuda run above shares one over gloo"
fi

# Workers of several ranks (issue 42): 2 workers x k ranks (DDP inside each worker) against 2k one-rank workers and
# DDP, async and DiLoCo. With >= 4 GPUs over NCCL, one GPU per rank (k = GPUs / 2, one "node" each); otherwise 2 x 2
# with every rank on cuda:0 over gloo (the DDP inside a worker then runs over gloo on CUDA tensors).
ranks_rc=0
n_gpu="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$n_gpu" -ge 4 ]; then ranks_env="BENCH_BACKEND=nccl"; k=$((n_gpu / 2)); else ranks_env="BENCH_BACKEND=gloo"; k=2; fi
env BENCH_ACCELERATOR=cuda $ranks_env timeout 300 "$PY" benchmarks/worker_ranks.py --quick --seeds 0 \
  --ranks-per-worker "$k" --out "$OUT_DIR/worker_ranks.json" > "$OUT_DIR/worker_ranks.log" 2>&1 || ranks_rc=$?
grep -E '^[|]|^seed' "$OUT_DIR/worker_ranks.log" || tail -30 "$OUT_DIR/worker_ranks.log"
[ "$ranks_rc" -eq 0 ] && echo "worker_ranks 2 x $k ok ($ranks_env)" || echo "worker_ranks 2 x $k failed (rc $ranks_rc)"
# The same 2 x k with FSDP2 inside each worker (inside_worker="fsdp"); on one GPU its collectives run over gloo on
# CUDA tensors, which this records whether FSDP2's reduce-scatter supports.
fsdp_rc=0
env BENCH_ACCELERATOR=cuda $ranks_env timeout 300 "$PY" benchmarks/worker_ranks.py --quick --seeds 0 --ranks-per-worker \
  "$k" --inside-worker fsdp --arms "async ranks" "diloco ranks" --out "$OUT_DIR/worker_ranks_fsdp.json" \
  > "$OUT_DIR/worker_ranks_fsdp.log" 2>&1 || fsdp_rc=$?
grep -E '^[|]|^seed' "$OUT_DIR/worker_ranks_fsdp.log" || tail -30 "$OUT_DIR/worker_ranks_fsdp.log"
[ "$fsdp_rc" -eq 0 ] && echo "worker_ranks 2 x $k fsdp ok ($ranks_env)" || echo "worker_ranks 2 x $k fsdp failed (rc $fsdp_rc)"

"$PY" - "$OUT_DIR" <<'EOF'
"""Compare the CPU and CUDA quick runs: same final losses (up to kernel differences), and the step times."""
import json, math, sys
from pathlib import Path

out = Path(sys.argv[1])
load = lambda acc, name: json.loads((out / acc / f"{name}_quick.json").read_text())
ok = True
for name, key in (("hdet_published", "name"), ("async_published", "method")):
    for cpu, gpu in zip(load("cpu", name)["rows"], load("cuda", name)["rows"]):
        a, b = cpu["final_val_loss"], gpu["final_val_loss"]
        # async runs are not deterministic (arrival order), so they get a looser tolerance
        tol = 0.05 if name == "hdet_published" else 0.3
        agree = (not math.isfinite(a) and not math.isfinite(b)) or abs(a - b) <= tol * max(1.0, abs(a))
        ok &= agree
        print(f"{name:16s} {cpu[key]:24s} cpu {a:.4f} cuda {b:.4f} {'agree' if agree else 'DIFFER'}")
for acc in ("cpu", "cuda"):
    for row in load(acc, "overhead")["throughput"]:
        print(f"overhead {acc:4s} {row['arm']:12s} {row['steps_per_s']:.2f} steps/s ({row['relative_to_ddp']:.3f} x ddp)")
nccl = out / "nccl" / "overhead_throughput.json"
if nccl.exists():
    data = json.loads(nccl.read_text())
    for row in data["throughput"]:
        runs = " / ".join(f"{x:.2f}" for x in data["raw_speed"][row["arm"]])
        print(f"overhead nccl {row['arm']:12s} {row['steps_per_s']:.2f} steps/s ({row['relative_to_ddp']:.3f} x ddp; "
              f"repeats {runs})")
sys.exit(0 if ok else 1)
EOF
exit $(( cpu_rc || cuda_rc || sync_rc || ranks_rc || fsdp_rc ))
