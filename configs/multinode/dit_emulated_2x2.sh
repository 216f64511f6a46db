#!/usr/bin/env bash
# The same multi-machine run on ONE 4-GPU box emulating 2 machines x 2 GPUs (docs/links.md):
# SPX_EMULATED_MACHINE_SIZE=2 makes topology detection see machines {0,1} and {2,3}; every exchange
# of a group that spans them sends its cross-machine segments through pinned host memory
# (comm/host_staged.py), intra-machine ones over NVLink. CP_TYPE=ulysses|hcms|usp|tas|torus|ring|tasp.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SPX_EMULATED_MACHINE_SIZE=${MACHINE_SIZE:-2}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
torchrun --nproc-per-node "${NPROC:-4}" training/pretrain_video_dit.py --model "${MODEL:-wan-14b}" \
  --num-layers "${LAYERS:-4}" --context-parallel-size "${NPROC:-4}" --cp-comm-type "${CP_TYPE:-tas}" \
  --sp-placement "${PLACEMENT:-auto}" --frames "${FRAMES:-41}" --latent-size 60x104 --bf16 --lr 1e-4 \
  --train-iters "${ITERS:-10}" --log-dir "${LOG_DIR:-runs/dit_emulated_2x2}" "$@"
