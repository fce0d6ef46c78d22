"""HDET, DiLoCo and async Local-SGD in a Lightning Fabric training loop (CPU, well under a minute).

A small regression network; each process is one data-parallel replica (gloo on CPU).

    python examples/fabric_loop.py                          # HDET: groups at different LRs vote every 25 steps
    python examples/fabric_loop.py --strategy diloco        # DiLoCo: rounds of local steps, one outer step each
    python examples/fabric_loop.py --strategy async_local_sgd
"""

import argparse
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet import HDETLoop


def make_data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3] + 0.05 * torch.randn(2048, 1, generator=g)
    return TensorDataset(x[:1792], y[:1792]), TensorDataset(x[1792:], y[1792:])


def batches(loader):
    """The training batches, epoch after epoch."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train_hdet(fabric, model, optimizer, loader, args) -> None:
    # The Trainer's defaults: vote=PBT(), a search over the strategy's grid ending a quarter into max_steps, ...
    hdet = HDETLoop(fabric, every_n_steps=args.every, max_steps=args.steps)
    for step, (x, y) in zip(range(args.steps), batches(loader)):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()  # at this group's learning rate
        optimizer.zero_grad()
        hdet.step(loss)  # every `every` steps: the groups vote, LRs move, parameters are merged
    hdet.finish()  # every rank now holds the merged model
    fabric.print(f"{'step':>6} {'group':>5} {'lr':>10} {'loss':>8} {'winner':>6} rescued")
    for row in hdet.history:
        fabric.print(f"{row['step']:>6} {row['group']:>5} {row['lr']:>10.3g} {row['loss']:>8.4f} "
                     f"{row['winner']:>6} {row['rescued']}")
    fabric.save(Path(args.out) / "fabric_hdet.ckpt", {"model": model, "optimizer": optimizer, "hdet": hdet})


def train_async(fabric, model, optimizer, loader, args) -> None:
    strategy = fabric.strategy
    with strategy.training(max_steps=args.steps):  # a sample budget: steps x processes inner steps in all
        for x, y in batches(loader):
            if strategy.should_stop:
                break
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()  # exchanges with the outer optimizer at the end of this worker's round
            optimizer.zero_grad()
        fabric.print(f"outer updates: {strategy.outer_updates}")
    fabric.save(Path(args.out) / f"fabric_{args.strategy}.ckpt", {"model": model})  # the global model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("hdet", "diloco", "async_local_sgd"), default="hdet")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25, help="HDET: steps between votes")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy)  # names lightning_hdet registers
    fabric.launch()
    fabric.seed_everything(0)
    train_set, val_set = make_data()
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=32, shuffle=True))
    (train_hdet if args.strategy == "hdet" else train_async)(fabric, model, optimizer, loader, args)
    with torch.no_grad():
        x, y = val_set.tensors
        fabric.print(f"final model val_loss {nn.functional.mse_loss(model(x), y).item():.4f}")


if __name__ == "__main__":
    main()
