"""PyTorch twin of benches/largest_model.rs: one training trial on W CPU ranks over gloo.

    pip install torch numpy

The bench runs this script once per trial, in turns with its own trials, and reads the last
line it prints (`RESULT key=value ...`). It can also be run alone:

    python3 scripts/torch_largest_model.py --setup fsdp-bf16-ckpt --world 4 --layers 8 \
        --dim 256 --heads 4 --digits 32 --batch-size 8 --warmup 2 --steps 3 --budget 256

Two setups, as the bench's:

- `ddp-f32`: DistributedDataParallel and torch.optim.AdamW, f32 (every rank keeps everything);
- `fsdp-bf16-ckpt`: torchtitan's recipe: each block wrapped by `checkpoint_wrapper`
  (`torch.utils.checkpoint`, non-reentrant, no RNG state kept: the model has no dropout),
  then FSDP2 `fully_shard` on each block and on the root with
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)`, the root's with
  `output_dtype=f32` too (f32 logits, as candle-parallel's `MixedPrecision::bf16()`; on the
  blocks it would hand the next block's bf16 LayerNorm an f32 input, which torch's CPU
  layer_norm refuses), AdamW on the f32 shards.

The model is torch_transformer_bench.py's (the same as examples/common/transformer.rs). With
`--data FILE` (safetensors: `tokens` (n, 2 digits) and `answers` (n, digits), int64, written
by the bench) step s of rank r trains on rows (s W + r) B .. (s W + r + 1) B, modulo n, as the
bench's own ranks do; without it, on random digits. `--init FILE` loads the initial weights
(safetensors, candle's variable names, which are torch's) before wrapping. `--losses FILE`
writes every step's loss, averaged over the ranks, one per line.

Memory, per rank, from /proc/self/status: `peak RSS` is VmHWM; `training memory` is VmHWM
minus the file-backed pages resident at the end (RssFile: the libraries' code and data, shared
between the ranks) minus the anonymous and shared memory resident before the model was built
(RssAnon + RssShmem after `import torch` and the process group: the interpreter's and the
libraries' own). With `--budget MIB` the trial stops after the first warm-up step whose
training memory (largest over the ranks) passes the budget, and says `status=over`.
"""
import argparse
import gc
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_transformer_bench import Transformer, sort_batch, sort_loss  # noqa: E402

SETUPS = ["ddp-f32", "fsdp-bf16-ckpt"]
MIB = float(1 << 20)
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "F64": torch.float64}


def proc_status():
    """The memory lines of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def training_bytes(baseline):
    s = proc_status()
    return s["VmHWM"] - s["RssFile"] - baseline


def load_safetensors(path):
    """A safetensors file as a dict of tensors (the format is an 8-byte little-endian header
    length, a JSON header, then the raw bytes): no dependency beyond torch."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = bytearray(data[base + start:base + end])
        out[name] = torch.frombuffer(raw, dtype=DTYPES[info["dtype"]]).reshape(info["shape"]).clone()
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(a):
    model = Transformer(a.layers, a.dim, a.heads, 2 * a.digits)
    if a.init:
        model.load_state_dict(load_safetensors(a.init), strict=True)
    if a.setup == "ddp-f32":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.h):
        model.h[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        fully_shard(model.h[i], mp_policy=policy)
    # f32 logits from the root only: a block's f32 output would meet the next bf16 LayerNorm.
    root = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    fully_shard(model, mp_policy=root)
    return model


def worker(rank, a, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    s = proc_status()
    baseline = s["RssAnon"] + s["RssShmem"]
    torch.manual_seed(a.seed)
    model = build(a)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    data = load_safetensors(a.data) if a.data else None
    g = torch.Generator().manual_seed(a.seed * 1000 + rank)

    def batch(step):
        if data is None:
            return sort_batch(a.batch_size, a.digits, "cpu", g)
        n = data["tokens"].shape[0]
        first = (step * a.world + rank) * a.batch_size
        rows = torch.arange(first, first + a.batch_size) % n
        return data["tokens"][rows], data["answers"][rows]

    losses = []

    def step(s):
        tokens, answers = batch(s)
        loss = sort_loss(model(tokens), answers)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    status = "ok"
    for s in range(a.warmup):
        step(s)
        if a.budget:
            worst = torch.tensor([training_bytes(baseline)], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if worst.item() > a.budget * MIB:
                status = "over"
                break
    elapsed = 0.0
    if status == "ok":
        dist.barrier()
        started = time.perf_counter()
        for s in range(a.warmup, a.warmup + a.steps):
            step(s)
        dist.barrier()
        elapsed = time.perf_counter() - started
    s = proc_status()
    mine = [s["VmHWM"] - s["RssFile"] - baseline, s["VmHWM"], baseline]
    most = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    curve = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(curve, op=dist.ReduceOp.SUM)
    curve /= a.world
    if a.budget and most[0].item() > a.budget * MIB:
        status = "over"
    if rank == 0:
        tokens = a.steps * a.world * a.batch_size * 2 * a.digits
        params = sum(p.numel() for p in Transformer(a.layers, a.dim, a.heads, 2 * a.digits).parameters())
        fields = {
            "status": status,
            "parameters": params,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "training_mib": most[0].item() / MIB,
            "peak_rss_mib": most[1].item() / MIB,
            "baseline_mib": most[2].item() / MIB,
            "last_loss": curve[-1].item() if len(curve) else float("nan"),
        }
        if a.losses:
            with open(a.losses, "w") as f:
                f.writelines(f"{v!r}\n" for v in curve.tolist())
        with open(a.result, "w") as f:
            f.write("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()) + "\n")
    # Every rank done with its collectives, and DDP's reducer (which holds gloo work) gone,
    # before the group goes: a rank once aborted in teardown ("terminate called without an
    # active exception") after a 100-step DDP run.
    dist.barrier()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setup", choices=SETUPS, required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--digits", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--budget", type=float, default=0.0, help="MiB of training memory per rank")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", metavar="FILE")
    p.add_argument("--init", metavar="FILE")
    p.add_argument("--losses", metavar="FILE")
    a = p.parse_args()
    result = f"/tmp/torch-largest-{os.getpid()}.txt"
    a.result = result
    try:
        mp.spawn(worker, args=(a, free_port()), nprocs=a.world, join=True)
        with open(result) as f:
            print(f.read().strip())
    except Exception as e:  # a rank failed: say so on the line the bench reads
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"RESULT status=failed error={first.replace(' ', '_')[:200]}")
    finally:
        if os.path.exists(result):
            os.remove(result)


if __name__ == "__main__":
    main()
