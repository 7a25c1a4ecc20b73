#!/usr/bin/env bash
# Runs every GPU check of candle-parallel, on the GPU machine, from a folder that
# scripts/gpu-pack.sh filled (.gpu/ or .gpu-b/; a check whose binary is not in the folder is
# skipped). Everything goes to one log, $OUT/gpu-checks.log (default ./logs): the device tool
# brings back only a few files.
#
#   cd .gpu && ./gpu-checks.sh; cd ../.gpu-b && ./gpu-checks.sh
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-logs}
mkdir -p "$OUT"
LOG="$OUT/gpu-checks.log"
: > "$LOG"
for f in *.xz; do xz -d -k -f "$f" && chmod +x "${f%.xz}"; done
# Each check is bounded (CHECK_TIMEOUT seconds, default 150), so that one hang costs one
# check's time, not the sitting's: a device call has 10 minutes in all.
run() { # name, command...: runs it, logs it, and never stops the sitting
  local name=$1; shift
  # ONLY='gpu_tests|dp_throughput' runs just those checks (a second sitting's leftovers).
  if [[ -n "${ONLY:-}" && ! "$name" =~ ^(${ONLY})$ ]]; then return; fi
  # A binary of the other pack, or a script that was not copied here.
  local program=$1
  [[ "$program" == env ]] && program=$3
  [[ "$program" == python3 ]] && program=$2
  if [[ "$program" == ./* || "$program" == *.py ]] && [[ ! -e "${program#./}" ]]; then return; fi
  echo "=== $name: $*" | tee -a "$LOG"
  ( time timeout -k 5 "${CHECK_TIMEOUT:-150}" ./run-on-gpu.sh "$@" ) 2>&1 | tee -a "$LOG" | tail -n 25
  echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
nvidia-smi 2>&1 | tee -a "$LOG"
# cuDNN for the binaries built with our `cudnn` feature: the one in PyTorch's venv.
for py in "${TORCH_PYTHON:-}" /opt/torch/.venv/bin/python python3; do
  [[ -n "$py" ]] && command -v "$py" >/dev/null 2>&1 || continue
  cudnn_lib=$("$py" -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2>/dev/null) || continue
  export LD_LIBRARY_PATH="$cudnn_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "cuDNN: $cudnn_lib" | tee -a "$LOG"
  break
done
# In order of what is least proven: what has never run on a GPU first, what ran in an earlier
# sitting last. A device call has 10 minutes; a second call runs the rest with ONLY='...'.
#
# DataParallel over two devices on GPU 0 vs one (and the ordered copies under it); NCCL with
# one rank (blocking and async collectives, new_group, DDP and SyncBatchNorm against the plain
# model); TCP with CUDA tensors across two processes (collectives, DDP and SyncBatchNorm
# against one process).
run gpu_tests ./gpu --test-threads=1 --nocapture
# One epoch of CIFAR-10 (synthetic) on 2 and on 1 devices of GPU 0.
run cifar_dp_2 ./cifar_dp --epochs 1 --devices 2
run cifar_dp_1 ./cifar_dp --epochs 1 --devices 1
# Where the step's time goes: phases and layers with CUDA events, ours (with and without
# cuDNN) then PyTorch's.
run net_phases ./net_phases --batches 128,512 --steps 30
run net_phases_cudnn ./net_phases_cudnn --batches 128,512 --steps 30
run torch_net_phases python3 torch_net_bench.py --phases --batches 128,512 --steps 30
# NCCL all-reduce of 25.2 M f32 at world size 1: latency per call, and how much hides behind
# the MLP's backward when issued before it.
run async_overlap ./async_overlap --cuda
# Throughput table: 1, 2, 4 devices on GPU 0, batch 128 and 512.
run dp_throughput ./dp_throughput --devices 1,2,4 --batches 128,512 --steps 50
# PyTorch's same Net at the same batches on the same GPU, right after.
run torch_net_bench python3 torch_net_bench.py --batches 128,512 --steps 50
# DDP on NCCL (one rank), plain and with BatchNorm; two ranks sharing the GPU over TCP.
run cifar_ddp_1 ./cifar_ddp --epochs 1
run cifar_ddp_bn ./cifar_ddp --epochs 1 --batch-norm
run cifar_ddp_2_tcp env CANDLE_PARALLEL_BACKEND=tcp ./cifar_ddp --epochs 1 --nproc 2 --batch-size 64
# DDP on NCCL with one rank against the plain step (its overhead), beside PyTorch's.
run ddp_throughput ./ddp_throughput --cuda
run torch_ddp_bench python3 torch_ddp_bench.py --device cuda
# The transformer layers (pack .gpu-b): their CUDA paths against the CPU are in ./gpu above; here
# their speed beside candle-nn's fused forwards and PyTorch's layers, in f32 and bf16.
for dtype in f32 bf16; do
  run "fused_layers_$dtype" ./fused_layers --cuda --reps 50 --dtype "$dtype"
  run "torch_fused_layers_$dtype" python3 torch_layers_check.py --bench --device cuda --reps 50 --dtype "$dtype"
done
# The transformer example on NCCL at world size 1, then PyTorch's same model on the same GPU.
run transformer_ddp ./transformer_ddp --epochs 2
run torch_transformer python3 torch_transformer_bench.py --device cuda --rust ./transformer_ddp
# Sharded at world size 1 on NCCL (ZeRO-2, fully sharded: their CUDA paths), beside PyTorch's.
run transformer_zero2 ./transformer_ddp --epochs 1 --sharding zero2
run transformer_full ./transformer_ddp --epochs 1 --sharding full
run torch_sharding python3 torch_sharding_bench.py --device cuda --worlds 1 --rust ./transformer_ddp
echo "log: $LOG"
