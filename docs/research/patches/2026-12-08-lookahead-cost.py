"""Cost of the lookahead's scoring against inner steps on async_typed's char LM (one process, one thread)."""
import argparse, time, sys
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
import torch
torch.set_num_threads(1)
import common

p = argparse.ArgumentParser(); common.add_run_args(p); common.add_start_method_arg(p)
p.add_argument("--block-size", type=int, default=64); p.add_argument("--held-out", action="store_true")
p.add_argument("--steps", type=int, default=200); p.add_argument("--quick", action="store_true"); p.add_argument("--world-size", type=int, default=4); p.add_argument("--seeds", type=int, default=1)
args = p.parse_args([]); common.fill_run_defaults(args)
from dataclasses import replace
spec = replace(common.run_spec(args, 1e-2, weight_decay=0.1, scheduler="cosine", warmup_steps=20), block_size=64)
model, data = common.build_workload(spec)
data.setup("fit")
train = iter(data.train_dataloader()); val = iter(data.val_dataloader())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
tb = [next(train) for _ in range(30)]; vb = [next(val) for _ in range(8)]
def step(b):
    opt.zero_grad(); loss = model.training_step(b, 0); loss = loss["loss"] if isinstance(loss, dict) else loss
    loss.backward(); opt.step()
model.train()
for b in tb[:5]: step(b)
t = time.process_time(); [step(b) for b in tb[5:]]; t_step = (time.process_time() - t) / 25
model.eval()
with torch.no_grad():
    t = time.process_time()
    for _ in range(3):
        for b in vb: model.validation_step(b, 0)
    t_score = (time.process_time() - t)
print(f"spec {spec}")
print(f"inner step {t_step*1e3:.1f} ms CPU; one lookahead (3 candidates x 8 batches) {t_score*1e3:.1f} ms CPU "
      f"= {t_score/t_step:.2f} inner steps")
