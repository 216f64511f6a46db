#!/usr/bin/env bash
# Wan-1.3B-dimension DiT with DeepSpeed ZeRO-2 bf16 on 4 GPUs, SP=4 HCMS (configs/deepspeed/zero2_bf16_hcms.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
torchrun --nproc-per-node 4 training/train_deepspeed.py --deepspeed-config configs/deepspeed/zero2_bf16_hcms.json \
  --model wan-1.3b --num-layers "${LAYERS:-30}" --frames 21 --latent-size 60x104 --train-iters "${ITERS:-20}" \
  --log-dir "${LOG_DIR:-runs/dit_deepspeed_gpu}" "$@"
