"""candle_parallel::amp::GradScaler against torch.amp.GradScaler on the CPU: the same parameter,
optimizer, loss and overflow schedule; every step's decision (stepped or skipped), scale and
parameter must agree.

    python3 scripts/torch_grad_scaler_check.py                 # needs torch (pip install torch)
    python3 scripts/torch_grad_scaler_check.py --binary target/debug/examples/grad_scaler_twin

Runs `cargo run --example grad_scaler_twin` (or the --binary given) on a few schedules and
prints each case's verdict; exits non-zero when a line differs (parameters within 1e-6).
"""
import argparse
import math
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (steps, growth interval, overflowing steps)
CASES = [(12, 3, [2, 3, 7]), (30, 4, []), (20, 2, [1, 2, 3, 4, 5, 11]), (8, 2000, [4])]


def torch_lines(steps, interval, overflows):
    w = torch.tensor([0.5, -1.5], requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=interval)
    x = torch.tensor([0.25, 2.0])
    lines = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        factor = math.inf if step in overflows else 1.0
        loss = ((w * x) ** 2).sum() * factor
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        stepped = not (scaler.get_scale() < before)
        v = w.detach().tolist()
        lines.append((step, stepped, scaler.get_scale(), v[0], v[1]))
    return lines


def parse(line):
    words = line.split()
    return (int(words[1].rstrip(":")), words[3] == "true", float(words[5]), float(words[7]), float(words[8]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", help="the built grad_scaler_twin example")
    args = p.parse_args()
    run = [args.binary] if args.binary else ["cargo", "run", "-q", "--example", "grad_scaler_twin", "--"]
    failed = False
    for steps, interval, overflows in CASES:
        out = subprocess.run(
            run + [str(steps), str(interval), ",".join(map(str, overflows))],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout
        ours = [parse(l) for l in out.strip().splitlines()]
        theirs = torch_lines(steps, interval, overflows)
        bad = [
            (a, b) for a, b in zip(ours, theirs)
            if a[:3] != b[:3] or abs(a[3] - b[3]) > 1e-6 or abs(a[4] - b[4]) > 1e-6
        ]
        ok = not bad and len(ours) == len(theirs)
        failed |= not ok
        print(f"{steps} steps, growth every {interval}, overflows at {overflows}: "
              f"{'same' if ok else 'DIFFERENT'} (final scale {ours[-1][2]} vs {theirs[-1][2]})")
        for a, b in bad[:3]:
            print(f"  ours {a}\n  torch {b}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
