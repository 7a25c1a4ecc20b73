"""PyTorch's CIFAR-10 tutorial Net, trained on random CIFAR-shaped data: images/s per batch size.

The PyTorch side of candle-parallel's dp_throughput comparison (same Net, SGD lr 0.01 momentum
0.9, cross-entropy, same batch sizes, same GPU), so that the two can be reported side by side:

    python3 torch_net_bench.py --batches 128,512 --steps 50 [--device cpu]
"""
import argparse
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


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", default="128,512")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    print(f"PyTorch {torch.__version__}, CIFAR-10 Net training, {device}, {a.steps} steps")
    print(f"{'batch':>6} {'images/s':>12}")
    for b in (int(v) for v in a.batches.split(",")):
        print(f"{b:>6} {rate(device, b, a.steps, a.warmup):>12.1f}")


if __name__ == "__main__":
    main()
