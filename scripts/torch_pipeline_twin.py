"""PyTorch twin of examples/transformer_pp.rs: torch.distributed.pipelining (ScheduleGPipe,
Schedule1F1B) over gloo on the same transformer, task and batch.

    pip install torch

Parity. `transformer_ddp --dump-step FILE` writes the initial weights, the first batch, its loss
and every gradient (one process; tests/pipeline.rs shows transformer_pp's pipelined step equals
that one-process step). This script cuts the same model into --pipeline stages as
transformer_pp does (the embeddings and the first blocks on rank 0, the last blocks, the final
norm and the head on the last rank), runs one step of torch's schedule over --microbatches
micro-batches on gloo ranks (torch's scale_grads divides the gradients by the micro-batch
count), and compares the mean of the micro-batches' losses and every stage's gradients with
the dump (pass: max |difference| <= 1e-5 x max(1, max |candle's value|)):

    cargo run --release --example transformer_ddp -- --dump-step /tmp/step.safetensors
    python3 scripts/torch_pipeline_twin.py --parity /tmp/step.safetensors --schedule 1f1b

Speed, side by side: training tokens/s (schedule step and AdamW, one thread per rank) of
torch's pipeline and, with --rust, of transformer_pp with the same flags:

    python3 scripts/torch_pipeline_twin.py --speed --rust target/release/examples/transformer_pp \\
        --pipeline 2 --schedule 1f1b --microbatches 4

The model and loss are scripts/torch_transformer_bench.py's (imported from beside this file).
Exits 1 when the parity check fails.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_transformer_bench import VOCAB, Block, sort_batch, sort_loss  # noqa: E402


def stage_blocks(layers, stage, num_stages):
    """transformer_pp's split (examples/common/transformer.rs, stage_blocks)."""
    return range(stage * layers // num_stages, (stage + 1) * layers // num_stages)


class TransformerStage(nn.Module):
    """Stage `stage` of the transformer, with the whole model's parameter names."""

    def __init__(self, layers, dim, heads, max_len, stage, num_stages):
        super().__init__()
        self.first, self.last = stage == 0, stage == num_stages - 1
        if self.first:
            self.tok_emb = nn.Embedding(VOCAB, dim)
            self.pos_emb = nn.Embedding(max_len, dim)
        self.h = nn.ModuleDict({str(i): Block(dim, heads) for i in stage_blocks(layers, stage, num_stages)})
        if self.last:
            self.ln_f = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, VOCAB)

    def forward(self, x):
        if self.first:
            t = x.shape[1]
            x = self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device))
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        for block in self.h.values():
            x = block(x, mask)
        return self.head(self.ln_f(x)) if self.last else x


def load_safetensors(path):
    """The tensors of a safetensors file (F32, I64, U32), without the safetensors package."""
    dtypes = {"F32": torch.float32, "I64": torch.int64, "U32": torch.int32, "F64": torch.float64}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        t = torch.frombuffer(bytearray(data[start:end]), dtype=dtypes[meta["dtype"]])
        out[name] = t.reshape(meta["shape"]).clone()
    return out


def schedule_class(name):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]


def make_stage(a, rank, world, dims, device):
    from torch.distributed.pipelining import PipelineStage

    layers, dim, heads, digits = dims
    module = TransformerStage(layers, dim, heads, 2 * digits, rank, world)
    return module, PipelineStage(module, rank, world, device)


