#!/usr/bin/env bash
# One lent GPU session of a round, in stages that each fit one device call (<= 10 min), run back to back on the same
# warm machine (the wheels carried as parts in .fa4/: tools/gpu_wheels.sh; the first call carries part.aa only).
#   bash tools/gpu_round.sh STAGE [STAGE ...]      stages: first fa4 sp2 curves checks suite kernels steps32 steps75 extras
# Each stage writes $OUT/<stage>.tgz (its raw JSON and logs) and $OUT/<stage>.txt (the summary printed last).
# A 30-minute session, in order (each line one call; the machine stays warm only 30 s between calls):
#   1. carry .fa4/part.aa + manifest: first   (no FA4 yet: FSDP2 entry test, FSDP2 / dynamic SP at 2 ranks)
#   2. carry .fa4/part.ab + manifest: fa4     (check_fa4_layouts, check_fa4_tiles beside the FA4 block-sparse family)
#   3. sp2 (2 GPUs) or steps75, then kernels / steps32 / curves / extras as the budget allows
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source tools/gpu_install.sh || exit 1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-./gpu_out}
W=/tmp/gpu_round; mkdir -p "$W"
keep() {   # keep NAME CMD...: runs CMD with its whole output in $W/NAME.log (kept in the stage's tarball), prints its tail
  local name=$1; shift; mkdir -p "$(dirname "$W/$name")"
  "$@" > "$W/$name.log" 2>&1; local rc=$?
  grep -v "UserWarning\|exe_args" "$W/$name.log" | tail -n 15; echo "[$name: exit $rc]"
}
STEP="torchrun --nproc-per-node 1 tools/bench_train_step.py"
WAN14=(--model wan-14b --num-layers 2 --bf16 --train-iters ${ITERS:-30} --ddp-impl torch)

