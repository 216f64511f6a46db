#!/usr/bin/env bash
# Video DiT (Megatron entry point) on NNODES machines x 8 GPUs over InfiniBand, CP = NNODES * 8.
# Run the same command on every machine with NODE_RANK=0..NNODES-1 and MASTER_ADDR = machine 0's address:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash configs/multinode/dit_megatron_nnodes.sh
# The mesh detects the machines from the hostnames (--sp-nodes overrides); CP_TYPE=tas puts Ulysses
# across machines and the ring inside (StreamFusion), usp the reverse, torus stages the cross-machine
# exchange; --sp-placement auto picks usp/tas by the inter-machine volume (tools/topology_report.py).
# Wan-14B dims, 41 latent frames x 60 x 104 -> 41 x 30 x 52 = 63,960 tokens per sample.
set -euo pipefail
cd "$(dirname "$0")/../.."
NNODES=${NNODES:?set NNODES}
GPUS=${GPUS_PER_NODE:-8}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
torchrun --nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" --nproc-per-node "$GPUS" \
  --master-addr "${MASTER_ADDR:?set MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}" \
  training/pretrain_video_dit.py --model "${MODEL:-wan-14b}" --num-layers "${LAYERS:-40}" \
  --context-parallel-size $((NNODES * GPUS)) --cp-comm-type "${CP_TYPE:-tas}" --sp-placement "${PLACEMENT:-auto}" \
  --sp-ring-variant "${RING:-tasp}" --frames "${FRAMES:-41}" --latent-size 60x104 --bf16 --lr 1e-4 \
  --train-iters "${ITERS:-20}" --log-dir "${LOG_DIR:-runs/dit_megatron_${NNODES}x${GPUS}}" "$@"
