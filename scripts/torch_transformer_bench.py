"""PyTorch twin of examples/transformer_ddp.rs: the same transformer, task and batch.

    pip install torch safetensors numpy

One-step parity. The Rust example writes its initial weights, its first batch, the loss and
every gradient to one safetensors file (names `param.NAME`, `grad.NAME`, `tokens`, `answers`,
`loss`, and `config` = [layers, dim, heads, digits]); this script loads the weights into the
same model written in PyTorch, redoes the forward and backward on that batch, and compares the
loss and each gradient (pass: max |difference| <= 1e-5 x max(1, max |candle's value|)):

    cargo run --release --example transformer_ddp -- --cpu --dump-step /tmp/step.safetensors
    python3 scripts/torch_transformer_bench.py --parity /tmp/step.safetensors

`--matmul-precision medium` sets torch.set_float32_matmul_precision("medium") and the example's
`--matmul-precision medium` (f32 models whose products may round their operands to bf16).

Training speed, side by side: tokens/s of training steps (forward, loss, backward, AdamW) on
one batch, PyTorch with 1 and 2 threads, and with --rust the example's `--time-steps` for
candle with the same threads (RAYON_NUM_THREADS), same model flags and batch (`--precision
bf16`: PyTorch under `torch.autocast`, candle's DDP on one process with bf16 compute):

    python3 scripts/torch_transformer_bench.py --speed \
        --rust target/release/examples/transformer_ddp [--layers 2 --dim 64 --heads 4]
    python3 scripts/torch_transformer_bench.py --device cuda   # PyTorch on the GPU (--speed is
                                                               # the default without --parity)

The model (see examples/common/transformer.rs): token and learned position embeddings, pre-norm
blocks (LayerNorm, causal multi-head attention from one qkv projection, an MLP 4x wide with
exact GELU), a final LayerNorm and a linear head; variable names as candle's. The task: 8
random digits, a separator (10), the digits sorted; the loss is the mean cross-entropy of the
answer positions. Reports; the parity check exits 1 when it fails.
"""
import argparse
import math
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEP = 11, 10


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x, mask):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        att = torch.softmax(scores + mask, dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim)

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, layers, dim, heads, max_len):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, dim)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        mask = torch.full((t, t), float("-inf"), device=tokens.device).triu(1)
        for block in self.h:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def sort_loss(logits, answers):
    """Mean cross-entropy of the answer positions (the separator and the answer digits)."""
    n = answers.shape[1]
    return F.cross_entropy(logits[:, n:2 * n].reshape(-1, VOCAB), answers.reshape(-1))


def parity(path):
    from safetensors.torch import load_file

    dump = load_file(path)
    layers, dim, heads, digits = (int(v) for v in dump["config"])
    model = Transformer(layers, dim, heads, 2 * digits)
    params = {k[len("param."):]: v for k, v in dump.items() if k.startswith("param.")}
    model.load_state_dict(params, strict=True)
    loss = sort_loss(model(dump["tokens"]), dump["answers"])
    loss.backward()

    def close(ours, theirs):
        diff = (ours - theirs).abs().max().item()
        return diff, diff <= 1e-5 * max(1.0, theirs.abs().max().item())

    print(f"one-step parity, {layers} layers, dim {dim}, {heads} heads, batch "
          f"{dump['tokens'].shape[0]} x {dump['tokens'].shape[1]} tokens, PyTorch {torch.__version__}")
    diff, ok = close(loss.detach(), dump["loss"])
    print(f"  loss: candle {dump['loss'].item():.7f}, PyTorch {loss.item():.7f}, |diff| {diff:.2e}")
    failures = [] if ok else ["loss"]
    worst = ("", 0.0)
    for name, p in model.named_parameters():
        theirs = dump[f"grad.{name}"]
        diff, ok = close(p.grad, theirs)
        if not ok:
            failures.append(f"{name} ({diff:.2e})")
        if diff >= worst[1]:
            worst = (name, diff)
    n = sum(1 for _ in model.parameters())
    print(f"  gradients: {n} compared, largest |diff| {worst[1]:.2e} ({worst[0]})")
    if failures:
        print(f"  FAILED (over 1e-5): {', '.join(failures)}")
        sys.exit(1)
    print("  PASSED: loss and every gradient within 1e-5")