stage_first() {   # first call (FA4's DSL not there yet: the local kernel is cuDNN): 2-rank jobs that need no FA4
  SPX_CUDA_REPORT=$W/first/suite timeout 80 bash tools/gpu_run.sh "fsdp2_entry" 2>&1 | tail -n 8
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || return 0
  # #55 item 5, #52: FSDP2 at 2 ranks (SP=2) beside megatron DDP, the plan beside the peak
  keep first/fsdp2_p2 timeout 120 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants guarded,fsdp2 --log-interval 4 \
    --out $W/first/fsdp2_p2 -- --model wan-14b --num-layers 4 --frames 21 --latent-size 60x104 --bf16 \
    --train-iters 12 --timing-bare-steps 4 --recompute-granularity full --context-parallel-size 2
  # #55 item 3: dynamic vs uniform SP on one mixed pack (images + clips), 2 ranks
  keep first/dynamic_p2 timeout 120 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants packed,dynamic_cp --log-interval 4 \
    --out $W/first/dynamic_p2 -- --model wan-14b --num-layers 2 --bf16 --context-parallel-size 2 \
    --cp-comm-type ulysses --ddp-impl torch --frames 21,1,1,1,11,1,1,1,5,1 --latent-size 60x104 --pack-samples \
    --max-tokens-per-step 75000 --train-iters 10 --timing-bare-steps 4
}
stage_fa4() {   # second call (FA4 installed): its block sparsity checked per kernel call (GPU 1) beside the suite
  mkdir -p $W/fa4
  CUDA_VISIBLE_DEVICES=1 timeout 240 python3 tools/check_fa4_tiles.py --skip-timing --out $W/fa4/checks \
    > $W/fa4/checks.log 2>&1 &
  local bg=$!
  keep fa4/layouts timeout 90 python3 tools/check_fa4_layouts.py --out $W/fa4   # the dit_dynamic bf16 miss's suspects
  SPX_CUDA_REPORT=$W/fa4/suite timeout 250 bash tools/gpu_run.sh \
    "(fa4_block_sparse_family and (2-nccl or 4-gloo)) or (dit_dynamic and 2-nccl)" 2>&1 | grep -E "^(ok|BAD)|passed|failed" | tail -n 40
  SPX_SUITE_KERNEL=cudnn SPX_CUDA_REPORT=$W/fa4/suite_cudnn timeout 70 bash tools/gpu_run.sh "dit_dynamic and 2-nccl" \
    2>&1 | grep -E "^(ok|BAD)|passed|failed" | tail -n 10
  wait $bg; tail -n 2 $W/fa4/checks.log
}
stage_sp2() {   # #55 item 4: the step at SP=2 (one rank per GPU), wan-14b 4 layers, 75,600 tokens (full recompute: the
  # plan without it is 75.2 GiB of an H100's 79, and the run without it failed on 2 x H100, 2026-11-25)
  keep sp2/step timeout ${SP2_S:-180} torchrun --nproc-per-node 2 tools/bench_train_step.py --variants guarded,sparse_window90,sparse_topk90 \
    --log-interval 4 --out $W/sp2/wan14b_4l_21x45x80 -- --model wan-14b --num-layers 4 --bf16 --train-iters 12 \
    --timing-bare-steps 4 --ddp-impl torch --recompute-granularity full \
    --context-parallel-size 2 --frames 21 --latent-size 90x160
}
stage_curves() {  # #53: 50-step loss curves, block-sparse DiT on FA4 vs flex (fp32 flex: the noise), one GPU;
  # CURVES_ARGS: tools/sparse_curves.py's flags (e.g. "--variant sparse_window90 --frames 16")
  keep curves/run python3 tools/sparse_curves.py --out $W/curves ${CURVES_ARGS:-}
}
stage_suite() {   # the CUDA suite first: the families this round touched
  SPX_CUDA_REPORT=$W/suite bash tools/gpu_run.sh "${SUITE_K:-fa4_block_sparse or one_ring or block_sparse_family or ring_family or mesh_family or fa4_family or auto_family or fsdp2 or fused_fp32 or dit_dynamic}"
}
stage_checks() {   # a short session's checks: FA4 block sparsity per kernel call, then the CUDA suite's new cases
  timeout 170 python3 tools/check_fa4_tiles.py --skip-timing --out $W/checks 2>&1 | tail -n 3
  SPX_CUDA_REPORT=$W/checks/suite timeout 330 bash tools/gpu_run.sh \
    "fa4_block_sparse_family or fused_regions_fp32 or fsdp2_model or one_ring_family" 2>&1 | tail -n 40
}
stage_kernels() {  # the kernel table (#53): FA4 block-sparse / flex / math beside dense FA4 and cuDNN
  python3 tools/bench_block_sparse.py --heads 40 --seqlens 32768,75776 --block-size 128 --tile 4,4,8 \
    --sparsities 0.5,0.8,0.9,0.95 --ulysses-p 1 --ring-p 8 --ring-kernels fa4 --ulysses-kernels fa4,flex \
    --out $W/kernels/h40_bs128 2>&1 | tail -n 40
  python3 tools/bench_block_sparse.py --heads 40 --seqlens 32768 --block-size 64 --tile 4,4,4 \
    --sparsities 0.8,0.9 --ulysses-p 1 --ring-p 8 --ring-kernels fa4,math --ulysses-kernels fa4 \
    --out $W/kernels/h40_bs64 2>&1 | tail -n 20
  python3 tools/bench_block_sparse.py --heads 5 --seqlens 131072 --block-size 128 --tile 4,4,8 \
    --sparsities 0.8,0.9 --ulysses-p 1 --ring-p 8 --ring-kernels fa4 --ulysses-kernels fa4,flex \
    --out $W/kernels/h5_bs128 2>&1 | tail -n 20
}
stage_steps32() {  # the step (#53): wan-14b 2 layers on Wan's 480p grid and on a grid the tile cuts
  $STEP --variants guarded,sparse_window90,sparse_topk90 --out $W/steps/wan14b_21x30x52 -- "${WAN14[@]}" \
    --frames 21 --latent-size 60x104 2>&1 | tail -n 15
  $STEP --variants guarded,sparse_window90,sparse_topk90 --out $W/steps/wan14b_16x32x64 -- "${WAN14[@]}" \
    --frames 16 --latent-size 64x128 2>&1 | tail -n 15
}
stage_steps75() {  # 720p, and wan-1.3b 4 layers at 32K
  $STEP --variants guarded,sparse_window90,sparse_topk90 --out $W/steps/wan14b_21x45x80 -- "${WAN14[@]}" \
    --frames 21 --latent-size 90x160 2>&1 | tail -n 15
  $STEP --variants guarded,sparse_window90 --out $W/steps/wan13b_16x32x64 -- --model wan-1.3b --num-layers 4 --bf16 \
    --train-iters 30 --ddp-impl torch --frames 16 --latent-size 64x128 2>&1 | tail -n 15
}
stage_extras() {   # the topk90 profile beside dense, FSDP2 step and peaks (#52, #51 item 8), dynamic SP (#54)
  torchrun --nproc-per-node 1 tools/profile_train_step.py --out $W/profile --tag dense -- "${WAN14[@]}" --frames 21 --latent-size 60x104 \
    --train-iters 14 2>&1 | tail -n 12
  torchrun --nproc-per-node 1 tools/profile_train_step.py --out $W/profile --tag topk90 -- "${WAN14[@]}" --frames 21 --latent-size 60x104 \
    --train-iters 14 --sparse-attention tiles --sparse-topk 26 2>&1 | tail -n 12
  $STEP --variants guarded,fsdp2 --out $W/fsdp2 -- --model wan-14b --num-layers 4 --frames 21 --latent-size 60x104 \
    --bf16 --train-iters 24 --recompute-granularity full 2>&1 | tail -n 12
  timeout 300 torchrun --nproc-per-node 1 tools/measure_peaks.py --out $W/peaks --budget-s 240 2>&1 | tail -n 15
  python3 tools/bench_dynamic_sp.py --model wan-14b --world 8 --out $W/dynamic 2>&1 | tail -n 15
}

for s in "$@"; do
  start=$(date +%s)
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD; date -u; } \
    > "$W/$s.meta"
  "stage_$s" 2>&1 | tee "$W/$s.log" | tail -n 60 > "$OUT/$s.txt"
  echo "stage $s: $(( $(date +%s) - start )) s" | tee -a "$OUT/$s.txt"
  tar -C "$W" -czf "$OUT/$s.tgz" --exclude='*.pt' --exclude='*.pth' "$s.meta" "$s.log" \
    $(cd "$W" && ls -d first fa4 sp2 curves checks suite kernels steps profile fsdp2 peaks dynamic 2>/dev/null) 2>/dev/null
  cat "$OUT/$s.txt"
done
