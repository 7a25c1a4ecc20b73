"""candle_parallel::nn's fused layers against PyTorch on the CPU: values and the gradients of
every input, in f32.

    python3 scripts/torch_layers_check.py            # needs torch (pip install torch)
    python3 scripts/torch_layers_check.py --keep DIR  # keep the .npz files

Writes the inputs (seeded), runs `cargo run --example fused_layers_twin` on them, and compares
its outputs and gradients with torch.nn.functional's layer_norm, rms_norm and softmax, and with
rotary embeddings written in torch ops (torch has no rope function; these follow the formulas of
candle's rope, rope_i and rope_thd). Exits non-zero when a value differs by more than 1e-5
relative to the largest value of its array (absolute below 1).
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

EPS = 1e-5
TOLERANCE = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cases(rng):
    """(name, dict of f32 arrays) for each case; names start with the layer."""
    out = []

    def randn(*shape, mean=0.0):
        return (rng.standard_normal(shape) + mean).astype(np.float32)

    for i, shape in enumerate([(2, 3, 7), (1, 5), (4, 1), (3, 13), (8, 64)]):
        n = shape[-1]
        out.append((f"layer_norm-{i}", dict(x=randn(*shape, mean=0.5), w=randn(n, mean=1.0),
                                            b=randn(n), g=randn(*shape))))
        out.append((f"rms_norm-{i}", dict(x=randn(*shape, mean=0.5), w=randn(n, mean=1.0),
                                          g=randn(*shape))))
        out.append((f"softmax_last_dim-{i}", dict(x=randn(*shape), g=randn(*shape))))
    for kind in ["rope", "rope_i", "rope_thd"]:
        for i, (dims, batched) in enumerate([((2, 3, 5, 6), False), ((1, 1, 1, 2), False),
                                             ((3, 2, 4, 8), True)]):
            seq = dims[1] if kind == "rope_thd" else dims[2]
            table = (dims[0], seq, dims[3] // 2) if batched else (seq, dims[3] // 2)
            angles = randn(*table)
            out.append((f"{kind}-{i}", dict(x=randn(*dims), cos=np.cos(angles),
                                            sin=np.sin(angles), g=randn(*dims))))
    return out


def rope(kind, x, cos, sin):
    """candle's rotary embeddings in torch ops: x (b, h, t, d), or (b, t, h, d) for rope_thd."""
    half = x.shape[-1] // 2
    batched = cos.dim() == 3
    if kind == "rope_thd":
        shape = (x.shape[0] if batched else 1, x.shape[1], 1, half)
    else:
        shape = (x.shape[0] if batched else 1, 1, x.shape[2], half)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if kind == "rope_i":
        pairs = x.reshape(*x.shape[:-1], half, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).reshape(x.shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


def torch_case(name, arrays):
    """PyTorch's output and the gradients of every input of sum(y * g)."""
    layer = name.split("-")[0]
    names = {"layer_norm": ["x", "w", "b"], "rms_norm": ["x", "w"], "softmax_last_dim": ["x"]}
    names = names.get(layer, ["x", "cos", "sin"])
    t = {n: torch.tensor(arrays[n], requires_grad=True) for n in names}
    x = t["x"]
    if layer == "layer_norm":
        y = F.layer_norm(x, (x.shape[-1],), t["w"], t["b"], EPS)
    elif layer == "rms_norm":
        y = F.rms_norm(x, (x.shape[-1],), t["w"], EPS)
    elif layer == "softmax_last_dim":
        y = F.softmax(x, dim=-1)
    else:
        y = rope(layer, x, t["cos"], t["sin"])
    (y * torch.tensor(arrays["g"])).sum().backward()
    result = {"y": y.detach().numpy()}
    result.update({f"d_{n}": t[n].grad.numpy() for n in names})
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", help="a folder to keep the .npz files in")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="torch-layers-")
    os.makedirs(folder, exist_ok=True)
    all_cases = cases(np.random.default_rng(args.seed))
    inputs = os.path.join(folder, "inputs.npz")
    outputs = os.path.join(folder, "ours.npz")
    np.savez(inputs, **{f"{c}.{n}": a for c, arrays in all_cases for n, a in arrays.items()})
    subprocess.run(["cargo", "run", "-q", "--example", "fused_layers_twin", "--", inputs,
                    outputs], cwd=ROOT, check=True)
    ours = np.load(outputs)
    worst, failures = 0.0, []
    print(f"{'case':<22} {'array':<7} {'max |ours - torch|':>19} {'max |torch|':>12}")
    for name, arrays in all_cases:
        for what, expected in torch_case(name, arrays).items():
            got = ours[f"{name}.{what}"]
            if got.shape != expected.shape:
                failures.append(f"{name}.{what}: shape {got.shape} against {expected.shape}")
                continue
            diff = float(np.abs(got.astype(np.float64) - expected).max()) if got.size else 0.0
            size = float(np.abs(expected).max()) if expected.size else 0.0
            worst = max(worst, diff / max(size, 1.0))
            print(f"{name:<22} {what:<7} {diff:>19.3e} {size:>12.3e}")
            if diff > TOLERANCE * max(size, 1.0):
                failures.append(f"{name}.{what}: differs by {diff:.3e} (largest {size:.3e})")
    print(f"worst difference {worst:.3e} (relative, absolute below 1); tolerance {TOLERANCE}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print(f"all {len(all_cases)} cases match PyTorch {torch.__version__}")


if __name__ == "__main__":
    main()
