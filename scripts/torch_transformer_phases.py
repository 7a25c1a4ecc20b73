"""PyTorch's twin of benches/transformer_phases.rs: the transformer_ddp model's training step by
phase, and each layer alone (forward, and the backward of sum(layer(x) * g)), medians after 3
warm-up runs, printed as `torch NAME FWD_SECONDS BWD_SECONDS` lines for the Rust bench.

    python3 scripts/torch_transformer_phases.py --threads 2
"""
import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from torch_transformer_bench import Transformer, VOCAB, SEP  # noqa: E402


def timed(steps, f):
    for _ in range(3):
        f()
    t = []
    for _ in range(steps):
        start = time.perf_counter()
        f()
        t.append(time.perf_counter() - start)
    return statistics.median(t)


def layer(steps, x, grad_x, fn):
    x = x.detach().requires_grad_(grad_x)
    g = torch.rand_like(fn(x)) * 2 - 1

    def fwd():
        with torch.no_grad() if not grad_x else torch.enable_grad():
            fn(x)

    def both():
        (fn(x) * g).sum().backward()

    f = timed(steps, lambda: fn(x))
    fb = timed(steps, both)
    return f, max(fb - f, 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in [("--layers", 2), ("--dim", 64), ("--heads", 4), ("--digits", 8),
                          ("--batch", 32), ("--steps", 30), ("--threads", 1)]:
        ap.add_argument(flag, type=int, default=default)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    b, t, d = a.batch, 2 * a.digits, a.dim
    digits = torch.randint(0, 10, (b, a.digits))
    tokens = torch.cat([digits, torch.full((b, 1), SEP), digits.sort(dim=1).values], dim=1)
    inputs, answers = tokens[:, :-1], tokens[:, a.digits + 1:]

    def loss_of(logits):
        n, length = answers.shape
        return F.cross_entropy(logits[:, length:2 * length].reshape(n * length, VOCAB),
                               answers.reshape(-1))

    model = Transformer(a.layers, a.dim, a.heads, t)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    fwd = timed(a.steps, lambda: loss_of(model(inputs)))
    both = timed(a.steps, lambda: loss_of(model(inputs)).backward())
    step = timed(a.steps, opt.step)
    out = {"step: forward + loss": (fwd, 0.0), "step: backward": (max(both - fwd, 0.0), 0.0),
           "step: AdamW": (step, 0.0)}

    x = torch.randn(b, t, d)
    tok, pos = nn.Embedding(VOCAB, d), nn.Embedding(t, d)
    positions = torch.arange(t)
    out["embeddings"] = layer(a.steps, inputs, False, lambda ids: tok(ids) + pos(positions))
    ln = nn.LayerNorm(d)
    out["layer_norm"] = layer(a.steps, x, True, ln)
    qkv = nn.Linear(d, 3 * d)
    out["qkv linear"] = layer(a.steps, x, True, qkv)
    mask = torch.full((t, t), float("-inf")).triu(1)

    def core(q):
        hd = d // a.heads
        q_, k_, v_ = q.reshape(b, t, 3, a.heads, hd).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q_ @ k_.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        return (att @ v_).transpose(1, 2).reshape(b, t, d)

    out["attention core"] = layer(a.steps, torch.randn(b, t, 3 * d), True, core)
    proj = nn.Linear(d, d)
    out["proj linear"] = layer(a.steps, x, True, proj)
    fc1 = nn.Linear(d, 4 * d)
    out["fc1 linear + gelu"] = layer(a.steps, x, True, lambda x: F.gelu(fc1(x)))
    out["gelu (of fc1's output)"] = layer(a.steps, torch.randn(b, t, 4 * d), True, F.gelu)
    fc2 = nn.Linear(4 * d, d)
    out["fc2 linear"] = layer(a.steps, torch.randn(b, t, 4 * d), True, fc2)
    head = nn.Linear(d, VOCAB)
    out["head + loss"] = layer(a.steps, x, True, lambda x: loss_of(head(x)).unsqueeze(0))
    for name, (f, bw) in out.items():
        print(f"torch {name} {f:.7f} {bw:.7f}")


if __name__ == "__main__":
    main()
