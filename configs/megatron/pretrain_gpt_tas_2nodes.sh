#!/usr/bin/env bash
# Two machines x 8 GPUs: StreamFusion placement (Ulysses across machines, ring inside), CP=16, Megatron-LM's
# pretrain_gpt.py through our launcher (see pretrain_gpt_hcms.sh for releases and TE notes).
# Run on each node with NODE_RANK=0/1 and MASTER_ADDR set.
set -euo pipefail
MEGATRON_LM=${MEGATRON_LM:-$HOME/Megatron-LM}
export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --nnodes 2 --node-rank "${NODE_RANK:?}" --master-addr "${MASTER_ADDR:?}" --master-port 29500 \
  --nproc-per-node 8 -m megatron_sp_ext.megatron.launch "$MEGATRON_LM/pretrain_gpt.py" \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 131072 --max-position-embeddings 131072 \
  --micro-batch-size 1 --global-batch-size 16 --lr 1e-4 --train-iters 100 --bf16 \
  --context-parallel-size 16 \
  --cp-comm-type tas --sp-ring-variant tasp --attention-dropout 0 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
  --transformer-impl local --no-persist-layer-norm --no-rope-fusion --no-masked-softmax-fusion \
  --position-embedding-type rope --normalization RMSNorm