def sort_batch(n, digits, device, generator):
    x = torch.randint(0, 10, (n, digits), generator=generator)
    y = x.sort(dim=1).values
    sep = torch.full((n, 1), SEP)
    return torch.cat([x, sep, y[:, :-1]], 1).to(device), y.to(device)


def torch_tokens_per_s(a, threads):
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(a.matmul_precision)
    device = torch.device(a.device)
    torch.manual_seed(0)
    model = Transformer(a.layers, a.dim, a.heads, 2 * a.digits).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    tokens, answers = sort_batch(a.batch_size, a.digits, device, torch.Generator().manual_seed(0))

    # Mixed precision as torch users write it: the forward (and so the backward) under autocast,
    # f32 weights and AdamW; no scaler for bf16.
    dtype = {"bf16": torch.bfloat16, "f32": None}[a.precision]

    def step():
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = sort_loss(model(tokens), answers)
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    loss.item()  # waits for the device
    return a.steps * tokens.numel() / (time.perf_counter() - start)


def candle_tokens_per_s(a, threads):
    cmd = [a.rust, "--time-steps", str(a.steps), "--layers", str(a.layers), "--dim", str(a.dim),
           "--heads", str(a.heads), "--digits", str(a.digits), "--batch-size", str(a.batch_size),
           "--precision", a.precision, "--matmul-precision", a.matmul_precision]
    if a.device == "cpu":
        cmd.append("--cpu")
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    found = re.search(r"candle: (\d+) tokens/s", out.stdout)
    if not found:
        raise RuntimeError(f"no tokens/s line from {cmd}:\n{out.stdout}\n{out.stderr}")
    return float(found.group(1))


def speed(a):
    params = sum(p.numel() for p in Transformer(a.layers, a.dim, a.heads, 2 * a.digits).parameters())
    print(f"training tokens/s: {a.layers} layers, dim {a.dim}, {a.heads} heads ({params:,} "
          f"parameters), batch {a.batch_size} x {2 * a.digits} tokens, AdamW, {a.steps} steps "
          f"after 3, {a.precision}, matmul precision {a.matmul_precision}, on {a.device}; "
          f"PyTorch {torch.__version__}")
    print(f"{'threads':>7} {'PyTorch':>10} {'candle':>10} {'candle/PyTorch':>15}")
    for threads in (1, 2) if a.device == "cpu" else (1,):
        t = torch_tokens_per_s(a, threads)
        if a.rust:
            c = candle_tokens_per_s(a, threads)
            print(f"{threads:>7} {t:>10.0f} {c:>10.0f} {c / t:>14.2f}x")
        else:
            print(f"{threads:>7} {t:>10.0f} {'(--rust)':>10} {'-':>15}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parity", metavar="FILE", help="check the step transformer_ddp --dump-step wrote")
    p.add_argument("--speed", action="store_true",
                   help="training tokens/s side by side (the default without --parity)")
    p.add_argument("--rust", metavar="EXE", help="the transformer_ddp binary, for candle's numbers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--digits", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                   help="bf16: torch.autocast against the example's DDP on one process with "
                        "MixedPrecision::bf16() (f32 weights and AdamW in both)")
    p.add_argument("--matmul-precision", choices=["highest", "medium"], default="highest",
                   help="medium: f32 products may round their operands to bf16, "
                        "torch.set_float32_matmul_precision and the example's "
                        "--matmul-precision (AMX tiles where the CPU has them)")
    a = p.parse_args()
    if not a.parity:
        a.speed = True  # the default: what runs without a file from the Rust side
    if a.parity:
        parity(a.parity)
    if a.speed:
        speed(a)


if __name__ == "__main__":
    main()
