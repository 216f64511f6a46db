#!/usr/bin/env bash
# The CUDA suite on a GPU machine, first thing on every GPU machine (before any benchmark):
#   bash tools/gpu_run.sh [pytest -k expression]        (or: make test-gpu)
# Installs the wheels carried as parts in .fa4/ (tools/gpu_wheels.sh; FlashAttention-4 among them: then
# SPX_REQUIRE_FA4=1 and the fa4 family must run) or in .whl/ (pytest, megatron-core, deepspeed and their needs) when the machine lacks
# them, runs tests/gpu/test_cuda.py (P=2 and P=4 ranks on GPU 0 over gloo; one rank per GPU over NCCL where there are
# enough GPUs) and writes every case's errors under $SPX_CUDA_REPORT (default: $OUT/cuda_suite or ./cuda_suite).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# wheels carried as parts in .fa4/ (tools/gpu_wheels.sh: FlashAttention-4, megatron-core, deepspeed)
source tools/gpu_install.sh || exit 1
if [ -d .whl ] && ! python3 -c "import pytest, megatron.core, deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
export SPX_CUDA_REPORT=${SPX_CUDA_REPORT:-${OUT:-.}/cuda_suite}
mkdir -p "$SPX_CUDA_REPORT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$SPX_CUDA_REPORT/gpus.txt"
python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_cuda.py ${1:+-k "$1"} 2>&1 | tee "$SPX_CUDA_REPORT/log.txt"
exit "${PIPESTATUS[0]}"
