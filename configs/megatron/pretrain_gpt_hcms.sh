#!/usr/bin/env bash
# Megatron-LM GPT pretraining with megatron_sp_ext HCMS context parallelism on one 8-GPU machine.
# Prerequisites: Megatron-LM checkout with patches/megatron_lm_gpt.diff applied, and
#   pip install -e /path/to/megatron_sp_ext
# The ONLY change against a stock launch script is the --cp-comm-type value (+ optional --hcms-head-chunks).
set -euo pipefail
MEGATRON_LM=${MEGATRON_LM:-$HOME/Megatron-LM}
GPUS=${GPUS:-8}
CP=${CP:-4}
torchrun --nproc-per-node "$GPUS" "$MEGATRON_LM/pretrain_gpt.py" \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 32768 --max-position-embeddings 32768 \
  --micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 100 --bf16 \
  --tensor-model-parallel-size 1 --context-parallel-size "$CP" \
  --cp-comm-type hcms --hcms-head-chunks auto \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
  --transformer-impl local --attention-backend local
