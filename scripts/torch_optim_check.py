"""candle_parallel::optim's AdamW and Sgd against torch.optim.AdamW and torch.optim.SGD on the
CPU: 20 steps of a small MLP on the same data from the same weights, in f32 and in f64; and 20
steps from the same gradients in f32, f64, f16 and bf16, ours and torch's measured against f64.

    python3 scripts/torch_optim_check.py                  # needs torch (pip install torch)
    python3 scripts/torch_optim_check.py --binary target/debug/examples/optim_twin
    python3 scripts/torch_optim_check.py --keep DIR        # keep the .npz files

Writes the weights, the batches and each case's hyper-parameters (seeded), runs `cargo run
--example optim_twin` on them (or the --binary given), and compares the weights after every step
with torch's (single-tensor implementation, foreach=False, whose arithmetic order ours follows).
Prints the largest absolute difference of each case, after the first step and over all steps.
Exits non-zero when one exceeds 1e-5 in f32 or 1e-10 in f64.

The second table steps parameters of several magnitudes (values around 1, around 100 with
gradients of 1e-3, and a parameter of no elements) with the same given gradients in each dtype
(open loop: the gradients are inputs, so the optimizers' arithmetic alone is compared), from
values rounded to the dtype. Ours and torch's parameters after every step are measured against
torch's f64 run from the same rounded values (the largest absolute difference over all steps).
It fails when ours is NaN or inf where the f64 run is not, or off by more than twice torch's
error plus two roundings of the dtype at the largest parameter; in f64 (where torch is the
reference) when ours is off by more than 1e-10 relative. AdamW keeps f32 state for f16 and bf16
parameters, where torch keeps their dtype: ours is expected closer to f64 there. Sgd in bf16 and
f16 is torch's CPU arithmetic (each op in f32, rounded once; `mul_`'s factor in f32, an add's
`alpha` rounded to the dtype): the column "ours vs torch" shows how close.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = {"f32": 1e-5, "f64": 1e-10}
DTYPES = {"f32": torch.float32, "f64": torch.float64}
PARAMS = ["w1", "b1", "w2", "b2"]
STEPS, BATCH, IN, HIDDEN, OUT = 20, 16, 5, 8, 3

# name: (kind, options). kind 0 is AdamW, 1 is SGD.
CASES = {
    "adamw": (0, dict(lr=1e-2)),
    "adamw_torch_defaults": (0, dict()),
    "adamw_wd0.1_eps1e-6": (0, dict(lr=1e-2, weight_decay=0.1, eps=1e-6)),
    "adamw_no_decay": (0, dict(lr=1e-2, weight_decay=0.0)),
    "adamw_amsgrad": (0, dict(lr=1e-2, amsgrad=True)),
    "adamw_maximize": (0, dict(lr=1e-3, maximize=True)),
    "adamw_beta1_0.3": (0, dict(lr=1e-2, betas=(0.3, 0.99))),
    "sgd": (1, dict(lr=0.1)),
    "sgd_momentum_decay": (1, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "sgd_nesterov": (1, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "sgd_dampening_maximize": (1, dict(lr=0.01, momentum=0.5, dampening=0.3, maximize=True)),
}


def config_vector(kind, o):
    """The 11 numbers optim_twin reads: kind, lr, beta1, beta2, eps, weight_decay, amsgrad,
    maximize, momentum, dampening, nesterov (torch's defaults where not given)."""
    if kind == 0:
        betas = o.get("betas", (0.9, 0.999))
        v = [0, o.get("lr", 1e-3), betas[0], betas[1], o.get("eps", 1e-8),
             o.get("weight_decay", 1e-2), o.get("amsgrad", False), o.get("maximize", False), 0, 0, 0]
    else:
        v = [1, o.get("lr", 1e-3), 0, 0, 0, o.get("weight_decay", 0.0), 0,
             o.get("maximize", False), o.get("momentum", 0.0), o.get("dampening", 0.0),
             o.get("nesterov", False)]
    return np.array(v, dtype=np.float64)


OPEN_DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16,
               "bf16": torch.bfloat16}
EPSILON = {"f32": 2.0 ** -23, "f64": 2.0 ** -52, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}


def open_base(rng):
    """Parameters (f64) and the gradients of every step, for the open-loop runs."""
    params = [rng.standard_normal((6, 5)), 100.0 + rng.standard_normal(7), np.zeros((0, 4)),
              rng.standard_normal(3) * 1e-3]
    scales = [1.0, 1e-3, 1.0, 1e-2]
    grads = [[rng.standard_normal(p.shape) * sc for p, sc in zip(params, scales)]
             for _ in range(STEPS)]
    return params, grads


def round_to(a, dname):
    """`a` rounded to `dname` by torch, held exactly as f32 (f64 for f64)."""
    t = torch.tensor(a, dtype=torch.float64).to(OPEN_DTYPES[dname])
    return t.double().numpy() if dname == "f64" else t.float().numpy()


def torch_open(params, grads, kind, options, dtype):
    """torch's parameters (f64 arrays) after each step of the given gradients, in `dtype`."""
    ps = [torch.tensor(p).to(dtype).requires_grad_(True) for p in params]
    if kind == 0:
        opt = torch.optim.AdamW(ps, foreach=False, **options)
    else:
        opt = torch.optim.SGD(ps, foreach=False, **options)
    out = []
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = torch.tensor(g).to(dtype)
        opt.step()
        out.append([p.detach().double().numpy().copy() for p in ps])
    return out


