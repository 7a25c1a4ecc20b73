"""PyTorch's CIFAR-10 tutorial Net, trained on random CIFAR-shaped data: images/s per batch size.

The PyTorch side of candle-parallel's dp_throughput comparison (same Net, SGD lr 0.01 momentum
0.9, cross-entropy, same batch sizes, same GPU), so that the two can be reported side by side:

    python3 torch_net_bench.py --batches 128,512 --steps 50 [--device cpu]

With --rust, the two side by side on the CPU, one process with --threads threads each (2 by
default): --repeats rounds, each running candle-parallel's dp_throughput binary then PyTorch at
every batch size, interleaved so that both meet the same load on a shared machine; prints every
round, then the medians and their ratio:

    cargo bench --bench dp_throughput --no-run   # prints the binary's path
    python3 scripts/torch_net_bench.py --rust target/release/deps/dp_throughput-HASH --repeats 5

With --phases it prints instead what benches/net_phases.rs prints for candle-parallel, measured
the same way: the median time of forward with the loss, backward, the SGD update and the step
(CUDA events on a GPU, beside the host's time to issue the calls), then each layer alone on an
input of the shape it sees in the Net: its forward, and the backward of sum(layer(x) * g).
"""
import argparse
import os
import re
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def rate(device, batch, steps, warmup):
    torch.manual_seed(0)
    net = Net().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.arange(batch, device=device) % 10

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()  # waits for the device
    return steps * batch / (time.perf_counter() - start)


class Clock:
    """Marks on the current CUDA stream (GPU time) and on the host."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    def between(self, a, b):
        """Milliseconds from a to b: (device, host). Waits for b on a GPU."""
        host = (b[0] - a[0]) * 1e3
        if self.cuda:
            b[1].synchronize()
            return a[1].elapsed_time(b[1]), host
        return host, host


def median(v):
    return sorted(v)[len(v) // 2]


def phases(device, batch, steps, warmup=3):
    torch.manual_seed(0)
    net = Net().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.arange(batch, device=device) % 10
    clock = Clock(device)
    marks = []
    for step in range(warmup + steps):
        opt.zero_grad()
        m0 = clock.mark()
        loss = F.cross_entropy(net(x), y)
        m1 = clock.mark()
        loss.backward()
        m2 = clock.mark()
        opt.step()
        m3 = clock.mark()
        if step >= warmup:
            marks.append((m0, m1, m2, m3))
    columns = [([], []) for _ in range(4)]
    for m0, m1, m2, m3 in marks:
        for i, (a, b) in enumerate([(m0, m1), (m1, m2), (m2, m3), (m0, m3)]):
            gpu, host = clock.between(a, b)
            columns[i][0].append(gpu)
            columns[i][1].append(host)
    return [(median(g), median(h)) for g, h in columns]


def layers(device, batch):
    torch.manual_seed(0)
    net = Net().to(device)
    y = torch.arange(batch, device=device) % 10
    b = batch
    # The rows of benches/net_phases.rs: its Net runs each convolution, ReLU and max-pooling
    # as one op ("block"; here the three torch ops), and each hidden linear layer with its
    # ReLU; then a block's three ops apart (not in the sum).
    return [
        ("conv1 block", (b, 3, 32, 32), False, lambda t: net.pool(F.relu(net.conv1(t)))),
        ("conv2 block", (b, 6, 14, 14), True, lambda t: net.pool(F.relu(net.conv2(t)))),
        ("fc1 + relu", (b, 400), True, lambda t: F.relu(net.fc1(t))),
        ("fc2 + relu", (b, 120), True, lambda t: F.relu(net.fc2(t))),
        ("fc3", (b, 84), True, net.fc3),
        ("cross_entropy", (b, 10), True, lambda t: F.cross_entropy(t, y)),
        ("(conv1)", (b, 3, 32, 32), False, net.conv1),
        ("(relu)", (b, 6, 28, 28), True, F.relu),
        ("(max_pool)", (b, 6, 28, 28), True, net.pool),
        ("(conv2)", (b, 6, 14, 14), True, net.conv2),
        ("(relu)", (b, 16, 10, 10), True, F.relu),
        ("(max_pool)", (b, 16, 10, 10), True, net.pool),
    ]


def layer_times(device, shape, needs_grad, layer, reps):
    x = torch.randn(*shape, device=device, requires_grad=needs_grad)
    g = torch.randn_like(layer(x))
    clock = Clock(device)
    fwd, bwd = [], []
    for rep in range(reps + 2):
        m0 = clock.mark()
        out = layer(x)
        m1 = clock.mark()
        objective = (out * g).sum()
        m2 = clock.mark()
        objective.backward()
        m3 = clock.mark()
        if rep >= 2:
            fwd.append(clock.between(m0, m1)[0])
            bwd.append(clock.between(m2, m3)[0])
    return median(fwd), median(bwd)


def print_phases(device, batches, steps):
    cuda = device.type == "cuda"
    what, host = ("GPU ms (CUDA events)", "host ms") if cuda else ("ms (wall clock)", "")
    for b in batches:
        where = "GPU 0" if cuda else "the CPU"
        print(f"\nPyTorch {torch.__version__}: Net training step at batch {b} on {where}: "
              f"median of {steps} steps")
        print(f"{'phase':<20} {what:>22} {host:>10}")
        names = ["forward + loss", "backward", "SGD update", "step"]
        for name, (gpu, h) in zip(names, phases(device, b, steps)):
            print(f"{name:<20} {gpu:>22.3f} {f'{h:.3f}' if cuda else '':>10}")
        print(f"{'layer':<14} {'input':<18} {'forward ms':>12} {'backward ms':>12}")
        total_f = total_b = 0.0
        summed = False
        for name, shape, needs_grad, layer in layers(device, b):
            apart = name.startswith("(")
            if apart and not summed:
                print(f"{'sum':<14} {'':<18} {total_f:>12.3f} {total_b:>12.3f}")
                print("the blocks' ops apart:")
                summed = True
            f, bw = layer_times(device, shape, needs_grad, layer, steps)
            if not apart:
                total_f += f
                total_b += bw
            print(f"{name:<14} {str(list(shape)):<18} {f:>12.3f} {bw:>12.3f}")


def ours_rate(a, batch):
    """Images/s of candle-parallel's dp_throughput binary: one CPU replica, our kernels."""
    cmd = [a.rust, "--kernels", "ours", "--devices", "1", "--cpu", "--batches", str(batch),
           "--steps", str(a.steps), "--warmup", str(a.warmup)]
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    found = re.search(rf"^\s*{batch}\s+ours\s+1\s+([0-9.]+)", out.stdout, re.MULTILINE)
    if not found:
        raise RuntimeError(f"no images/s line from {cmd}:\n{out.stdout}\n{out.stderr}")
    return float(found.group(1))


