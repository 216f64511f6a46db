#!/usr/bin/env bash
# Issue #53 on ONE GPU: 50-step loss curves of a block-sparse DiT run on FA4 against the same run on flex_attention,
# with the flex run in fp32 as the bf16-noise yardstick (tools/sparse_curves.py; its flags after this script's name).
#   bash tools/sparse_curves.sh                                  # top-k at ~90% sparsity, token grid 8x32x64
#   bash tools/sparse_curves.sh --variant sparse_window90 --frames 16
# Writes $OUT/sparse_curves/loss_curves.json and loss_curves.png (default OUT=./gpu_out), runs/<name>/ (each run's
# metrics.jsonl and log). Exit 0 when every compared kernel is within the noise, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source tools/gpu_install.sh || exit 1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT/sparse_curves"
python3 -c "import flash_attn.cute" 2>/dev/null || echo "sparse_curves: FlashAttention-4 does not import here (carry .fa4/ parts): the fa4 run will be refused by name"
python3 tools/sparse_curves.py --out "$OUT/sparse_curves" "$@" 2>&1 | tee "$OUT/sparse_curves/log.txt"
exit "${PIPESTATUS[0]}"
