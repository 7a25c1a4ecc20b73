#!/usr/bin/env bash
# Prints a directory holding libcudnn.so, against which the `cudnn` feature links: the cuDNN
# that PyTorch 2.11.0 (cu130) pins, nvidia-cudnn-cu13==9.19.0.56, installed once into a cache.
# On the GPU machine the same library comes from the PyTorch venv (scripts/gpu-checks.sh).
#
#   LIBRARY_PATH=$(scripts/cudnn-lib.sh) ../shared/scripts/cuda-build.sh build --features cudnn
set -euo pipefail
PIN=nvidia-cudnn-cu13==9.19.0.56
PREFIX=${CANDLE_CUDNN_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-cudnn-9.19.0.56}
lib="$PREFIX/site/nvidia/cudnn/lib"
if [ ! -e "$lib/libcudnn.so.9" ]; then
  "${PYTHON:-python3}" -m pip install --quiet --no-deps --target "$PREFIX/site" "$PIN" >&2
fi
# The wheel ships only the versioned name; the linker's -lcudnn looks for libcudnn.so.
ln -sf libcudnn.so.9 "$lib/libcudnn.so"
echo "$lib"
