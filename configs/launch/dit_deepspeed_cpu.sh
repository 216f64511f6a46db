#!/usr/bin/env bash
# Tiny video DiT, DeepSpeed entry point, 4 CPU processes; SP from configs/deepspeed/cpu_tiny_hcms.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # what torchrun would set (and then print a banner about)
DS_ACCELERATOR=cpu ${PYTHON:-.venv/bin/python} -m torch.distributed.run --nproc-per-node 4 training/train_deepspeed.py \
  --deepspeed-config configs/deepspeed/cpu_tiny_hcms.json --frames 4,5 --latent-size 6x10 \
  --train-iters "${ITERS:-40}" --sample-steps "${SAMPLE_STEPS:-20}" --log-dir "${LOG_DIR:-runs/dit_deepspeed_cpu}" "$@"
