"""PyTorch's optimizer step over the 25.2 M parameters of benches/optimizer_step.rs's shape.

Four f32 matrices of 2048 x 3072 with fixed gradients; 3 warm-up steps, then --steps timed
steps, the median printed as `torch NAME SECONDS` lines for the Rust bench:

    python3 scripts/torch_optimizer_bench.py --steps 10 --threads 2
"""
import argparse
import statistics
import time

import torch

SHAPE = (2048, 3072)
MATRICES = 4


def timed(opt, steps):
    for _ in range(3):
        opt.step()
    t = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        t.append(time.perf_counter() - start)
    return statistics.median(t)


def params():
    ps = []
    for i in range(MATRICES):
        p = torch.nn.Parameter((torch.rand(SHAPE) * 2 - 1) * 0.1 + i * 0.01)
        p.grad = 2 * p.detach().clone()
        ps.append(p)
    return ps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with torch.no_grad():
        for foreach in (False, True):
            name = "foreach" if foreach else "for-loop"
            opt = torch.optim.AdamW(params(), lr=1e-3, weight_decay=0.01, foreach=foreach)
            print(f"torch AdamW ({name}) {timed(opt, a.steps):.6f}")
            opt = torch.optim.SGD(params(), lr=0.01, momentum=0.9, foreach=foreach)
            print(f"torch SGD momentum ({name}) {timed(opt, a.steps):.6f}")


if __name__ == "__main__":
    main()
