"""candle_parallel::nn's fused layers against PyTorch on the CPU: values and the gradients of
every input, in f32; and every layer's error in f32, f64, f16 and bf16 on adversarial inputs,
ours and torch's, both against an f64 computation.

    python3 scripts/torch_layers_check.py            # needs torch (pip install torch)
    python3 scripts/torch_layers_check.py --keep DIR  # keep the .npz files
    python3 scripts/torch_layers_check.py --bench [--device cuda] [--dtype bf16]

Writes the inputs (seeded), runs `cargo run --example fused_layers_twin` on them, and compares
its outputs and gradients with torch.nn.functional's layer_norm, rms_norm, softmax, conv2d,
linear and batch_norm (our SyncBatchNorm over two ranks), and with rotary embeddings written in
torch ops (torch has no rope function; these follow the formulas of candle's rope, rope_i and
rope_thd).

Two checks, two tables:
- parity, f32 on ordinary inputs: fails when a value differs from torch's by more than 1e-5
  relative to the largest value of its array (absolute below 1);
- dtypes: each layer in f32, f64, f16 and bf16 on adversarial inputs (rows of mean 1e3 and
  spread 0.1, rows of 4096 and more values, batches of no rows, NaN and inf), from inputs
  rounded to the dtype. Ours and torch's results in that dtype are both measured against torch
  in f64 on the same rounded inputs: the largest absolute error over the finite values, and
  NaN where the f64 result has NaN. Fails when ours has NaN or inf where the f64 result does
  not (or not where it does), or when our error exceeds twice torch's plus two roundings of
  the dtype at the array's largest value: a different order of f32 additions (gemm's against
  MKL's products, lanes against torch's cascade sums) moves an error by such factors, where the
  defects this guards against (a variance that cancels, sums in bf16) are off by orders of
  magnitude. In f64 the reference is torch's own result, so torch's column reads 0 and ours
  is our distance from it, held to 1e-9 relative (torch's f64 layer norm is itself off by
  ~1e-11 at mean 1e3).

--bench instead times PyTorch's layers at the sizes of `cargo bench --bench fused_layers` and
prints the same columns where torch has them: the forward, and a step (forward and backward of
sum(y * g)). Medians of --reps runs, in ms.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

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
    # The CIFAR Net's fused blocks: its two convolutions with ReLU and 2x2 max-pooling (and an
    # odd-sized one), its linear layers with and without ReLU (and an odd-sized one).
    for i, (x, w) in enumerate([((2, 3, 32, 32), (6, 3, 5, 5)), ((3, 6, 14, 14), (16, 6, 5, 5)),
                                ((2, 2, 9, 11), (5, 2, 3, 3))]):
        y = (x[0], w[0], (x[2] - w[2] + 1) // 2, (x[3] - w[3] + 1) // 2)
        out.append((f"conv_relu_pool-{i}", dict(x=randn(*x), w=randn(*w) * 0.3, b=randn(w[0]),
                                                g=randn(*y))))
    for i, (layer, n, k, o) in enumerate([("linear_relu", 128, 400, 120),
                                          ("linear_relu", 7, 13, 5), ("linear", 3, 84, 10)]):
        out.append((f"{layer}-{i}", dict(x=randn(n, k), w=randn(o, k) * 0.1, b=randn(o),
                                         g=randn(n, o))))
    return out


DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16,
          "bf16": torch.bfloat16}
# One rounding of each dtype: the unit roundoff times 2 (its epsilon).
EPSILON = {"f32": 2.0 ** -23, "f64": 2.0 ** -52, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}


def dtype_cases(rng):
    """(name, f64 arrays) of the adversarial cases; each runs in every dtype."""
    out = []

    def randn(*shape, mean=0.0, scale=1.0):
        return rng.standard_normal(shape) * scale + mean

    def norm_case(layer, desc, x, bias=True):
        n = x.shape[-1]
        arrays = dict(x=x, w=randn(n, mean=1.0, scale=0.2), g=randn(*x.shape))
        if bias:
            arrays["b"] = randn(n, scale=0.2)
        out.append((f"{layer}-{desc}", arrays))

    naninf = randn(4, 16, mean=0.5)
    naninf[1, 3], naninf[2, 5] = np.nan, np.inf
    for layer, bias in [("layer_norm", True), ("rms_norm", False)]:
        norm_case(layer, "plain", randn(8, 64, mean=0.5), bias)
        norm_case(layer, "mean1e3", randn(4, 4096, mean=1e3, scale=0.1), bias)
        norm_case(layer, "mean100", randn(16, 512, mean=100.0, scale=0.1), bias)
        norm_case(layer, "long", randn(2, 16384, mean=0.5), bias)
        norm_case(layer, "norows", np.zeros((0, 16)), bias)
        norm_case(layer, "naninf", naninf.copy(), bias)
    inf_rows = randn(4, 16)
    inf_rows[0, [1, 7]] = -np.inf
    inf_rows[1, 2] = np.inf
    inf_rows[2, 9] = np.nan
    inf_rows[3, :] = -np.inf
    for desc, x in [("zeros4096", np.zeros((2, 4096))), ("randn1023", randn(4, 1023, scale=0.5)),
                    ("long", randn(2, 16384, scale=3.0)), ("norows", np.zeros((0, 8))),
                    ("naninf", inf_rows)]:
        out.append((f"softmax_last_dim-{desc}", dict(x=x, g=randn(*x.shape))))
    for desc, (n, k, o), mean in [("ones4096", (4096, 8, 4), None), ("plain", (128, 400, 120), 0.0),
                                  ("mean100", (256, 64, 16), 100.0), ("norows", (0, 8, 4), 0.0)]:
        x = np.ones((n, k)) if mean is None else randn(n, k, mean=mean)
        g = np.ones((n, o)) if mean is None else randn(n, o)
        layer = "linear" if mean is None or desc == "norows" else "linear_relu"
        out.append((f"{layer}-{desc}", dict(x=x, w=randn(o, k, scale=0.1), b=randn(o), g=g)))
    out.append(("conv_relu_pool-plain", dict(x=randn(2, 3, 12, 12), w=randn(4, 3, 3, 3, scale=0.3),
                                             b=randn(4), g=randn(2, 4, 5, 5))))
    angles = randn(5, 3)
    out.append(("rope-plain", dict(x=randn(2, 3, 5, 6), cos=np.cos(angles), sin=np.sin(angles),
                                   g=randn(2, 3, 5, 6))))
    for desc, shape, mean, scale, rows0 in [("issue", (16, 3, 16, 16), 0.0, 1.0, 8),
                                            ("mean1e3", (8, 3, 8, 8), 1e3, 0.1, 4),
                                            ("emptyrank", (6, 2, 4, 4), 0.5, 1.0, 6)]:
        c = shape[1]
        out.append((f"batch_norm-{desc}", dict(x=randn(*shape, mean=mean, scale=scale),
                                               w=randn(c, mean=1.0, scale=0.2),
                                               b=randn(c, scale=0.2), g=randn(*shape),
                                               rows0=np.array([float(rows0)]))))
    return out


def rounded(arrays, dname):
    """The arrays rounded to `dname` (torch's rounding), as the float arrays that hold them
    exactly: f64 for f64, f32 otherwise (`rows0` stays as it is)."""
    out = {}
    for k, a in arrays.items():
        if k == "rows0":
            out[k] = a.astype(np.float32)
            continue
        t = torch.tensor(a, dtype=torch.float64).to(DTYPES[dname])
        out[k] = t.double().numpy() if dname == "f64" else t.float().numpy()
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


def torch_case(name, arrays, dtype=torch.float32):
    """PyTorch's output and the gradients of every input of sum(y * g), in `dtype` (the arrays'
    values converted to it), as f64 arrays."""
    layer = name.split("-")[0]
    names = {"layer_norm": ["x", "w", "b"], "rms_norm": ["x", "w"], "softmax_last_dim": ["x"],
             "conv_relu_pool": ["x", "w", "b"], "linear_relu": ["x", "w", "b"],
             "linear": ["x", "w", "b"], "batch_norm": ["x", "w", "b"]}
    names = names.get(layer, ["x", "cos", "sin"])
    t = {n: torch.tensor(arrays[n]).to(dtype).requires_grad_(True) for n in names}
    x = t["x"]
    if layer == "layer_norm":
        y = F.layer_norm(x, (x.shape[-1],), t["w"], t["b"], EPS)
    elif layer == "rms_norm":
        y = F.rms_norm(x, (x.shape[-1],), t["w"], EPS)
    elif layer == "softmax_last_dim":
        y = F.softmax(x, dim=-1)
    elif layer == "conv_relu_pool":
        y = F.max_pool2d(F.relu(F.conv2d(x, t["w"], t["b"])), 2)
    elif layer == "linear_relu":
        y = F.relu(F.linear(x, t["w"], t["b"]))
    elif layer == "linear":
        y = F.linear(x, t["w"], t["b"])
    elif layer == "batch_norm":
        y = F.batch_norm(x, None, None, t["w"], t["b"], training=True, eps=EPS)
    else:
        y = rope(layer, x, t["cos"], t["sin"])
    (y * torch.tensor(arrays["g"]).to(dtype)).sum().backward()
    wide = lambda v: v.detach().double().numpy()
    result = {"y": wide(y)}
    result.update({f"d_{n}": wide(t[n].grad) if t[n].grad is not None
                   else np.zeros(t[n].shape) for n in names})
    return result


def error(got, want):
    """The largest |got - want| over the finite values of `want`; inf when `got` is NaN or inf
    where `want` is not, or finite where `want` is NaN or inf."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(np.isnan(got), np.isnan(want)) or \
            not np.array_equal(np.isinf(got) & ~finite, np.isinf(want)) or \
            not np.all(np.isfinite(got[finite])):
        return np.inf
    return float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0


