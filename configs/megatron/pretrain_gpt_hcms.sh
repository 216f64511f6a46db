#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with megatron_sp_ext HCMS context parallelism on one 8-GPU machine.
# Works as written on Megatron-LM core_v0.16.x .. core_v0.19.x and main, without Transformer Engine or Apex:
#   pip install megatron_sp_ext; MEGATRON_LM=/path/to/Megatron-LM bash configs/megatron/pretrain_gpt_hcms.sh
# The change against a stock launch: "-m megatron_sp_ext.megatron.launch" before the script, and
# --cp-comm-type hcms (+ our --hcms-head-chunks). With Transformer Engine installed you may drop
# --transformer-impl local, --no-persist-layer-norm, --no-rope-fusion and --no-masked-softmax-fusion (our core attention then sits in TE's layer spec);
# never pass --attention-backend local with our attention (Megatron-LM 0.19+ would replace it).
set -euo pipefail
MEGATRON_LM=${MEGATRON_LM:-$HOME/Megatron-LM}
GPUS=${GPUS:-8}
CP=${CP:-4}
export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --nproc-per-node "$GPUS" -m megatron_sp_ext.megatron.launch "$MEGATRON_LM/pretrain_gpt.py" \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 32768 --max-position-embeddings 32768 \
  --micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 100 --bf16 \
  --tensor-model-parallel-size 1 --context-parallel-size "$CP" \
  --cp-comm-type hcms --hcms-head-chunks auto \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
  --transformer-impl local --no-persist-layer-norm --no-rope-fusion --no-masked-softmax-fusion \
  --position-embedding-type rope --normalization RMSNorm
