"""PyTorch twin of `transformer_ddp --sharding none|zero2|full`: memory per rank and tokens/s.

    pip install torch numpy

The same transformer and task as examples/transformer_ddp.rs (the model is imported from
torch_transformer_bench.py), trained on the CPU over gloo by W processes, for each way of
keeping the training state:

- `none`:  DistributedDataParallel and torch.optim.AdamW: every rank keeps everything;
- `zero1`: DistributedDataParallel and ZeroRedundancyOptimizer(AdamW): optimizer state sharded;
- `zero2`: FSDP2 `fully_shard(..., reshard_after_forward=False)` on each block and the root:
           gradients and optimizer state sharded, parameters kept after the forward;
- `full`:  FSDP2 `fully_shard` on each block and the root: parameters sharded too.

Each rank reports the bytes it keeps after a step (parameters, gradients, optimizer state: the
local shards of DTensors) and its peak RSS; the table shows the largest over the ranks, beside
the global tokens/s of the timed steps. With `--rust EXE` (target/release/examples/
transformer_ddp) the same configurations run in candle-parallel, on the same model flags, in
the same run, and their `memory per rank:` line and last epoch's tokens/s fill the rows below:

    cargo build --release --example transformer_ddp
    python3 scripts/torch_sharding_bench.py --worlds 1 2 4 --rust target/release/examples/transformer_ddp

Threads: each process gets --threads (default 1) intra-op threads, as the Rust ranks get
RAYON_NUM_THREADS. `--device cuda` runs world size 1 on NCCL on one GPU instead (the Rust
binary built with `--features cuda,nccl`), with the GPU's peak allocated bytes in the last column.

`--precision bf16 --modes none`: mixed precision under DDP, PyTorch's forward and loss under
`torch.autocast(dtype=torch.bfloat16)` beside the example's `--precision bf16` (f32 weights and
AdamW in both). With the example's default model, this is its DDP over 1 and 2 processes:

    python3 scripts/torch_sharding_bench.py --worlds 1 2 --modes none --layers 2 --dim 64 \
        --batch-size 32 --steps 50 --precision bf16 --rust target/release/examples/transformer_ddp

Candle's rows are its epoch's tokens/s, which include the warm-up steps PyTorch leaves out.
"""
import argparse
import os
import re
import resource
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_transformer_bench import Transformer, sort_batch, sort_loss  # noqa: E402

MODES = ["none", "zero1", "zero2", "full"]
MIB = float(1 << 20)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_bytes(t):
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_bytes(opt):
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer
    total = 0
    for state in inner.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += local_bytes(v)
    return total


