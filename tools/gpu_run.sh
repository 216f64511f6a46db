#!/usr/bin/env bash
# The CUDA suite on a GPU machine, first thing on every GPU machine (before any benchmark):
#   bash tools/gpu_run.sh [pytest -k expression]        (or: make test-gpu)
# Installs wheels carried in .whl/ (pytest, megatron-core, deepspeed and their needs) when the machine lacks
# them, runs tests/test_cuda.py (P=2 and P=4 ranks on GPU 0 over gloo; one rank per GPU over NCCL where there are
# enough GPUs) and writes every case's errors under $SPX_CUDA_REPORT (default: $OUT/cuda_suite or ./cuda_suite).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -d .whl ] && ! python3 -c "import pytest, megatron.core, deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
export SPX_CUDA_REPORT=${SPX_CUDA_REPORT:-${OUT:-.}/cuda_suite}
mkdir -p "$SPX_CUDA_REPORT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$SPX_CUDA_REPORT/gpus.txt"
python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py ${1:+-k "$1"} 2>&1 | tee "$SPX_CUDA_REPORT/log.txt"
exit "${PIPESTATUS[0]}"
