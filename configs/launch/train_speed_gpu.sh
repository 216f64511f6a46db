#!/usr/bin/env bash
# Issue 15's table on one machine with NPROC GPUs (default 4): training-step speed, memory and MFU through the
# entry points, each run writing one JSON under OUT (tools/bench_train_step.py; see docs/training_speed.md).
# Needs megatron-core (and deepspeed for the DeepSpeed rows): pip install --no-deps wheels/*.whl
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
P=${NPROC:-4}
OUT=${OUT:-runs/train_speed}
CP=${CP_TYPE:-ulysses}
run() { torchrun --nproc-per-node "$P" "$@"; }
W13="--model wan-1.3b --frames 21 --latent-size 60x104 --bf16 --lr 1e-4 --context-parallel-size $P --cp-comm-type $CP"
W14="--model wan-14b --frames 21 --bf16 --bf16-params --use-distributed-optimizer --grad-reduce-in-bf16 --lr 1e-4 \
 --context-parallel-size $P --cp-comm-type $CP --recompute-granularity full"
# 1. wan-1.3b dims, 4 layers, 32,760 tokens: entry step vs in-run fwd+bwd+optimizer, guard on/off, bare-step agreement
run tools/bench_train_step.py --out "$OUT" --tag "wan13b_L4_32k_P$P" -- $W13 --num-layers 4 --train-iters 40
run tools/bench_dit_step.py --model wan-1.3b --num-layers 4 --frames 21 --latent-size 60x104 --forms plain \
  --out "$OUT" --tag "torchrun_P$P"
# 2. the DeepSpeed entry on the same shape (ZeRO-1, bf16)
run tools/bench_train_step.py --entry deepspeed --out "$OUT" --tag "ds_wan13b_L4_32k_P$P" -- \
  --deepspeed-config configs/deepspeed/zero1_bf16_ulysses.json --model wan-1.3b --num-layers 4 --frames 21 \
  --latent-size 60x104 --train-iters 40
# 3. wan-14b dims, 40 layers, one sample per step: 32,760 and 75,600 (21 x 45 x 80) tokens
run tools/bench_train_step.py --variants guarded --log-interval 1 --out "$OUT" --tag "wan14b_32k_P$P" -- $W14 --latent-size 60x104 \
  --train-iters 12 --timing-bare-steps 4
run tools/bench_train_step.py --variants guarded --log-interval 1 --out "$OUT" --tag "wan14b_75k_P$P" -- $W14 --latent-size 90x160 \
  --train-iters 10 --timing-bare-steps 3
run tools/bench_train_step.py --entry deepspeed --variants guarded --log-interval 1 --out "$OUT" --tag "ds_wan14b_32k_P$P" -- \
  --deepspeed-config configs/deepspeed/zero3_bf16_ulysses_wan14b.json --model wan-14b --frames 21 \
  --latent-size 60x104 --recompute-granularity full --train-iters 12 --timing-bare-steps 4