def worker(rank, world, mode, a, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = Transformer(a.layers, a.dim, a.heads, 2 * a.digits).to(a.device)
    adamw = dict(lr=a.lr, weight_decay=0.01)
    if mode in ("none", "zero1"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        if mode == "none":
            opt = torch.optim.AdamW(model.parameters(), **adamw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    else:
        from torch.distributed.fsdp import fully_shard

        keep = mode == "zero2"
        for block in model.h:
            fully_shard(block, reshard_after_forward=not keep)
        fully_shard(model, reshard_after_forward=not keep)
        opt = torch.optim.AdamW(model.parameters(), **adamw)
    g = torch.Generator().manual_seed(a.seed * 1000 + rank)

    # Mixed precision as torch users write it: the forward and loss under autocast, f32 weights.
    dtype = {"bf16": torch.bfloat16, "f32": None}[a.precision]

    def step():
        tokens, answers = sort_batch(a.batch_size, a.digits, a.device, g)
        with torch.autocast(torch.device(a.device).type, dtype=dtype, enabled=dtype is not None):
            loss = sort_loss(model(tokens), answers)
        loss.backward()
        opt.step()
        # Gradients stay allocated (set_to_none=False) so that their bytes are counted.
        opt.zero_grad(set_to_none=False)

    for _ in range(a.warmup):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(a.steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - started
    params = list(model.parameters())
    kept = torch.tensor(
        [
            sum(local_bytes(p) for p in params),
            sum(local_bytes(p.grad) for p in params),
            optimizer_bytes(opt),
            torch.cuda.max_memory_allocated() if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        ],
        dtype=torch.float64,
        device=a.device,
    )
    dist.all_reduce(kept, op=dist.ReduceOp.MAX)
    if rank == 0:
        tokens = a.steps * a.batch_size * world * 2 * a.digits
        out.put((tokens / elapsed, *(kept.cpu() / MIB).tolist()))
    dist.destroy_process_group()


def run_torch(mode, world, a):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, mode, a, free_port_once[world], out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result


free_port_once = {}

MEMORY = re.compile(
    r"memory per rank: parameters ([\d.]+) MiB, gradients ([\d.]+) MiB, optimizer ([\d.]+) MiB, "
    r"peak RSS ([\d.]+) MiB"
)
TOKENS = re.compile(r"([\d.]+) tokens/s")


def run_rust(exe, mode, world, a):
    cmd = [
        exe, *(["--cpu"] if a.device == "cpu" else []), "--nproc", str(world), "--sharding", mode,
        "--layers", str(a.layers), "--dim", str(a.dim), "--heads", str(a.heads),
        "--digits", str(a.digits), "--batch-size", str(a.batch_size),
        "--epochs", "1", "--train-size", str(a.batch_size * world * (a.steps + a.warmup)),
        "--test-size", str(a.batch_size), "--seed", str(a.seed), "--precision", a.precision,
    ]
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    text = done.stdout + done.stderr
    memory = MEMORY.search(text)
    tokens = TOKENS.findall(text)
    if done.returncode != 0 or not memory or not tokens:
        print(f"candle {mode} x{world} failed ({done.returncode}):\n{text[-2000:]}", file=sys.stderr)
        return None
    return (float(tokens[-1]), *(float(x) for x in memory.groups()))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--rust", metavar="EXE", help="the transformer_ddp binary, for candle's rows")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--digits", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                   help="bf16: the forward under torch.autocast beside the example's "
                        "--precision bf16 (f32 weights and optimizer in both); sharding none only")
    a = p.parse_args()
    if a.precision == "bf16" and a.modes != ["none"]:
        p.error("--precision bf16 compares DDP only: pass --modes none")
    if a.device == "cuda" and a.worlds != [1]:
        p.error("--device cuda runs world size 1 on one GPU: pass --worlds 1")
    rows = []
    for world in a.worlds:
        for mode in a.modes:
            free_port_once[world] = free_port()
            rows.append(("PyTorch", mode, world, run_torch(mode, world, a)))
            if a.rust and mode != "zero1":
                rows.append(("candle", mode, world, run_rust(a.rust, mode, world, a)))
    n = sum(p.numel() for p in Transformer(a.layers, a.dim, a.heads, 2 * a.digits).parameters())
    print(f"\ntransformer: {a.layers} layers, dim {a.dim}, {n / 1e6:.2f} M parameters; "
          f"batch {a.batch_size} per rank; {a.threads} thread(s) per rank; {a.precision}; {a.device}; torch {torch.__version__}\n")
    peak = "peak GPU MiB (candle: peak RSS)" if a.device == "cuda" else "peak RSS MiB"
    print(f"| framework | sharding | world | tokens/s | parameters MiB | gradients MiB | optimizer MiB | {peak} |")
    print("|---|---|---|---|---|---|---|---|")
    for fw, mode, world, r in rows:
        if r is None:
            print(f"| {fw} | {mode} | {world} | failed | | | | |")
            continue
        tps, pm, gm, om, rss = r
        print(f"| {fw} | {mode} | {world} | {tps:.0f} | {pm:.2f} | {gm:.2f} | {om:.2f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
