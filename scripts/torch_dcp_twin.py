#!/usr/bin/env python3
"""The distributed checkpoint beside PyTorch's: reads a candle-parallel checkpoint folder
(index.json and the ranks' safetensors files) in Python, puts every tensor together from its
pieces (boxes and flat ranges), writes it as a PyTorch Distributed Checkpoint
(torch.distributed.checkpoint.save, FileSystemWriter), loads that back with dcp.load into a
state dict of zeros, and compares every tensor with a whole training-state file (what
`save_checkpoint` of the saving job wrote). Proves the format is readable without this crate
and that what it holds is what the job held.

    cargo test --test distributed_checkpoint -- --nocapture keep   # (or any saved folder)
    python3 scripts/torch_dcp_twin.py --ours DIR --compare FILE [--torch-out DIR2]

Prints one line per check and exits 1 on any difference.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

DTYPES = {
    "f32": torch.float32,
    "f64": torch.float64,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "u8": torch.uint8,
    "u32": torch.uint32,
    "i64": torch.int64,
}


def whole_tensors(folder):
    """Every tensor of our checkpoint in `folder`, put together from its pieces."""
    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    assert index["format"] == "candle-parallel distributed checkpoint", index["format"]
    files = [safe_open(os.path.join(folder, e["name"]), framework="pt") for e in index["files"]]
    out = {}
    for name, entry in index["tensors"].items():
        shape = entry["shape"]
        whole = torch.zeros(shape, dtype=DTYPES[entry["dtype"]])
        flat = whole.view(-1)
        covered = torch.zeros(flat.numel(), dtype=torch.int32)
        for piece in entry["pieces"]:
            data = files[piece["file"]].get_tensor(piece["key"])
            region = piece["region"]
            if "flat" in region:
                start, n = region["flat"]["start"], region["flat"]["len"]
                flat[start : start + n] = data.reshape(-1)
                covered[start : start + n] += 1
            else:
                box = region["box"]
                slices = tuple(slice(o, o + s) for o, s in zip(box["offsets"], box["sizes"]))
                whole[slices] = data.reshape(box["sizes"])
                mark = covered.view(shape) if shape else covered
                if shape:
                    mark[slices] += 1
                else:
                    mark += 1
        assert bool((covered == 1).all()), f"{name}: pieces do not tile it once"
        out[name] = whole
    return index, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ours", required=True, help="a candle-parallel distributed checkpoint folder")
    p.add_argument("--compare", help="a whole training-state safetensors file to compare with")
    p.add_argument("--torch-out", help="where to write PyTorch's checkpoint (default: a temp dir)")
    a = p.parse_args()

    index, ours = whole_tensors(a.ours)
    print(
        f"read {len(ours)} tensors saved by {index['world_size']} ranks in "
        f"{len(index['files'])} files"
    )
    out = a.torch_out or tempfile.mkdtemp(prefix="torch-dcp-")
    dcp.save(ours, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in ours.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(out), no_dist=True)
    bad = 0
    for k in ours:
        if not torch.equal(back[k], ours[k]):
            print(f"DIFFERS after torch's dcp.save/load: {k}")
            bad += 1
    print(f"torch.distributed.checkpoint round trip in {out}: {len(ours) - bad}/{len(ours)} equal")
    if a.compare:
        with safe_open(a.compare, framework="pt") as f:
            keys = set(f.keys())
            if keys != set(ours):
                print(f"DIFFERENT KEYS: only ours {sorted(set(ours) - keys)}, only theirs {sorted(keys - set(ours))}")
                bad += 1
            for k in sorted(keys & set(ours)):
                theirs = f.get_tensor(k)
                if theirs.shape != ours[k].shape or not torch.equal(theirs.to(ours[k].dtype), ours[k]):
                    diff = (theirs.double() - ours[k].double()).abs().max().item()
                    print(f"DIFFERS from {a.compare}: {k} (max {diff})")
                    bad += 1
            print(f"against {a.compare}: {len(keys & set(ours))} tensors compared, bit for bit")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
