#!/usr/bin/env bash
# Runs every GPU check of candle-parallel, on the GPU machine, from the folder that
# scripts/gpu-pack.sh filled (.gpu/; a check whose binary or script is not there is skipped).
# Everything goes to one log, $OUT/gpu-checks.log (default ./logs), charts beside it.
#
#   cd .gpu && ./gpu-checks.sh                 # every check, in order of what is least proven
#   ONLY='gpu_tests|cifar_dp_2' ./gpu-checks.sh  # just those (a second sitting's leftovers)
#
# A device call has 10 minutes and a session about 15 minutes of device time in all, so the
# sitting has a deadline (DEADLINE seconds from the start, default 540): each check is bounded
# by its own timeout and by what is left, and the checks after the deadline are listed as not
# run, so that one hang costs one check's time and the log always comes back.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-logs}
mkdir -p "$OUT"
LOG="$OUT/gpu-checks.log"
: > "$LOG"
START=$SECONDS
DEADLINE=${DEADLINE:-540}
for f in *.xz; do xz -d -k -f "$f" && chmod +x "${f%.xz}"; done
run() { # [T=seconds] name, command...: runs it, logs it, and never stops the sitting
  local name=$1; shift
  if [[ -n "${ONLY:-}" && ! "$name" =~ ^(${ONLY})$ ]]; then return; fi
  # A binary or script that was not packed.
  local program=$1
  [[ "$program" == env ]] && program=$3
  [[ "$program" == python3 ]] && program=$2
  if [[ "$program" == ./* || "$program" == *.py ]] && [[ ! -e "${program#./}" ]]; then
    echo "=== $name: skipped, $program is not in this pack" | tee -a "$LOG"
    return
  fi
  local left=$((DEADLINE - (SECONDS - START)))
  if ((left < 20)); then
    echo "=== $name: not run, the sitting's deadline has passed" | tee -a "$LOG"
    return
  fi
  local limit=${T:-90}
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s, at $((SECONDS - START))s): $*" | tee -a "$LOG"
  ( time timeout -k 5 "$limit" ./run-on-gpu.sh "$@" ) 2>&1 | tee -a "$LOG" | tail -n 30
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
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tee -a "$LOG"

# tests/gpu.rs: ordered copies between two devices of GPU 0; DataParallel over them against one
# device; the fused layers' CUDA kernels against their CPU kernels (f32, f64, f16, bf16,
# adversarial rows); NCCL with one rank; TCP with CUDA tensors across two processes.
# Our CUDA kernels for the Net's convolution blocks, max-pooling, SGD and AdamW (nn/conv_cuda.rs,
# optim/cuda.rs) run first and alone: where their checks fail, everything after runs on
# candle's ops (CANDLE_PARALLEL_CUDA_KERNELS=candle), so that every other number still comes back.
NEW_KERNELS=(our_cuda_conv_block_and_max_pool_equal_the_cpu_kernels_and_candles_ops
  the_optimizers_cuda_kernels_give_the_tensor_ops_and_the_cpu_kernels_numbers)
T=120 run gpu_tests_new_kernels ./gpu --test-threads=1 --nocapture --exact "${NEW_KERNELS[@]}"
if grep -q "^=== gpu_tests_new_kernels exit" "$LOG" && ! grep -Eq "^test result: ok\. 2 passed" "$LOG"; then
  export CANDLE_PARALLEL_CUDA_KERNELS=candle
  echo "=== our new CUDA kernels did not pass: the rest runs on candle's ops" | tee -a "$LOG"
fi
T=240 run gpu_tests ./gpu --test-threads=1 --nocapture --skip "${NEW_KERNELS[0]}" \
  --skip "${NEW_KERNELS[1]}"
# The transformer on NCCL at world size 1: DDP, ZeRO-2, fully sharded; then what large models
# use (bf16 and f16 with the scaler, activation checkpointing, clipping) under full sharding;
# then two processes sharing the GPU over TCP/shm with CUDA tensors. The CPU twin of each run
# is the same command with --cpu on any machine (same seed, same data).
TR=(--epochs 1 --train-size 4096 --test-size 500)
run transformer_ddp ./transformer_ddp "${TR[@]}"
run transformer_zero2 ./transformer_ddp "${TR[@]}" --sharding zero2
run transformer_full ./transformer_ddp "${TR[@]}" --sharding full
run transformer_full_bf16_ac_clip ./transformer_ddp "${TR[@]}" --sharding full --precision bf16 \
  --activation-checkpointing --clip-grad-norm 1
# bf16 apart (on 2026-11-26 the four together trained far worse on the GPU than on the CPU).
run transformer_bf16 ./transformer_ddp "${TR[@]}" --precision bf16
run transformer_bf16_ac ./transformer_ddp "${TR[@]}" --precision bf16 --activation-checkpointing
run transformer_bf16_full ./transformer_ddp "${TR[@]}" --precision bf16 --sharding full
run transformer_bf16_clip ./transformer_ddp "${TR[@]}" --precision bf16 --clip-grad-norm 1
run transformer_ddp_f16 ./transformer_ddp "${TR[@]}" --precision f16 --clip-grad-norm 1
# Fully sharded on NCCL gave four f32 losses in four runs on 2026-11-26 (DDP and ZeRO-2 repeat
# the CPU's bits), and with bf16, activation checkpointing and clipping 0.72 against the CPU's
# 0.59. Apart: does it repeat with every collective run alone (an ordering gap between the
# streams), with cuBLAS's repeatable workspace (cuBLAS beside a second stream), and which of
# clipping and bf16 takes it far off.
for i in 1 2; do
  run "transformer_full_again_$i" ./transformer_ddp "${TR[@]}" --sharding full
  run "transformer_full_nccl_sync_$i" env CANDLE_PARALLEL_NCCL_SYNC=1 ./transformer_ddp "${TR[@]}" \
    --sharding full
  run "transformer_full_cublas_$i" env CUBLAS_WORKSPACE_CONFIG=:4096:8 ./transformer_ddp "${TR[@]}" \
    --sharding full
done
run transformer_full_clip ./transformer_ddp "${TR[@]}" --sharding full --clip-grad-norm 1
# The same over TCP at world 1: NCCL's path against what world 1 alone does on the GPU (the
# unit's weights are views into one gathered buffer there, separate tensors at world 2).
run transformer_full_tcp_1 env CANDLE_PARALLEL_BACKEND=tcp ./transformer_ddp "${TR[@]}" \
  --sharding full
run transformer_full_clip_tcp_1 env CANDLE_PARALLEL_BACKEND=tcp ./transformer_ddp "${TR[@]}" \
  --sharding full --clip-grad-norm 1
# Every NCCL output NaN until NCCL writes it: a NaN loss names a read before the write.
run transformer_full_poison env CANDLE_PARALLEL_NCCL_POISON=1 ./transformer_ddp "${TR[@]}" \
  --sharding full --clip-grad-norm 1
run transformer_bf16_full_clip ./transformer_ddp "${TR[@]}" --sharding full --precision bf16 \
  --clip-grad-norm 1
run transformer_bf16_full_clip_sync env CANDLE_PARALLEL_NCCL_SYNC=1 ./transformer_ddp "${TR[@]}" \
  --sharding full --precision bf16 --clip-grad-norm 1
run transformer_ddp_2_tcp env CANDLE_PARALLEL_BACKEND=tcp ./transformer_ddp "${TR[@]}" --nproc 2
run transformer_full_2_tcp env CANDLE_PARALLEL_BACKEND=tcp ./transformer_ddp "${TR[@]}" --nproc 2 \
  --sharding full
# Resumable checkpoints of CUDA tensors, fully sharded: one epoch saved every 50 steps, then a
# second run that resumes there for a second epoch (its first line says where it resumed).
rm -rf /tmp/gpu-ckpt
run transformer_full_ckpt ./transformer_ddp "${TR[@]}" --sharding full --checkpoint-dir /tmp/gpu-ckpt \
  --checkpoint-every 50
run transformer_full_resume ./transformer_ddp --epochs 2 --train-size 4096 --test-size 500 \
  --sharding full --checkpoint-dir /tmp/gpu-ckpt --checkpoint-every 50
# One epoch of CIFAR-10 (synthetic) on 2 and on 1 devices of GPU 0.
run cifar_dp_2 ./cifar_dp --epochs 1 --devices 2
run cifar_dp_1 ./cifar_dp --epochs 1 --devices 1
# Tokens/s: the transformer's training step beside PyTorch's on the same GPU, and the sharded
# configurations beside FSDP2's fully_shard at world size 1 on NCCL.
T=120 run torch_transformer python3 torch_transformer_bench.py --device cuda --rust ./transformer_ddp
# Is the transformer's step bound by the host? Its tokens/s at 8x the batch, and with cudarc's
# per-argument event bookkeeping back on (candle_parallel::devices::cuda_device turns it off),
# twice in alternation beside each other; PyTorch at the larger batch too.
for i in 1 2; do
  run "transformer_time_$i" ./transformer_ddp --time-steps 50
  run "transformer_time_events_$i" env CANDLE_PARALLEL_EVENT_TRACKING=1 ./transformer_ddp \
    --time-steps 50
done
run transformer_time_b256 ./transformer_ddp --time-steps 50 --batch-size 256
run transformer_time_b256_events env CANDLE_PARALLEL_EVENT_TRACKING=1 ./transformer_ddp \
  --time-steps 50 --batch-size 256
run torch_transformer_b256 python3 torch_transformer_bench.py --device cuda --batch-size 256
T=120 run torch_sharding python3 torch_sharding_bench.py --device cuda --worlds 1 --rust ./transformer_ddp
# Where the Net's step time goes: phases and layers with CUDA events, ours (with and without
# cuDNN) then PyTorch's.
run net_phases ./net_phases --batches 128,512 --steps 30
# The same with candle's ops where ours run (on the GPU: the convolution blocks' and the
# max-pooling's kernels of nn/conv_cuda.rs), to see what they change.
run net_phases_candle ./net_phases --batches 128,512 --steps 30 --candle-kernels
run net_phases_events env CANDLE_PARALLEL_EVENT_TRACKING=1 ./net_phases --batches 128,512 \
  --steps 30
run net_phases_cudnn ./net_phases_cudnn --batches 128,512 --steps 30
run torch_net_phases python3 torch_net_bench.py --phases --batches 128,512 --steps 30
# Images/s over 1, 2, 4 devices of GPU 0 (the README's single- against multi-device chart),
# then PyTorch's same Net at the same batches on the same GPU.
run dp_throughput ./dp_throughput --devices 1,2,4 --batches 128,512 --steps 50 \
  --plot "$OUT/dp_scaling_gpu.svg"
run torch_net_bench python3 torch_net_bench.py --batches 128,512 --steps 50
# The fused layers' speed beside candle-nn's fused forwards and PyTorch's, f32 and bf16.
for dtype in f32 bf16; do
  run "fused_layers_$dtype" ./fused_layers --cuda --reps 50 --dtype "$dtype"
  run "torch_fused_layers_$dtype" python3 torch_layers_check.py --bench --device cuda --reps 50 --dtype "$dtype"
done
# NCCL all-reduce of 25.2 M f32 at world size 1: latency per call, and how much hides behind
# the MLP's backward when issued before it.
run async_overlap ./async_overlap --cuda
# DDP on NCCL with one rank against the plain step, beside PyTorch's.
# The Net only: the four models took over 3 minutes for PyTorch and 80 s for ours (2026-11-26).
run ddp_throughput ./ddp_throughput --cuda --models net
T=60 run torch_ddp_bench python3 torch_ddp_bench.py --device cuda --models net
run cifar_ddp_bn ./cifar_ddp --epochs 1 --batch-norm
# Once in six full runs of tests/gpu.rs (2026-11-26), DDP with SyncBatchNorm on NCCL left the
# plain NetBn by 0.0028: the two tests that would show it again, three times more, with what
# time is left.
for i in 1 2 3; do
  run "sync_batch_norm_again_$i" ./gpu --test-threads=1 --nocapture ddp_and_sync_batch_norm \
    training_on_the_gpu_repeats_bit_for_bit
done
echo "done at $((SECONDS - START))s; log: $LOG" | tee -a "$LOG"
