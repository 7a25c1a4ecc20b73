"""Tensor parallel, side by side: examples/transformer_ddp.rs against PyTorch's
`torch.distributed.tensor.parallel` (`parallelize_module` with the same plan, over gloo).

    pip install torch
    cargo build --release --example transformer_ddp
    python3 scripts/torch_tensor_parallel_bench.py --rust target/release/examples/transformer_ddp \
        [--layers 2 --dim 256 --heads 8 --batch-size 32 --steps 40]

Rows: one process with 1 and 2 threads, and the blocks cut over 2 processes of 1 thread each
(the two cores of the CI machine either way). The plan is Megatron's, as candle-parallel's
`parallel_plan` in examples/common/transformer.rs: the packed qkv projection and the MLP's
first layer `ColwiseParallel`, the projections back `RowwiseParallel`, the norms, embeddings
and head replicated. The packed projection's rows are reordered before the cut ([q_r | k_r |
v_r] on rank r, as candle-parallel's `shard_qkv`), so that each rank computes whole heads; the
script checks that the cut model's first loss equals the uncut one's. candle's numbers are the
tokens/s its second epoch prints (training steps only; `--train-size` = batch x steps), with
RAYON_NUM_THREADS set; PyTorch's time the same number of steps on one batch, after 3.
"""
import argparse
import math
import os
import queue
import re
import socket
import subprocess
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_transformer_bench import Transformer, sort_batch, sort_loss  # noqa: E402


def qkv_rows_by_rank(weight, tp):
    """[q; k; v] with each split in tp parts, reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    q, k, v = weight.chunk(3, dim=0)
    parts = [torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]]) for r in range(tp)]
    return torch.cat(parts)


def local_heads_forward(self, x, mask):
    """The twin's attention on this rank's heads only: the head width is the whole model's."""
    b, t, _ = x.shape
    hd = self.head_dim
    q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    att = torch.softmax(scores + mask, dim=-1)
    return self.proj((att @ v).transpose(1, 2).reshape(b, t, self.heads * hd))


def tp_worker(rank, a, port, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=a.tp)
    mesh = init_device_mesh("cpu", (a.tp,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    whole = Transformer(a.layers, a.dim, a.heads, 2 * a.digits)
    model = Transformer(a.layers, a.dim, a.heads, 2 * a.digits)
    state = whole.state_dict()
    for name in list(state):
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            state[name] = qkv_rows_by_rank(state[name], a.tp)
    model.load_state_dict(state)
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }
    for block in model.h:
        parallelize_module(block, mesh, plan)
        block.attn.heads = a.heads // a.tp
        block.attn.head_dim = a.dim // a.heads
        block.attn.forward = types.MethodType(local_heads_forward, block.attn)
    tokens, answers = sort_batch(a.batch_size, a.digits, "cpu", torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (sort_loss(model(tokens), answers) - sort_loss(whole(tokens), answers)).abs().item()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def step():
        opt.zero_grad()
        loss = sort_loss(model(tokens), answers)
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    seconds = time.perf_counter() - start
    if rank == 0:
        out.put((a.steps * tokens.numel() / seconds, diff))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_tp(a):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=tp_worker, args=(r, a, port, out)) for r in range(a.tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 600
    try:
        while True:
            try:
                return out.get(timeout=1)
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"PyTorch's ranks failed (exit codes {failed}) or took "
                                       "over 600 s; their errors are above")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def torch_one(a, threads):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Transformer(a.layers, a.dim, a.heads, 2 * a.digits)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    tokens, answers = sort_batch(a.batch_size, a.digits, "cpu", torch.Generator().manual_seed(0))

    def step():
        opt.zero_grad()
        loss = sort_loss(model(tokens), answers)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    return a.steps * tokens.numel() / (time.perf_counter() - start)


def candle(a, threads, extra):
    cmd = [a.rust, "--cpu", "--layers", str(a.layers), "--dim", str(a.dim), "--heads",
           str(a.heads), "--digits", str(a.digits), "--batch-size", str(a.batch_size),
           "--train-size", str(a.batch_size * a.steps), "--test-size", "50", "--epochs", "2",
           *extra]
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    rates = re.findall(r"(\d+) tokens/s", out.stdout)
    memory = re.search(r"parameters ([\d.]+) MiB", out.stdout)
    if not rates or not memory:
        raise RuntimeError(f"no tokens/s or memory line from {cmd}:\n{out.stdout}\n{out.stderr}")
    return float(rates[-1]), float(memory.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rust", required=True, help="the transformer_ddp binary")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--digits", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tp", type=int, default=2)
    a = p.parse_args()
    n = sum(q.numel() for q in Transformer(a.layers, a.dim, a.heads, 2 * a.digits).parameters())
    print(f"training tokens/s: {a.layers} layers, dim {a.dim}, {a.heads} heads ({n:,} parameters), "
          f"batch {a.batch_size} x {2 * a.digits} tokens, AdamW, {a.steps} steps; "
          f"PyTorch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'layout':<36} {'candle':>9} {'PyTorch':>9} {'ratio':>7} {'params/rank':>12}")
    rows = [
        ("1 process, 1 thread", 1, [], lambda: torch_one(a, 1)),
        ("1 process, 2 threads", 2, [], lambda: torch_one(a, 2)),
        (f"tp {a.tp}: {a.tp} processes x 1 thread", 1,
         ["--nproc", str(a.tp), "--tensor-parallel", str(a.tp)], lambda: torch_tp(a)),
        (f"tp {a.tp} + sequence parallel", 1,
         ["--nproc", str(a.tp), "--tensor-parallel", str(a.tp), "--sequence-parallel"], None),
    ]
    for label, threads, extra, theirs in rows:
        ours, mib = candle(a, threads, extra)
        if theirs is None:
            print(f"{label:<36} {ours:>9.0f} {'-':>9} {'-':>7} {mib:>8.2f} MiB")
            continue
        t = theirs()
        if isinstance(t, tuple):
            t, diff = t
            label_note = f"  (PyTorch's cut model: first loss within {diff:.1e} of uncut)"
        else:
            label_note = ""
        print(f"{label:<36} {ours:>9.0f} {t:>9.0f} {ours / t:>6.2f}x {mib:>8.2f} MiB{label_note}")


if __name__ == "__main__":
    main()
