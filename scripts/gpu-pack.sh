#!/usr/bin/env bash
# Builds the CUDA + NCCL binaries here (no GPU needed) and packs them, with
# scripts/gpu-checks.sh and PyTorch's twins, into .gpu/ for one device call on the GPU machine
# (../shared/GPU.md). A call carries at most 64 MiB with the working tree, and each binary holds
# candle's GPU kernels (about 6 MiB compressed): the binaries go in order of what is least
# proven, and those that would pass the budget stay here (named at the end).
#
#   scripts/gpu-pack.sh            # then, on the GPU machine, .gpu/gpu-checks.sh
#   GPU_PACK_ONLY='gpu|transformer_ddp' scripts/gpu-pack.sh   # just those (a second sitting)
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
BUDGET_KIB=${GPU_PACK_KIB:-$((58 * 1024))}
left_out=()
pack() { # name, executable: packs it unless the pack would pass its budget
  strip --strip-debug -o ".gpu/$1" "$2" && xz -9e -T0 -f ".gpu/$1"
  if [ "$(du -sk .gpu | cut -f1)" -gt "$BUDGET_KIB" ]; then
    rm -f ".gpu/$1.xz"
    left_out+=("$1")
  fi
}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
mkdir -p .gpu
grep -qx "/.gpu/" "$exclude" 2>/dev/null || echo "/.gpu/" >> "$exclude"
rm -rf .gpu-b
rm -f .gpu/*.xz
"$BUILD" --launcher > .gpu/run-on-gpu.sh
chmod +x .gpu/run-on-gpu.sh
cp scripts/gpu-checks.sh scripts/torch_net_bench.py scripts/torch_ddp_bench.py \
  scripts/torch_layers_check.py scripts/torch_transformer_bench.py scripts/torch_sharding_bench.py .gpu/
# net_phases again with our `cudnn` feature, linked against the cuDNN that PyTorch pins (the
# same target folder: cargo keeps both feature sets apart, and candle's kernels, the slowest to
# build, are shared). On the GPU machine cuDNN comes from PyTorch's venv.
cudnn_lib=$(scripts/cudnn-lib.sh)
declare -A exe
while read -r name path; do exe[$name]=$path; done < <(
  list "$FEATURES" test --release --test gpu
  list "$FEATURES" bench --bench net_phases --bench dp_throughput --bench fused_layers \
    --bench async_overlap --bench ddp_throughput
  LIBRARY_PATH="$cudnn_lib${LIBRARY_PATH:+:$LIBRARY_PATH}" CARGO_TARGET_DIR=${CUDNN_TARGET_DIR:-$CARGO_TARGET_DIR} \
    list "$FEATURES,cudnn" bench --bench net_phases | sed 's/^net_phases /net_phases_cudnn /'
)
for example in transformer_ddp cifar_dp cifar_ddp; do
  exe[$example]=$CARGO_TARGET_DIR/release/examples/$example
done
# Least proven first (the order of gpu-checks.sh); what ran in an earlier sitting last.
for name in gpu transformer_ddp cifar_dp net_phases net_phases_cudnn dp_throughput fused_layers \
  async_overlap ddp_throughput cifar_ddp; do
  if [[ -n "${GPU_PACK_ONLY:-}" && ! "$name" =~ ^(${GPU_PACK_ONLY})$ ]]; then
    continue
  fi
  if [ -z "${exe[$name]:-}" ]; then
    echo "gpu-pack: cargo built no $name" >&2
    exit 1
  fi
  pack "$name" "${exe[$name]}"
done
du -sh .gpu
ls -l .gpu
if [ "${#left_out[@]}" -gt 0 ]; then
  echo "gpu-pack: left out for size (their checks are skipped there): ${left_out[*]}" >&2
fi
