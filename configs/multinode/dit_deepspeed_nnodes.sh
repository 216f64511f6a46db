#!/usr/bin/env bash
# Video DiT (DeepSpeed entry point, ZeRO-2 bf16) on NNODES machines x 8 GPUs; SP = the JSON's
# sequence_parallel_size (configs/deepspeed/zero2_bf16_tas_multinode.json: 16 = 2 x 8, TAS + TASP,
# placement auto, nodes 2). For 4 x 8 set "sequence_parallel_size": 32 and "nodes": 4 in a copy (CONFIG=...).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash configs/multinode/dit_deepspeed_nnodes.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
NNODES=${NNODES:?set NNODES}
GPUS=${GPUS_PER_NODE:-8}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
torchrun --nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" --nproc-per-node "$GPUS" \
  --master-addr "${MASTER_ADDR:?set MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}" \
  training/train_deepspeed.py --deepspeed-config "${CONFIG:-configs/deepspeed/zero2_bf16_tas_multinode.json}" \
  --model "${MODEL:-wan-14b}" --num-layers "${LAYERS:-40}" --frames "${FRAMES:-41}" --latent-size 60x104 \
  --train-iters "${ITERS:-20}" --log-dir "${LOG_DIR:-runs/dit_deepspeed_${NNODES}x${GPUS}}" "$@"
