#!/usr/bin/env bash
# Tiny video DiT, megatron-core entry point, 4 CPU processes (gloo), HCMS over CP=4.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # what torchrun would set (and then print a banner about)
DS_ACCELERATOR=cpu ${PYTHON:-.venv/bin/python} -m torch.distributed.run --nproc-per-node "${NPROC:-4}" \
  training/pretrain_video_dit.py --model tiny --context-parallel-size "${NPROC:-4}" \
  --cp-comm-type "${CP_TYPE:-hcms}" --hcms-head-chunks "${CHUNKS:-2}" \
  --frames 4,5 --latent-size 6x10 --train-iters "${ITERS:-100}" --sample-steps "${SAMPLE_STEPS:-20}" --log-dir "${LOG_DIR:-runs/dit_megatron_cpu}" "$@"
