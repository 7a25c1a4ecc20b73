#!/usr/bin/env bash
# Builds the CUDA + NCCL binaries here (no GPU needed) and packs them for the GPU machine, with
# scripts/gpu-checks.sh to run everything there (../shared/GPU.md). A device call carries at
# most 64 MiB and each binary holds candle's GPU kernels (about 6 MiB compressed), so there are
# two packs, one per device call: .gpu/ (DataParallel, the Net, NCCL, DDP) and .gpu-b/ (the
# transformer layers and transformer_ddp).
#
#   scripts/gpu-pack.sh            # then, on the GPU machine, .gpu/gpu-checks.sh and
#                                  # .gpu-b/gpu-checks.sh (each skips what its pack lacks)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${CUDA_BUILD:-../shared/scripts/cuda-build.sh}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
FEATURES=cuda,nccl

"$BUILD" build --release --features "$FEATURES" --examples --bins
# Test and bench executables: cargo lists them in its JSON messages.
list() { # features, then `test --release` or `bench` (whose profile is always release)
  local features=$1; shift
  "$BUILD" "$@" --features "$features" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    kind = m.get("target", {}).get("kind", [])
    if m.get("reason") == "compiler-artifact" and m.get("executable") and kind in (["test"], ["bench"]):
        print(m["target"]["name"], m["executable"])'
}

# Debug info would double the compressed size; the GPU code (most of a binary) stays.
pack() { # folder, name, executable
  strip --strip-debug -o "$1/$2" "$3" && xz -T0 -f "$1/$2"
}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for dir in .gpu .gpu-b; do
  mkdir -p "$dir"
  grep -qx "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude"
  rm -f "$dir"/*.xz
  "$BUILD" --launcher > "$dir/run-on-gpu.sh"
  chmod +x "$dir/run-on-gpu.sh"
done
# What travels is limited to 64 MiB, and each binary carries candle's GPU kernels (about 6 MiB
# compressed): only what needs the GPU goes. The CPU suites run in CI.
for example in cifar_dp cifar_ddp; do
  pack .gpu "$example" "$CARGO_TARGET_DIR/release/examples/$example"
done
pack .gpu-b transformer_ddp "$CARGO_TARGET_DIR/release/examples/transformer_ddp"
{ list "$FEATURES" test --release; list "$FEATURES" bench; } | while read -r name exe; do
  case "$name" in
    gpu|dp_throughput|ddp_throughput|net_phases|async_overlap) pack .gpu "$name" "$exe" ;;
    fused_layers) pack .gpu-b "$name" "$exe" ;;
  esac
done
# net_phases again with our `cudnn` feature, linked against the cuDNN that PyTorch pins (its
# own target folder, as the features differ). On the GPU machine cuDNN comes from PyTorch's venv.
cudnn_lib=$(scripts/cudnn-lib.sh)
LIBRARY_PATH="$cudnn_lib${LIBRARY_PATH:+:$LIBRARY_PATH}" CARGO_TARGET_DIR=target-cudnn \
  list "$FEATURES,cudnn" bench --bench net_phases | while read -r name exe; do
  pack .gpu "${name}_cudnn" "$exe"
done
cp scripts/gpu-checks.sh scripts/torch_net_bench.py scripts/torch_ddp_bench.py .gpu/
cp scripts/gpu-checks.sh scripts/torch_layers_check.py scripts/torch_transformer_bench.py \
  scripts/torch_sharding_bench.py .gpu-b/
for dir in .gpu .gpu-b; do
  du -sh "$dir"
  total=$(du -sk "$dir" | cut -f1)
  if [ "$total" -gt $((60 * 1024)) ]; then
    echo "gpu-pack: $dir holds ${total} KiB, too close to the 64 MiB a device call carries" >&2
    exit 1
  fi
  ls -l "$dir"
done
