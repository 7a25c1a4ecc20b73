"""PyTorch's CIFAR-10 tutorial Net trained on CIFAR-10 binary files: test accuracy per epoch.

The PyTorch twin of `cargo run --release --example cifar_dp`: the same Net, PyTorch's default
initialisation, SGD (lr 0.01, momentum 0.9), batch 128, images normalised with mean 0.5 and
std 0.5, a fresh shuffle each epoch. Run it on the synthetic stand-in, written out in the binary
format by cifar_dp's --save-data (which then trains on it too, printing our curve), to see that
PyTorch learns our generated data as we do:

    cargo run --release --example cifar_dp -- --save-data /tmp/synthetic-cifar
    python3 scripts/torch_cifar_synthetic.py --data-dir /tmp/synthetic-cifar

or on the real set (`--data-dir ~/data/cifar-10-batches-bin`) for its figures. The weights and
the shuffles come from torch's own generator, so the numbers match ours in distribution (run a
few --seed values), not digit for digit.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from torch_net_bench import Net  # the tutorial's Net, as the speed twin defines it

TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
TEST_FILE = "test_batch.bin"
RECORD = 1 + 3 * 32 * 32


def read(paths, limit):
    """Images (N, 3, 32, 32) normalised to [-1, 1] and labels (N,) from binary files."""
    raw = np.concatenate([np.fromfile(p, dtype=np.uint8) for p in paths])
    records = raw.reshape(-1, RECORD)
    if limit is not None:
        records = records[:limit]
    labels = torch.from_numpy(records[:, 0].astype(np.int64))
    pixels = torch.from_numpy(records[:, 1:].astype(np.float32)).reshape(-1, 3, 32, 32)
    return (pixels / 255.0 - 0.5) / 0.5, labels


def evaluate(net, x, y):
    with torch.no_grad():
        logits = net(x)
        loss = F.cross_entropy(logits, y).item()
        correct = (logits.argmax(1) == y).sum().item()
    return loss, correct


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="folder with data_batch_*.bin, test_batch.bin")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--train-size", type=int, help="use only the first N training images")
    p.add_argument("--test-size", type=int, help="use only the first N test images")
    p.add_argument("--seed", type=int, default=0, help="torch's seed: weights and shuffles")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--log-every", type=int, default=0, help="also print the training loss every N steps"
    )
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_x, train_y = read(
        [os.path.join(args.data_dir, f) for f in TRAIN_FILES], args.train_size
    )
    test_x, test_y = read([os.path.join(args.data_dir, TEST_FILE)], args.test_size)
    print(f"{len(train_y)} training and {len(test_y)} test images from {args.data_dir}")

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    started = time.perf_counter()
    step = 0
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train_y))
        loss_sum = 0.0
        for start in range(0, len(order), args.batch_size):
            idx = order[start : start + args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(net(train_x[idx]), train_y[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            step += 1
            if args.log_every and step % args.log_every == 0:
                print(f"  step {step}: training loss {loss.item():.4f}")
        loss, correct = evaluate(net, test_x, test_y)
        n = len(test_y)
        print(
            f"Epoch {epoch}/{args.epochs}: training loss {loss_sum / len(train_y):.4f}; "
            f"Test set: Average loss: {loss:.4f}, Accuracy: {correct}/{n} "
            f"({100.0 * correct / n:.0f}%)"
        )
    print(f"Finished in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