def check_dtypes(base, ours):
    """The dtypes table; returns the failures."""
    failures = []
    print(f"\n{'case':<28} {'dtype':<5} {'array':<5} {'ours vs f64':>12} {'torch vs f64':>13}"
          f" {'max |f64|':>10}")
    for name, arrays in base:
        for dname, dtype in DTYPES.items():
            case = f"{name}-{dname}"
            given = rounded(arrays, dname)
            reference = torch_case(name, given, torch.float64)
            theirs = torch_case(name, given, dtype)
            for what, want in reference.items():
                got = ours[f"{case}.{what}"]
                if got.shape != want.shape:
                    failures.append(f"{case}.{what}: shape {got.shape} against {want.shape}")
                    continue
                mine, torch_err = error(got, want), error(theirs[what], want)
                finite = want[np.isfinite(want)]
                size = float(np.abs(finite).max()) if finite.size else 0.0
                print(f"{name:<28} {dname:<5} {what:<5} {mine:>12.3e} {torch_err:>13.3e}"
                      f" {size:>10.3e}")
                scale = max(size, 1.0)
                allowed = 1e-9 * scale if dname == "f64" else \
                    2 * torch_err + 2 * EPSILON[dname] * scale
                if mine > allowed:
                    failures.append(f"{case}.{what}: error {mine:.3e}, torch's {torch_err:.3e}")
    return failures


