"""torch.distributed's gloo all-reduce bandwidth: the twin of benches/allreduce_bandwidth.rs.

Starts `--world` processes (default 2) on 127.0.0.1 with the gloo backend and times f32
`dist.all_reduce(SUM)` of CPU tensors from `--min-kib` KiB to `--max-mib` MiB, sizes growing
4x, exactly as the Rust bench does: 3 warm-up calls, then 5 trials of
clamp(64 MiB / size, 3, 500) calls each, each trial after a barrier; the median trial is
reported as bus bandwidth (nccl-tests' definition: size / time x 2(n-1)/n).

    python3 scripts/torch_allreduce_bench.py --min-kib 1024 --max-mib 64

Then, as the Rust bench does, rank 0 sends rank 1 three 64 MiB f32 tensors and rank 1 answers
with one element (5 trials, the median's throughput).

Prints a table, then one machine-readable line per size for the Rust bench, and the send's:

    gloo SIZE_BYTES BUSBW_GBPS
    gloo-send SIZE_BYTES GBPS
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TRIALS = 5
SEND_BYTES = 64 << 20
SENDS = 3


def sizes(min_kib, max_mib):
    size = min_kib << 10
    while size <= max_mib << 20:
        yield size
        size *= 4


def rank_main(rank, world, port, min_kib, max_mib, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Bind gloo to loopback, as the Rust bench's ranks do.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for size in sizes(min_kib, max_mib):
        x = torch.ones(size // 4, dtype=torch.float32)
        iters = min(max((64 << 20) // size, 3), 500)
        for _ in range(3):
            y = x.clone()
            dist.all_reduce(y)
        trials = []
        for _ in range(TRIALS):
            # Fresh copies outside the timing: all_reduce works in place, the Rust bench's
            # returns a new tensor; both read the same input every call.
            ys = [x.clone() for _ in range(min(iters, 4))]
            dist.barrier()
            start = time.perf_counter()
            for i in range(iters):
                dist.all_reduce(ys[i % len(ys)])
            trials.append((time.perf_counter() - start) / iters)
        secs = statistics.median(trials)
        if rank == 0:
            busbw = size / secs / 1e9 * 2 * (world - 1) / world
            results.append((size, secs, iters, busbw))
    if world >= 2:
        x = torch.ones(SEND_BYTES // 4, dtype=torch.float32)
        got = torch.empty_like(x)
        ack = torch.ones(1)

        def exchange():
            if rank == 0:
                for _ in range(SENDS):
                    dist.send(x, 1)
                dist.recv(ack, 1)
            elif rank == 1:
                for _ in range(SENDS):
                    dist.recv(got, 0)
                dist.send(ack, 0)

        exchange()
        trials = []
        for _ in range(TRIALS):
            dist.barrier()
            start = time.perf_counter()
            exchange()
            trials.append(time.perf_counter() - start)
        if rank == 0:
            results.append(("send", statistics.median(trials), SENDS, SENDS * SEND_BYTES))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--min-kib", type=int, default=4)
    ap.add_argument("--max-mib", type=int, default=64)
    a = ap.parse_args()
    with mp.Manager() as m:
        results = m.list()
        mp.spawn(
            rank_main,
            args=(a.world, free_port(), a.min_kib, a.max_mib, results),
            nprocs=a.world,
            join=True,
        )
        results = list(results)
    print(f"\ngloo all_reduce(sum), f32 CPU tensors, {a.world} ranks (torch {torch.__version__})")
    print(f"{'size':>10} {'iters':>7} {'median/op':>12} {'busbw GB/s':>12}")
    sends = [r for r in results if r[0] == "send"]
    results = [r for r in results if r[0] != "send"]
    for size, secs, iters, busbw in results:
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"{label:>10} {iters:>7} {secs * 1e6:>10.1f}us {busbw:>12.3f}")
    for _, secs, _, sent in sends:
        print(f"gloo send {SEND_BYTES >> 20} MiB, rank 0 to rank 1: {sent / secs / 1e9:.3f} GB/s")
    for size, _, _, busbw in results:
        print(f"gloo {size} {busbw:.4f}")
    for _, secs, _, sent in sends:
        print(f"gloo-send {SEND_BYTES} {sent / secs / 1e9:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