def parity_rank(rank, a, port, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.pipeline)
    dump = load_safetensors(a.parity)
    dims = tuple(int(v) for v in dump["config"])
    module, stage = make_stage(a, rank, a.pipeline, dims, torch.device("cpu"))
    params = {k[len("param."):]: v for k, v in dump.items() if k.startswith("param.")}
    module.load_state_dict({k: params[k] for k in module.state_dict()}, strict=True)
    schedule = schedule_class(a.schedule)(stage, a.microbatches, loss_fn=sort_loss)
    tokens, answers = dump["tokens"].long(), dump["answers"].long()
    losses = []
    if rank == 0 and a.pipeline > 1:
        schedule.step(tokens)
    elif rank == a.pipeline - 1 and a.pipeline > 1:
        schedule.step(target=answers, losses=losses)
    else:
        schedule.step(tokens, target=answers, losses=losses)
    worst, failures = ("", 0.0), []
    for name, p in module.named_parameters():
        theirs = dump[f"grad.{name}"]
        diff = (p.grad - theirs).abs().max().item()
        if diff > 1e-5 * max(1.0, theirs.abs().max().item()):
            failures.append(f"{name} ({diff:.2e})")
        if diff >= worst[1]:
            worst = (name, diff)
    loss = torch.stack(losses).mean().item() if losses else None
    q.put((rank, sum(1 for _ in module.parameters()), worst, failures, loss))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parity(a):
    dump = load_safetensors(a.parity)
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(parity_rank, args=(a, free_port(), q), nprocs=a.pipeline, join=True)
    rows = sorted(q.get() for _ in range(a.pipeline))
    print(f"one-step parity of torch.distributed.pipelining ({a.schedule}, {a.pipeline} stages, "
          f"{a.microbatches} micro-batches, gloo, PyTorch {torch.__version__}) with candle's step")
    failed = False
    for rank, n, worst, failures, loss in rows:
        print(f"  rank {rank}: {n} gradients, largest |diff| {worst[1]:.2e} ({worst[0]})")
        if loss is not None:
            diff = abs(loss - dump["loss"].item())
            print(f"  loss (mean of the micro-batches): candle {dump['loss'].item():.7f}, "
                  f"PyTorch {loss:.7f}, |diff| {diff:.2e}")
            failed |= diff > 1e-5
        if failures:
            print(f"  FAILED (over 1e-5): {', '.join(failures)}")
            failed = True
    if failed:
        sys.exit(1)
    print("  PASSED: loss and every gradient within 1e-5")


def speed_rank(rank, a, port, q):
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.pipeline)
    dims = (a.layers, a.dim, a.heads, a.digits)
    module, stage = make_stage(a, rank, a.pipeline, dims, torch.device("cpu"))
    schedule = schedule_class(a.schedule)(stage, a.microbatches, loss_fn=sort_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(a.seed)

    def step():
        tokens, answers = sort_batch(a.batch_size, a.digits, "cpu", gen)
        opt.zero_grad()
        if a.pipeline == 1:
            schedule.step(tokens, target=answers)
        elif rank == 0:
            schedule.step(tokens)
        elif rank == a.pipeline - 1:
            schedule.step(target=answers)
        else:
            schedule.step()
        opt.step()

    for _ in range(3):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(a.steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - started
    if rank == 0:
        q.put(a.steps * a.batch_size * 2 * a.digits / seconds)
    dist.destroy_process_group()


def rust_tokens_per_s(a):
    cmd = [a.rust, "--pipeline", str(a.pipeline), "--schedule", a.schedule,
           "--microbatches", str(a.microbatches), "--layers", str(a.layers), "--dim", str(a.dim),
           "--heads", str(a.heads), "--digits", str(a.digits), "--batch-size", str(a.batch_size),
           "--train-size", str(a.steps * a.batch_size), "--epochs", "1"]
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return float(re.search(r"([0-9.]+) tokens/s", out).group(1))


def speed(a):
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(speed_rank, args=(a, free_port(), q), nprocs=a.pipeline, join=True)
    theirs = q.get()
    print(f"training tokens/s, {a.layers} layers, dim {a.dim}, batch {a.batch_size} in "
          f"{a.microbatches} micro-batches, {a.schedule} over {a.pipeline} processes, one thread "
          f"each, {a.steps} steps")
    print(f"{'PyTorch':>10} {'candle':>10} {'candle/PyTorch':>15}")
    if a.rust:
        ours = rust_tokens_per_s(a)
        print(f"{theirs:>10.0f} {ours:>10.0f} {ours / theirs:>14.2f}x")
    else:
        print(f"{theirs:>10.0f} {'(--rust)':>10} {'-':>15}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parity", metavar="FILE", help="check against transformer_ddp --dump-step's file")
    p.add_argument("--speed", action="store_true", help="training tokens/s side by side")
    p.add_argument("--rust", metavar="EXE", help="the transformer_pp binary, for candle's numbers")
    p.add_argument("--pipeline", type=int, default=2)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--digits", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.parity:
        parity(a)
    if a.speed or not a.parity:
        speed(a)


if __name__ == "__main__":
    main()