def bench(device, dtype, reps):
    """PyTorch's side of benches/fused_layers.rs: the same layers, sizes and columns."""
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    dev = torch.device(device)

    def randn(*shape):
        return torch.randn(*shape, device=dev).to(dtype)

    tokens, dim = 16 * 256, 512
    b, h, t, d = 16, 8, 256, 64
    angles = torch.randn(t, d // 2, device=dev)
    cases = [
        (f"layer_norm ({tokens}, {dim})", [randn(tokens, dim), randn(dim), randn(dim)],
         lambda x, w, bias: F.layer_norm(x, (dim,), w, bias, EPS)),
        (f"rms_norm ({tokens}, {dim})", [randn(tokens, dim), randn(dim)],
         lambda x, w: F.rms_norm(x, (dim,), w, EPS)),
        (f"softmax_last_dim ({b * h * t}, {t})", [randn(b * h * t, t)],
         lambda x: F.softmax(x, dim=-1)),
        (f"rope ({b}, {h}, {t}, {d})", [randn(b, h, t, d), angles.cos().to(dtype),
                                         angles.sin().to(dtype)],
         lambda x, c, s: rope("rope", x, c, s)),
    ]

    def median_ms(f):
        for _ in range(3):
            f()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            f()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[reps // 2]

    print(f"PyTorch {torch.__version__} layers on {device}, {dtype}, medians of {reps} runs (ms)")
    print(f"{'layer':<34} {'forward':>9} {'step':>9}")
    for name, inputs, layer in cases:
        with torch.no_grad():
            forward = median_ms(lambda: layer(*inputs))
        leaves = [x.detach().requires_grad_(True) for x in inputs]
        g = torch.randn_like(layer(*leaves))

        def step():
            for x in leaves:
                x.grad = None
            (layer(*leaves) * g).sum().backward()

        print(f"{name:<34} {forward:>9.3f} {median_ms(step):>9.3f}")
    print("rope is written in torch ops (torch has no rope function)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", help="a folder to keep the .npz files in")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench", action="store_true", help="time torch's layers instead")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if args.bench:
        torch.set_num_threads(int(os.environ.get("TORCH_THREADS", torch.get_num_threads())))
        bench(args.device, args.dtype, args.reps)
        return
    folder = args.keep or tempfile.mkdtemp(prefix="torch-layers-")
    os.makedirs(folder, exist_ok=True)
    all_cases = cases(np.random.default_rng(args.seed))
    base = dtype_cases(np.random.default_rng(args.seed + 1))
    inputs = os.path.join(folder, "inputs.npz")
    outputs = os.path.join(folder, "ours.npz")
    arrays = {f"{c}.{n}": a for c, arrays in all_cases for n, a in arrays.items()}
    for name, case in base:
        for dname in DTYPES:
            arrays.update({f"{name}-{dname}.{n}": a for n, a in rounded(case, dname).items()})
    np.savez(inputs, **arrays)
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
    failures += check_dtypes(base, ours)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print(f"all {len(all_cases)} f32 cases match PyTorch {torch.__version__}; all "
          f"{len(base) * len(DTYPES)} dtype cases are as accurate as PyTorch's")


if __name__ == "__main__":
    main()
