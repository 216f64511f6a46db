#!/usr/bin/env bash
# Wan-1.3B-dimension DiT on one 4-GPU machine (NCCL): ~32K tokens per sample
# (21 latent frames x 60 x 104 latent pixels -> 21 x 30 x 52 = 32760 tokens), bf16, CP=4.
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
torchrun --nproc-per-node "${NPROC:-4}" training/pretrain_video_dit.py --model wan-1.3b --num-layers "${LAYERS:-30}" \
  --context-parallel-size "${NPROC:-4}" --cp-comm-type "${CP_TYPE:-hcms}" --hcms-head-chunks "${CHUNKS:-auto}" \
  --frames 21 --latent-size 60x104 --bf16 --lr 1e-4 --train-iters "${ITERS:-20}" \
  --log-dir "${LOG_DIR:-runs/dit_megatron_gpu}" "$@"
