#!/usr/bin/env bash
# Full-depth Wan 14B (40 layers) on one 8-GPU H200 machine: SP=8 (Ulysses, 40 heads / 8) with torch FSDP2
# sharding parameters, gradients and Adam state over the 8 data x context ranks, full activation recompute,
# 75,600 tokens (21 frames x 90x160 latents).
# python -m training.video_dit.memory_plan --model wan-14b --tokens 75600 --sp 8 --gpus 8 --sharding fsdp \
#   --recompute full:
#   54.6 GiB per GPU (params+grads+Adam+2 unsharded blocks 43.8, activations 9.5, exchanges 0.4) of 139 GiB.
#   Without recompute the plan says 135.3 GiB (too close to 139 to run); not yet measured on a GPU.
set -euo pipefail
GPUS=${GPUS:-8}
cd "$(dirname "$0")/../.."
torchrun --nproc-per-node "$GPUS" training/pretrain_video_dit.py \
  --model wan-14b --frames 21 --latent-size 90x160 --bf16 \
  --context-parallel-size "$GPUS" --cp-comm-type ulysses \
  --use-torch-fsdp2 --recompute-granularity full \
  --train-iters "${ITERS:-100}" --save "${SAVE:-runs/wan14b_fsdp2/ckpt}" --save-interval 50 \
  --log-dir "${LOG_DIR:-runs/wan14b_fsdp2}" "$@"
