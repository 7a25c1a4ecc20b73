"""PyTorch's twin of `cargo bench --bench mlp_phases`: the 25.2 M-parameter MLP (1024 -> 4096 ->
4096 -> 1024, ReLU, cross-entropy, SGD lr 0.01 momentum 0.9), its forward with the loss, backward
and SGD step timed apart, medians over --steps after 3 warm-up runs. Prints
`torch FORWARD BACKWARD STEP` in seconds.

    python3 scripts/torch_mlp_phases.py --batch 64 --steps 10 --threads 1
"""
import argparse
import statistics
import time

import torch
from torch import nn


def timed(steps, f):
    for _ in range(3):
        f()
    t = []
    for _ in range(steps):
        started = time.perf_counter()
        f()
        t.append(time.perf_counter() - started)
    return statistics.median(t)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--matmul-precision", choices=["highest", "medium"], default="highest")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_float32_matmul_precision(a.matmul_precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                          nn.Linear(4096, 1024))
    x = torch.randn(a.batch, 1024)
    y = torch.arange(a.batch) % 1024
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def forward():
        loss_fn(model(x), y)

    def both():
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    fwd = timed(a.steps, forward)
    bwd = timed(a.steps, both) - fwd
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    step = timed(a.steps, opt.step)
    print(f"torch {fwd} {max(bwd, 0.0)} {step}")


if __name__ == "__main__":
    main()
