"""PyTorch's side of candle-parallel's ddp_throughput benchmark: the same models, setups and
batches, so that the two tables can be read side by side.

    python3 scripts/torch_ddp_bench.py                      # CPU: DDP on gloo
    python3 scripts/torch_ddp_bench.py --device cuda        # GPU: DDP on NCCL (world size 1)

Models: the CIFAR-10 tutorial Net (global batch 128), an MLP of 25.2 M parameters
(1024 -> 4096 -> 4096 -> 1024, global batch 64), and the transformer of transformer_ddp at
25.2 M parameters (8 blocks of width 512, 8 heads; global batch 16 sequences of 16 tokens of
the sorting task), SGD lr 0.01 momentum 0.9, cross-entropy on random data (the transformer:
on its answer positions). Setups (each in fresh processes, one after the other; images/s the median of
--repeat runs): one process with 1 and 2 threads; DDP on one process, and its overhead (plain
and DDP steps alternating in one process, the median ratio of 7 rounds); N plain processes
side by side with no communication; DDP on N processes of 1 thread each, the batch split
among them. Reports; asserts nothing.

With --precision bf16 (ddp_throughput's --precision bf16 beside it): the forward and loss under
torch.autocast(dtype=torch.bfloat16), f32 weights and optimizer, DDP rows only (1 process
with 1 and 2 threads, then N processes), as candle-parallel's mixed precision lives in DDP.
"""
import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# The tutorial Net and the transformer, defined once beside this script (gpu-pack copies both).
from torch_net_bench import Net
from torch_transformer_bench import Transformer, sort_batch, sort_loss


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(1024, 4096)
        self.fc2 = nn.Linear(4096, 4096)
        self.fc3 = nn.Linear(4096, 1024)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def tf():
    """The transformer at 25.2 M parameters, on the sorting task's 16 positions."""
    return Transformer(layers=8, dim=512, heads=8, max_len=16)


MODELS = {"net": (Net, 128, (3, 32, 32), 10, 30), "big": (Big, 64, (1024,), 1024, 10),
          "tf": (tf, 16, None, None, 10)}


def batch(model, n, device):
    if model == "tf":
        return sort_batch(n, 8, device, torch.Generator().manual_seed(0))
    _, _, shape, classes, _ = MODELS[model]
    return torch.randn(n, *shape, device=device), torch.arange(n, device=device) % classes


def loss_fn(model):
    return sort_loss if model == "tf" else F.cross_entropy


def trainer(model, n, device, wrap=None, bf16=False):
    torch.manual_seed(0)
    net = MODELS[model][0]().to(device)
    if wrap is not None:
        net = wrap(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = batch(model, n, device)
    criterion = loss_fn(model)

    def step():
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = criterion(net(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def timed(step, warmup, steps, device):
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()  # waits for the device
    return time.perf_counter() - start


def worker(rank, world, port, job, out):
    kind, model, n, bucket_mb, steps, threads, device, bf16 = job
    torch.set_num_threads(threads)
    device = torch.device(device)
    warmup = 3
    if kind != "plain":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
        ids = [device.index] if device.type == "cuda" else None
        wrap = lambda net: DDP(net, device_ids=ids, bucket_cap_mb=bucket_mb)
    if kind == "plain":
        took = timed(trainer(model, n, device), warmup, steps, device)
        result = steps * n / took
    elif kind == "ddp":
        step = trainer(model, n, device, wrap, bf16)
        dist.barrier()
        took = timed(step, warmup, steps, device)
        result = steps * n * world / took
    else:  # overhead: plain and DDP alternating in this one process
        plain, ddp = trainer(model, n, device), trainer(model, n, device, wrap)
        per, ratios = max(1, -(-steps // 3)), []
        for r in range(7):
            w = warmup if r == 0 else 0
            p, d = timed(plain, w, per, device), timed(ddp, w, per, device)
            ratios.append(d / p)
        result = statistics.median(ratios) - 1.0
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(result))
    if kind != "plain":
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(job, procs, repeat):
    results = []
    for _ in range(repeat):
        out = os.path.join(tempfile.gettempdir(), f"torch-ddp-bench-{os.getpid()}")
        mp.spawn(worker, args=(procs, free_port(), job, out), nprocs=procs, join=True)
        values = []
        for r in range(procs):
            with open(f"{out}.{r}") as f:
                values.append(float(f.read()))
            os.remove(f"{out}.{r}")
        results.append(sum(values) if job[0] == "plain" else values[0])
    return statistics.median(results)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="net,big,tf")
    p.add_argument("--procs", default="2")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                   help="bf16: the forward under torch.autocast, DDP rows only")
    a = p.parse_args()
    bf16 = a.precision == "bf16"
    for model in a.models.split(","):
        _, global_batch, _, _, steps = MODELS[model]
        dev = a.device

        def job(kind, n, threads, mb=25):
            return (kind, model, n, mb, steps, threads, dev, bf16)

        print(f"\n{model}, global batch {global_batch}, {a.precision}, PyTorch {torch.__version__} "
              f"on {dev}; images/s are the median of {a.repeat} runs")
        if model == "tf":
            print("(an image here is a sequence of 16 tokens)")
        # bf16: DDP rows only (candle-parallel's mixed precision lives in DDP).
        first, prefix = ("ddp", "DDP, ") if bf16 else ("plain", "")
        one = run(job(first, global_batch, 1), 1, a.repeat)
        two = run(job(first, global_batch, 2), 1, a.repeat)
        print(f"{'setup':<48} {'images/s':>9} {'vs 1 proc':>10}")
        row = lambda label, v: print(f"{label:<48} {v:>9.0f} {v / two:>9.2f}x")
        row(f"{prefix}1 process, 1 thread, batch {global_batch}", one)
        row(f"{prefix}1 process, 2 threads, batch {global_batch}", two)
        if not bf16:
            ddp1 = run(job("ddp", global_batch, 1), 1, a.repeat)
            row(f"DDP, 1 process, 1 thread, batch {global_batch}", ddp1)
        for n in map(int, a.procs.split(",")):
            if dev == "cuda":
                break  # one GPU: only world size 1 is meaningful
            each = global_batch // n
            if not bf16:
                row(f"{n} plain processes x 1 thread, {each} each (no comm)",
                    run(job("plain", each, 1), n, a.repeat))
            row(f"DDP, {n} processes x 1 thread, batch {each} each",
                run(job("ddp", each, 1), n, a.repeat))
        if bf16:
            continue
        overhead = run(job("overhead", global_batch, 1), 1, a.repeat)
        print(f"DDP overhead on 1 process: {100 * overhead:+.1f}% step time against the plain "
              f"step (median of 7 alternating rounds in one process)")
        if model == "big" and dev != "cuda":
            print("bucket size, DDP on 2 processes:")
            for mb in (1, 5, 25, 100):
                v = run(job("ddp", global_batch // 2, 1, mb), 2, a.repeat)
                print(f"  {mb:>5} MiB: {v:>6.0f} images/s")


if __name__ == "__main__":
    main()