def error(got, want):
    """The largest |got - want|; inf when `got` is NaN or inf where `want` is finite."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.size == 0:
        return 0.0
    finite = np.isfinite(want)
    if not np.all(np.isfinite(got[finite])):
        return np.inf
    return float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0


def check_open(a, ours, base):
    """The dtypes table; returns whether every case held."""
    params, grads = base
    ok = True
    print(f"\n{'case':<26} {'dtype':<5} {'ours vs f64':>12} {'torch vs f64':>13}"
          f" {'ours vs torch':>14}  largest |p|")
    for name, (kind, options) in CASES.items():
        for dname, dtype in OPEN_DTYPES.items():
            p0 = [round_to(p, dname) for p in params]
            gs = [[round_to(g, dname) for g in step] for step in grads]
            reference = torch_open(p0, gs, kind, options, torch.float64)
            theirs = torch_open(p0, gs, kind, options, dtype)
            mine = max(error(ours[f"open.{name}.{dname}.{s}.p{j}"], want)
                       for s, step in enumerate(reference) for j, want in enumerate(step))
            torch_err = max(error(got, want) for got_step, want_step in zip(theirs, reference)
                            for got, want in zip(got_step, want_step))
            apart = max(error(ours[f"open.{name}.{dname}.{s}.p{j}"], got)
                        for s, step in enumerate(theirs) for j, got in enumerate(step))
            size = max(float(np.abs(p).max()) for step in reference for p in step if p.size)
            allowed = 1e-10 * size if dname == "f64" else \
                2 * torch_err + 2 * EPSILON[dname] * size
            bad = not mine <= allowed
            ok &= not bad
            print(f"{name:<26} {dname:<5} {mine:>12.3e} {torch_err:>13.3e} {apart:>14.3e}"
                  f"  {size:.3f}" + ("  <-- worse than torch" if bad else ""))
    return ok


def inputs(seed):
    rng = np.random.default_rng(seed)
    a = dict(w1=rng.standard_normal((HIDDEN, IN)) * 0.5, b1=rng.standard_normal(HIDDEN) * 0.1,
             w2=rng.standard_normal((OUT, HIDDEN)) * 0.5, b2=rng.standard_normal(OUT) * 0.1,
             x=rng.standard_normal((STEPS, BATCH, IN)), y=rng.standard_normal((STEPS, BATCH, OUT)))
    # f32-representable values, so that both dtypes start from the same numbers.
    a = {k: v.astype(np.float32).astype(np.float64) for k, v in a.items()}
    for name, (kind, options) in CASES.items():
        a[f"cfg.{name}"] = config_vector(kind, options)
    params, grads = base = open_base(rng)
    for dname in OPEN_DTYPES:
        for j, p in enumerate(params):
            a[f"open.{dname}.p{j}"] = round_to(p, dname)
        for s, step in enumerate(grads):
            for j, g in enumerate(step):
                a[f"open.{dname}.g{s}.{j}"] = round_to(g, dname)
    return a, base


def torch_run(a, kind, options, dtype):
    """torch's weights after each step: a list of dicts."""
    params = [torch.tensor(a[p], dtype=dtype, requires_grad=True) for p in PARAMS]
    if kind == 0:
        opt = torch.optim.AdamW(params, foreach=False, **options)
    else:
        opt = torch.optim.SGD(params, foreach=False, **options)
    x, y = torch.tensor(a["x"], dtype=dtype), torch.tensor(a["y"], dtype=dtype)
    w1, b1, w2, b2 = params
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        pred = torch.tanh(x[s] @ w1.T + b1) @ w2.T + b2
        ((pred - y[s]) ** 2).mean().backward()
        opt.step()
        out.append({p: t.detach().numpy().astype(np.float64) for p, t in zip(PARAMS, params)})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--binary", help="a built optim_twin to run instead of cargo run")
    parser.add_argument("--keep", help="a folder to keep the .npz files in")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = args.keep or tempfile.mkdtemp(prefix="optim-twin-")
    os.makedirs(folder, exist_ok=True)
    in_path, out_path = os.path.join(folder, "in.npz"), os.path.join(folder, "out.npz")
    a, base = inputs(args.seed)
    np.savez(in_path, **a)
    command = [args.binary] if args.binary else [
        "cargo", "run", "-q", "--example", "optim_twin", "--"]
    subprocess.run(command + [in_path, out_path], check=True, cwd=ROOT)
    ours = np.load(out_path)

    failed = False
    print(f"{'case':<26} {'dtype':<5} {'step 1':>10} {'all 20 steps':>13}  largest |weight|")
    for name, (kind, options) in CASES.items():
        for dname, dtype in DTYPES.items():
            theirs = torch_run(a, kind, options, dtype)
            diffs, largest = [], 0.0
            for s, want in enumerate(theirs):
                d = 0.0
                for p in PARAMS:
                    got = ours[f"{name}.{dname}.{s}.{p}"].astype(np.float64)
                    d = max(d, float(np.max(np.abs(got - want[p]))))
                    largest = max(largest, float(np.max(np.abs(want[p]))))
                diffs.append(d)
            worst = max(diffs)
            bad = worst > TOLERANCE[dname]
            failed |= bad
            print(f"{name:<26} {dname:<5} {diffs[0]:>10.2e} {worst:>13.2e}  {largest:.3f}"
                  + ("  <-- too far" if bad else ""))
    failed |= not check_open(a, ours, base)
    if not args.keep:
        for p in (in_path, out_path):
            os.remove(p)
        os.rmdir(folder)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