def side_by_side(a, batches):
    torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    print(f"CIFAR-10 Net training images/s, one process with {a.threads} threads each, "
          f"{a.steps} steps after {a.warmup}; PyTorch {torch.__version__}")
    print(f"{'round':>5} {'batch':>6} {'candle-parallel':>16} {'PyTorch':>10} {'ratio':>7}")
    runs = {b: ([], []) for b in batches}
    for round_ in range(1, a.repeats + 1):
        for b in batches:
            ours = ours_rate(a, b)
            theirs = rate(device, b, a.steps, a.warmup)
            runs[b][0].append(ours)
            runs[b][1].append(theirs)
            print(f"{round_:>5} {b:>6} {ours:>16.0f} {theirs:>10.0f} {ours / theirs:>6.2f}x")
    print(f"medians of {a.repeats} rounds")
    for b in batches:
        ours, theirs = median(runs[b][0]), median(runs[b][1])
        print(f"{'':>5} {b:>6} {ours:>16.0f} {theirs:>10.0f} {ours / theirs:>6.2f}x")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", default="128,512")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--phases", action="store_true",
                   help="time the phases of a step and each layer, as benches/net_phases.rs")
    p.add_argument("--rust", metavar="EXE",
                   help="the dp_throughput bench binary: candle-parallel and PyTorch side by side")
    p.add_argument("--threads", type=int, default=2, help="threads of each, with --rust")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds, with --rust")
    a = p.parse_args()
    if a.rust:
        side_by_side(a, [int(v) for v in a.batches.split(",")])
        return
    device = torch.device(a.device)
    if a.phases:
        print_phases(device, [int(v) for v in a.batches.split(",")], a.steps)
        return
    print(f"PyTorch {torch.__version__}, CIFAR-10 Net training, {device}, {a.steps} steps")
    print(f"{'batch':>6} {'images/s':>12}")
    for b in (int(v) for v in a.batches.split(",")):
        print(f"{b:>6} {rate(device, b, a.steps, a.warmup):>12.1f}")


if __name__ == "__main__":
    main()
