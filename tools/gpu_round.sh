#!/usr/bin/env bash
# One lent GPU session of a round, in stages that each fit one device call (<= 10 min), run back to back on the same
# warm machine (the wheels carried as parts in .fa4/: tools/gpu_wheels.sh; the first call carries part.aa only).
# Carry .fa4/commit too (git rev-parse --short HEAD > .fa4/commit): the device copy's git metadata lagged the
# working tree on 2026-11-26 (it named eeafb9a for runs of 61a0b5c..7f7f659), so the stages' .meta read that file.
#   bash tools/gpu_round.sh STAGE[@GPU] [STAGE[@GPU] ...]
# stages: first fa4 sp2 curves checks suite kernels kernels2 kernels75 steps32 steps480 steps75 steps13 profiles
# profiles2 peaks extras cudnn dyncheck s1 s2 s3 cudnn_small sdpa_calls cudnn_fix cudnn_calls fa4_dit sparse_diag
# cudnn_layout table ring_profile; #67: fsdp2_nccl recompute2 recompute2_offload peaks2 peaks4 full40_32k_sp4
# full40_32k_sp2 full40_75k_sp4 full40_75k_sp2 full40_75k_sp2_full resume40a resume40b; r7a-r7e; r8a65 r8a67 r8a4
# r8c65 r8c67 r8d69a r8d69b r8d66 (2026-11-27 evening), r9a, r10_rope r10_d4 r10_65 r10_67, r11_66a-e r11_65mem r11_69sp2 r11_69vsa, r12_bs4 r12_fa4p4 r12_65 r12_det_fa4, r13_det_kernel r13_checks r13_65
# r13_65ring r13_69vsa_sp2, r14_first r14_more, r15_cudnn r15_69 r16_cudnn2 r16_cudnn4 r16_prof69 r17_69overlap, r20_first r20_69overlap; #70: i70_ds i70_ds_time
# i70_resume i70_dyn_check i70_dyn2 i70_dyn4 i70_dyn_prof i70_dyn_model i70_tpcp i70_transport; #68: i68_te_install
# i68_cp2_nv i68_cp2_host i68_cp4_nv i68_emu22 i68_prof32 i68_prof32_host i68_views32 i68_sp1.
# A stage named with @GPU
# runs on that GPU alone (CUDA_VISIBLE_DEVICES), beside the other @GPU stages of the call (one job per GPU, so no
# timing shares a GPU); stages without @ run one after the other on every GPU. Every job's timeout is cut to the
# call's deadline (DEADLINE_S, default 540 s after the call starts), so the tarballs are written before the
# device's 600 s limit.
# Each stage writes $OUT/<stage>.tgz (its raw JSON and every job's whole log) and $OUT/<stage>.txt (its summary).
# On 4 GPUs (2026-11-26, second session): call 1 (part.aa): c1_cudnn@0 c1_dyn@1 table_flex@2 table_math+c1_ring@3 |
#   call 2 (part.ab): c2_fa4suite@0 table@1 steps75@2 curves+ring_profile@3 | call 3: steps32@0 table@1
#   steps13+profiles2@2 kernels75@3. STAGE+STAGE@GPU runs them one after the other on that GPU; @2,3 gives two GPUs.
# 2026-11-26 session 3, one GPU: call 1 (part.aa): newpaths | call 2 (part.ab): dit_sparse entry13.
# 2026-11-26 second session, 4 GPUs: call 1 (part.aa): n1 (NCCL suite, no FA4) | call 2 (part.ab): table_rest@0
#   dit_sparse+steps13@1 n2@2,3 | call 3: n4 (P=4 over NCCL, the SP=4 step).
# Before (#53's rest): call 1 (part.aa; flex needs no FA4): table_rest | call 2 (part.ab): c2_fa4suite steps13
#   (the checks of the sparse paths on that machine, then the wan-1.3b row whose entry step was 6.4% over its bare
#   step on 2026-11-26, before the SparseStepCache). On 4 GPUs: c2_fa4suite@0 steps13@1 in call 2.
# Next session on ONE GPU (#53 and the cuDNN fix; 30 min of device time):
#   machine 1: cudnn_layout (part.aa: the round's new path first) | fa4 ring_profile table (part.ab) | table | table
#   machine 2: suite, the families that need no FA4 (part.aa) | fa4 steps75 (part.ab) | curves kernels75
# A session on ONE GPU (nvidia-h200 / nvidia-h100-x1; a one-chip machine goes back after 30 min held), in order:
#   machine 1: first (part.aa) | fa4 (part.ab) | dyncheck steps75 | steps480 kernels2
#   machine 2: suite with SUITE_K = the families that need no FA4 (part.aa) | fa4 family, curves (part.ab)
# (2026-11-25/26 on one H200: results/2026-11-26_h200_sparse_dynamic/README.md; 2026-11-26 morning:
# results/2026-11-26_h200_fa4family_sparse_cudnn/README.md). Left for the next one, first machine's part.aa
# call: cudnn_layout (the dO-layout hook; the cuDNN families of the suite); then steps75 on the current code, curves
# with a stable run (--lr 2e-4), the kernel table (tools/bench_block_sparse.py), sp2 on two GPUs.
# On 2 GPUs: first | fa4 | steps32@0 profiles@1 | steps75@0 curves@1 | sp2, steps13, kernels2.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SPX_TE_BACKGROUND=1 source tools/gpu_install.sh || exit 1   # TE (if carried) installs beside the stages
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-./gpu_out}
W=/tmp/gpu_round; mkdir -p "$W"
START=$(date +%s); DEADLINE=$(( START + ${DEADLINE_S:-540} ))
keep() {   # keep NAME SECS CMD...: runs CMD (at most SECS, cut to the call's deadline) with its whole output in
  # $W/NAME.log (kept in the stage's tarball), prints its tail and its exit status
  local name=$1 secs=$2; shift 2; mkdir -p "$(dirname "$W/$name")"
  local left=$(( DEADLINE - $(date +%s) - 5 ))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 20 ]; then echo "[$name: not started, ${left}s left of the call]"; return 0; fi
  timeout "$secs" "$@" > "$W/$name.log" 2>&1; local rc=$?
  grep -v "UserWarning\|exe_args\|warnings.warn" "$W/$name.log" | tail -n 15
  echo "[$name: exit $rc$([ $rc -eq 124 ] && echo ", stopped at its ${secs}s limit")]"
}
suite() {  # suite NAME SECS EXPR [ENV=VAL ...]: the CUDA suite's cases EXPR, report under $W/NAME
  local name=$1 secs=$2 expr=$3; shift 3
  keep "$name" "$secs" env SPX_CUDA_REPORT=$W/$name "$@" bash tools/gpu_run.sh "$expr"
  grep -hE "^(ok|BAD)|passed|failed|error" "$W/$name.log" | tail -n 30
}
ngpu() { nvidia-smi -L | wc -l; }
fa4_disk_cache() {   # FA4's own persistent compile cache (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED, under /tmp, kept
  # between calls to the same warm machine): on only after two runs of two check_fa4_tiles cases (128-token tiles;
  # 64-token tiles through the mask_mod) pass with it, the second loading what the first compiled; else off
  [ -n "${SPX_REQUIRE_FA4:-}" ] || return 0
  [ -n "${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED+x}" ] && { echo "fa4 disk cache: as set ($FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED)"; return 0; }
  if [ ! -f /tmp/spx_fa4_cache.tried ]; then
    touch /tmp/spx_fa4_cache.tried
    local ok=1 i t0
    for i in 1 2; do
      t0=$(date +%s)
      FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 timeout 240 python3 tests/gpu/check_fa4_tiles.py --skip-timing \
        --cases 2,19 --out /tmp/spx_fa4_cache_probe$i > /tmp/spx_fa4_cache_probe$i.log 2>&1 || ok=0
      echo "fa4 disk cache probe $i: $(tail -n 1 /tmp/spx_fa4_cache_probe$i.log), $(( $(date +%s) - t0 )) s"
    done
    [ $ok = 1 ] && touch /tmp/spx_fa4_cache.on
  fi
  if [ -f /tmp/spx_fa4_cache.on ]; then export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1; echo "fa4 disk cache: on"
  else echo "fa4 disk cache: off"; fi
}
fa4_disk_cache
STEP="torchrun --nproc-per-node 1 tools/bench_train_step.py"
WAN14=(--model wan-14b --num-layers 2 --bf16 --train-iters ${ITERS:-30} --ddp-impl torch)

stage_first() {   # first call (FA4's DSL not there yet: the local kernel is cuDNN): what needs no FA4. dit_dynamic
  # checked on cuDNN (head dim 64 now) before dynamic SP is timed on it; the FSDP2 entry test, the FSDP2 step at one
  # rank beside the plain entry (#52) (the emulated P=8 dynamic bench runs in dyncheck, on FA4); on 2 GPUs the P=2 dynamic step and
  # FSDP2 / megatron DDP at 2 ranks with full recompute (the CheckpointError of 2026-11-25, fixed since). On one GPU
  # the jobs run one after the other (no timing shares the GPU) and the P ranks of the suite share it over gloo.
  local two=0; [ "$(ngpu)" -ge 2 ] && two=1
  suite first/dit_dynamic_cudnn 100 "dit_dynamic and $([ $two = 1 ] && echo 2-nccl || echo 2-gloo)" \
    SPX_SUITE_KERNEL=cudnn
  if [ $two = 1 ]; then
    keep first/dynamic_p2 120 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants packed,dynamic_cp \
      --log-interval 4 --out $W/first/dynamic_p2 -- --model wan-14b --num-layers 2 --bf16 --context-parallel-size 2 \
      --cp-comm-type ulysses --ddp-impl torch --frames 21,1,1,1,11,1,1,1,5,1 --latent-size 60x104 --pack-samples \
      --max-tokens-per-step 75000 --train-iters 10 --timing-bare-steps 4
  fi
  suite first/fsdp2_entry 90 "fsdp2_entry or fused_regions_fp32"
  local fsdp2=(keep first/fsdp2_1rank 200 $STEP --variants guarded,fsdp2 --out $W/first/fsdp2_1rank -- \
    --model wan-14b --num-layers 4 --frames 21 --latent-size 60x104 --bf16 --train-iters 24 --recompute-granularity full)
  "${fsdp2[@]}"
  if [ $two = 1 ]; then
    keep first/fsdp2_p2 120 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants guarded,fsdp2 \
      --log-interval 4 --out $W/first/fsdp2_p2 -- --model wan-14b --num-layers 4 --frames 21 --latent-size 60x104 \
      --bf16 --train-iters 12 --timing-bare-steps 4 --recompute-granularity full --context-parallel-size 2
  fi
}
stage_fa4() {   # second call (FA4 installed): its block sparsity checked per kernel call beside the suite; on one GPU
  # the FA4 block-sparse family (P=2 and P=4 over gloo), then the DiT's sparse step family (checks the path the
  # step benchmarks time, on this machine), then check_fa4_tiles with the time left
  mkdir -p $W/fa4
  if [ "$(ngpu)" -ge 2 ]; then
    { CUDA_VISIBLE_DEVICES=1 keep fa4/checks 240 python3 tests/gpu/check_fa4_tiles.py --skip-timing --out $W/fa4/checks
      CUDA_VISIBLE_DEVICES=1 keep fa4/layouts 200 python3 tests/gpu/check_fa4_layouts.py --out $W/fa4; } &
    local bg=$!
    suite fa4/suite 330 "fa4_block_sparse_family and (2-nccl or 4-gloo)"
    suite fa4/suite_dyn 150 "(dit_dynamic or dit_sparse) and 2-nccl"
    wait $bg
  else
    suite fa4/suite 330 "fa4_block_sparse_family"
    suite fa4/suite_sparse 220 "dit_sparse and 2-gloo"
    keep fa4/checks 240 python3 tests/gpu/check_fa4_tiles.py --skip-timing --out $W/fa4/checks
  fi
}
stage_sp2() {   # #55 item 4: the step at SP=2 (one rank per GPU), wan-14b 4 layers, 75,600 tokens (full recompute: the
  # plan without it is 75.2 GiB of an H100's 79, and the run without it failed on 2 x H100, 2026-11-25)
  keep sp2/step ${SP2_S:-240} torchrun --nproc-per-node 2 tools/bench_train_step.py \
    --variants guarded,sparse_window90,sparse_topk90 --log-interval 4 --out $W/sp2/wan14b_4l_21x45x80 -- \
    --model wan-14b --num-layers 4 --bf16 --train-iters 12 --timing-bare-steps 4 --ddp-impl torch \
    --recompute-granularity full --context-parallel-size 2 --frames 21 --latent-size 90x160
  # #55 item 2: the sparse ring across 2 GPUs (NVLink) beside the dense ring and Ulysses
  keep sp2/sparse_ring 150 torchrun --nproc-per-node 2 tools/bench_sp_block_sparse.py --seqlens 32768,75776 \
    --out $W/sp2/sparse_ring
}
stage_curves() {  # #53: 50-step loss curves, block-sparse DiT on FA4 vs flex (fp32 flex: the noise), one GPU;
  # CURVES_ARGS: tools/sparse_curves.py's flags (e.g. "--variant sparse_window90 --frames 16")
  keep curves/run 400 python3 tools/sparse_curves.py --out $W/curves ${CURVES_ARGS:-}
}
stage_suite() {   # the CUDA suite: the families the newest code touched
  suite suite ${SUITE_S:-520} "${SUITE_K:-fa4_block_sparse or one_ring or block_sparse_family or ring_family or mesh_family or fa4_family or auto_family or fsdp2 or fused_fp32 or dit_dynamic}"
}
stage_checks() {   # a short session's checks: FA4 block sparsity per kernel call, then the CUDA suite's new cases
  keep checks/tiles 170 python3 tests/gpu/check_fa4_tiles.py --skip-timing --out $W/checks
  suite checks/suite 330 "fa4_block_sparse_family or fused_regions_fp32 or fsdp2_model or one_ring_family"
}
stage_kernels() {  # the kernel table (#53): FA4 block-sparse / flex / math beside dense FA4 and cuDNN, H=40
  keep kernels/h40_bs128 330 python3 tools/bench_block_sparse.py --heads 40 --seqlens 32768,75776 --block-size 128 \
    --tile 4,4,8 --sparsities 0.5,0.8,0.9,0.95 --ulysses-p 1 --ring-p 8 --ring-kernels fa4 --ulysses-kernels fa4,flex \
    --out $W/kernels/h40_bs128
  keep kernels/h40_bs64 150 python3 tools/bench_block_sparse.py --heads 40 --seqlens 32768 --block-size 64 \
    --tile 4,4,4 --sparsities 0.8,0.9 --ulysses-p 1 --ring-p 8 --ring-kernels fa4,math --ulysses-kernels fa4 \
    --out $W/kernels/h40_bs64
}
stage_kernels2() {  # the kernel table's H=5 rows (wan-14b's 40 heads over Ulysses 8) at 128K
  keep kernels/h5_bs128 200 python3 tools/bench_block_sparse.py --heads 5 --seqlens 131072 --block-size 128 \
    --tile 4,4,8 --sparsities 0.8,0.9 --ulysses-p 1 --ring-p 8 --ring-kernels fa4 --ulysses-kernels fa4,flex \
    --out $W/kernels/h5_bs128
}
stage_cudnn() {   # which lengths cuDNN's bf16 attention gets right (fwd+bwd vs fp32 math), one process per case
  keep cudnn_lengths 200 python3 tests/gpu/check_cudnn_lengths.py --out $W/cudnn
}
stage_dyncheck() {   # dynamic SP's DiT family on "auto" (FA4 where installed: the kernel the dynamic bench times),
  # then the emulated P=8 bench on it (#54)
  suite dyn/suite 120 "dit_dynamic and 2-gloo"
  keep dyn/p8 190 python3 tools/bench_dynamic_sp.py --model wan-14b --world 8 --out $W/dyn/p8
}
stage_steps480() {  # the step on Wan's 480p grid only (dense FA4, window90, topk90 in one job)
  keep steps/wan14b_21x30x52 270 $STEP --variants guarded,sparse_window90,sparse_topk90 \
    --out $W/steps/wan14b_21x30x52 -- "${WAN14[@]}" --frames 21 --latent-size 60x104
}
stage_steps32() {  # the step (#53): wan-14b 2 layers on Wan's 480p grid and on a grid the tile cuts
  keep steps/wan14b_21x30x52 260 $STEP --variants guarded,sparse_window90,sparse_topk90 \
    --out $W/steps/wan14b_21x30x52 -- "${WAN14[@]}" --frames 21 --latent-size 60x104
  keep steps/wan14b_16x32x64 260 $STEP --variants guarded,sparse_window90,sparse_topk90 \
    --out $W/steps/wan14b_16x32x64 -- "${WAN14[@]}" --frames 16 --latent-size 64x128
}
stage_steps75() {  # 720p: each sparse variant in its own process beside the dense step (top-k ran out of memory on
  # 1 x H100 in one process with two variants before it, ~20 GiB outside torch's allocator, 2026-11-25)
  keep steps/wan14b_21x45x80_topk 250 $STEP --variants guarded,sparse_topk90 \
    --out $W/steps/wan14b_21x45x80_topk -- "${WAN14[@]}" --frames 21 --latent-size 90x160
  keep steps/wan14b_21x45x80 250 $STEP --variants guarded,sparse_window90 \
    --out $W/steps/wan14b_21x45x80 -- "${WAN14[@]}" --frames 21 --latent-size 90x160
}
stage_steps13() {  # wan-1.3b 4 layers at 32K
  keep steps/wan13b_16x32x64 140 $STEP --variants guarded,sparse_window90 --out $W/steps/wan13b_16x32x64 -- \
    --model wan-1.3b --num-layers 4 --bf16 --train-iters 30 --ddp-impl torch --frames 16 --latent-size 64x128
}
stage_newpaths() {   # 2026-11-26 session 3, call 1 (part.aa, no FA4): the round's new paths on CUDA first (the
  # entry with the default worker count, --manual-gc and --timing's data_wait_ms / gc_ms rows, against the
  # in-thread data path), then how fast this host's data path delivers wan-1.3b 32K batches in tile order per
  # worker count (no model: the floor under the entry's step)
  suite newpaths/entry 150 "dit_entry_data_path_and_manual_gc or fsdp2_entry"
  keep newpaths/data_path 200 python3 tools/bench_data_path.py --model wan-1.3b --frames 16 --latent-size 64x128 \
    --sparse-tile 4,4,4 --workers 0,2,4,6,8 --batches 24 --out $W/newpaths/data_path
}
stage_prefetch() {   # the data path's device copy one step ahead on a copy stream (pipeline.DeviceBatches): its CUDA
  # cases (values against engine.prepare under a lagging compute stream; the entry's losses against in-thread data)
  suite prefetch/cases 150 "device_batches_equal_prepare or dit_entry_data_path_and_manual_gc"
}
stage_entry13() {   # wan-1.3b 4 layers window90: its entry step 10.3% over its bare step (2026-11-26, 1 x H100),
  # all of it between steps (fwd+bwd+optimizer = the bare step). The entry with its default workers (now half the
  # host's CPUs, 2-8) beside the dense step; the old default (4 workers); the default with --manual-gc
  local a=(--model wan-1.3b --num-layers 4 --bf16 --train-iters 30 --ddp-impl torch --frames 16 --latent-size 64x128)
  keep entry13/default 150 $STEP --variants guarded,sparse_window90 --out $W/entry13/default -- "${a[@]}"
  keep entry13/w4 90 $STEP --variants sparse_window90 --out $W/entry13/w4 -- "${a[@]}" --num-workers 4
}
stage_entry13b() {   # the same window90 entry with --manual-gc, then its profile (steps 10-12; the trace gzipped)
  local a=(--model wan-1.3b --num-layers 4 --bf16 --train-iters 30 --ddp-impl torch --frames 16 --latent-size 64x128)
  keep entry13/mgc 90 $STEP --variants sparse_window90 --out $W/entry13/mgc -- "${a[@]}" --manual-gc \
    --manual-gc-interval 10
  keep entry13/profile 120 torchrun --nproc-per-node 1 tools/profile_train_step.py --out $W/entry13/profile \
    --tag window90 -- "${a[@]/30/14}" --sparse-attention tiles --sparse-window 1,1,1
  find $W/entry13/profile -name '*.json' -size +3M -exec gzip -f {} \;
}
stage_profiles() {   # the topk90 and window90 steps' profiles beside the dense one (#53), wan-14b 2 layers, 32,760
  for tag in dense topk90 window90; do
    local extra=(); [ $tag = topk90 ] && extra=(--sparse-attention tiles --sparse-topk 26)
    [ $tag = window90 ] && extra=(--sparse-attention tiles --sparse-window 1,1,1)
    keep profile/$tag 150 torchrun --nproc-per-node 1 tools/profile_train_step.py \
      --out $W/profile --tag $tag -- "${WAN14[@]}" --frames 21 --latent-size 60x104 --train-iters 14 "${extra[@]}"
  done
}
stage_peaks() {   # the memory plan's validation peaks (#51; measured 2026-11-25 on cuDNN)
  keep peaks 260 torchrun --nproc-per-node 1 tools/measure_peaks.py --out $W/peaks --budget-s 190
}
stage_extras() {   # FSDP2 step at one rank beside the plain entry (#52)
  keep fsdp2/step 200 $STEP --variants guarded,fsdp2 --out $W/fsdp2 -- --model wan-14b --num-layers 4 --frames 21 \
    --latent-size 60x104 --bf16 --train-iters 24 --recompute-granularity full
}

stage_s1() {   # 2026-11-26 session, first call (part.aa: no FA4): dynamic SP's DiT family on cuDNN at P=2 and P=4
  # (SP=1's bf16 non-finite gradients on cuDNN: the worker's NonFiniteWatch names the module), the FSDP2 entry case
  suite s1/dit_dynamic_cudnn 300 "dit_dynamic and gloo" SPX_SUITE_KERNEL=cudnn
  suite s1/fsdp2_entry 100 "fsdp2_entry or fused_regions_fp32"
}
stage_s2() {   # second call (FA4 installed): the fa4 family after the registry (#50), dynamic SP at P=4 on FA4 (#54)
  suite s2/fa4_family 380 "fa4_family"
  suite s2/dit_dynamic 150 "dit_dynamic and 4-gloo"
}
stage_s3() {   # the DiT's sparse family with the SP=1 replay of SP=P's top-k selection (#53), P=2 and P=4
  suite s3/dit_sparse ${S3_S:-540} "dit_sparse"
}
stage_cudnn_small() {   # cuDNN's bf16 backward on the dit_dynamic pack: the step with its loss scaled up (are small
  # gradients the trigger?), then single calls of the pack's lengths as the DiT lays them out, dO scaled down
  keep cudnn/dit_scale 200 python3 tests/gpu/check_cudnn_dit_scale.py --out $W/cudnn
  keep cudnn/small_do 200 python3 tests/gpu/check_cudnn_lengths.py --small-do --in-process --out $W/cudnn
}
stage_sdpa_calls() {   # every torch SDPA call of the two failing SP=1 bf16 steps, replayed alone against fp32 math
  keep cudnn/sdpa_calls 300 python3 tests/gpu/check_sdpa_calls.py --out $W/cudnn
}
stage_cudnn_fix() {   # after the contiguous-input fix (kernels/cudnn.py): the replayed calls, then the dit_dynamic family
  # on cuDNN at P=2 and P=4
  keep cudnn/sdpa_calls_fixed 200 python3 tests/gpu/check_sdpa_calls.py --steps dynamic --out $W/cudnn/fixed
  suite s1/dit_dynamic_cudnn_fixed 240 "dit_dynamic and gloo" SPX_SUITE_KERNEL=cudnn
}
stage_cudnn_calls() {   # the dynamic step's bad cuDNN calls: on random data of the same layout here, and on their own
  # data in a fresh process (is it the data or this process's cached graphs?)
  keep cudnn/sdpa_calls_why 250 python3 tests/gpu/check_sdpa_calls.py --steps dynamic --out $W/cudnn/why
}
stage_cudnn_layout() {   # torch's cuDNN backward graph cache (dO strides baked in, not in the key) as the cause of
  # the packed step's failure (needs no FA4: part.aa): the two-call check with and without the dO-layout hook, the
  # CUDA test, the dynamic step's SDPA calls, then the dit_dynamic family on cuDNN at P=2 and P=4
  keep cudnn/do_layout 120 python3 tests/gpu/check_cudnn_do_layout.py --out $W/cudnn/do_layout
  keep cudnn/test_layouts 90 python3 -m pytest -q tests/test_cudnn_layouts.py
  keep cudnn/sdpa_calls_layout 150 python3 tests/gpu/check_sdpa_calls.py --steps dynamic --out $W/cudnn/layout
  suite s1/dit_dynamic_cudnn_layout 240 "dit_dynamic and gloo" SPX_SUITE_KERNEL=cudnn
}
stage_fa4_dit() {   # FA4's block sparsity at the DiT sparse family's shapes (head dim 64, 8 heads, top-k 3 of 8), then
  # the SP=1 sparse step's SDPA calls and error on FA4, then the family at P=2
  keep checks/fa4_dit 200 python3 tests/gpu/check_fa4_tiles.py --skip-timing --dit --out $W/checks/dit
  keep cudnn/sdpa_calls_sparse 100 python3 tests/gpu/check_sdpa_calls.py --steps sparse --out $W/cudnn/sparse
  suite s3/dit_sparse_p2 ${S3_S:-220} "dit_sparse and 2-gloo" SPX_DIT_SPARSE_DIAG=1
}
stage_sparse_diag() {   # the DiT's sparse family at P=2 with the replay diagnosis (SPX_DIT_SPARSE_DIAG=1)
  suite s3/dit_sparse_diag ${S3_S:-400} "dit_sparse and 2-gloo" SPX_DIT_SPARSE_DIAG=1
}
stage_table() {   # #53's kernel table, one job over as many calls on this machine as it takes (--resume): every size
  # for FA4's block sparsity beside dense FA4/cuDNN first, then flex, then math (--kernel-major)
  local left=$(( DEADLINE - $(date +%s) - 90 ))
  local kk=fa4,flex,math; [ -d $W/kernels/table_math ] && kk=fa4,flex   # math: in its own job (table_math)
  keep kernels/table $(( left + 60 )) python3 tools/bench_block_sparse.py --table --table-kernels $kk --resume \
    --budget-s $left --out $W/kernels/table
  if [ -f $W/kernels/table_math/bench_block_sparse.json ]; then   # the math job's rows joined: one table
    rm -rf $W/kernels/table_all
    keep kernels/table_merge 60 python3 tools/bench_block_sparse.py --out $W/kernels/table_all \
      --merge $W/kernels/table $W/kernels/table_math
  fi
}
stage_ring_profile() {   # where a sparse ring step's kernel time goes (FA4: part.ab), random 90% at 75K / 8 ranks
  keep kernels/ring_profile 150 python3 tools/profile_ring_step.py --out $W/kernels/ring_profile
}
stage_kernels75() {   # the kernel table's H=40 rows at 75K (random masks: 0.74-0.78 of dense on 1 x H100)
  keep kernels/h40_75k 260 python3 tools/bench_block_sparse.py --heads 40 --seqlens 75776 --block-size 128 \
    --tile 4,4,8 --sparsities 0.8,0.9 --ulysses-p 1 --ring-p 8 --ring-kernels fa4 --ulysses-kernels fa4 \
    --out $W/kernels/h40_75k
}
stage_profiles2() {   # the topk90 step's profile beside the dense one only
  for tag in dense topk90; do
    local extra=(); [ $tag = topk90 ] && extra=(--sparse-attention tiles --sparse-topk 26)
    keep profile/$tag 150 torchrun --nproc-per-node 1 tools/profile_train_step.py \
      --out $W/profile --tag $tag -- "${WAN14[@]}" --frames 21 --latent-size 60x104 --train-iters 14 "${extra[@]}"
  done
}

stage_c1_cudnn() {   # 2026-11-26 second session, call 1 (part.aa, no FA4), GPU 0: the cuDNN dO-layout fix's checks
  # (torch's cuDNN backward graph cache: dO's strides baked in, not in the key), then the FSDP2 entry case
  keep cudnn/do_layout 120 python3 tests/gpu/check_cudnn_do_layout.py --out $W/cudnn/do_layout
  keep cudnn/test_layouts 90 python3 -m pytest -q -p no:cacheprovider tests/test_cudnn_layouts.py
  keep cudnn/sdpa_calls_layout 150 python3 tests/gpu/check_sdpa_calls.py --steps dynamic --out $W/cudnn/layout
  suite c1/fsdp2_entry 100 "fsdp2_entry or fused_regions_fp32"
}
stage_c1_dyn() {   # call 1, GPU 1: the DiT families on cuDNN (the packed step that failed before the fix), P=2 and 4
  suite c1/dit_dynamic_cudnn 260 "dit_dynamic and gloo" SPX_SUITE_KERNEL=cudnn
  suite c1/dit_packed 120 "dit_packed and gloo"
  suite c1/ulysses_packed 200 "(ulysses_family or packed_family or dropout_family) and gloo"
}
stage_c1_ring() {   # call 1, GPU 3 after the math rows: the ring, mesh and varlen families on cuDNN (no FA4)
  suite c1/ring_mesh 400 "(ring_family or mesh_family or varlen_family or one_ring) and gloo"
}
stage_table_flex() {   # the kernel table's flex rows (no FA4 needed: the first call), resumed by stage "table"
  local left=$(( DEADLINE - $(date +%s) - 90 ))
  keep kernels/table_flex $(( left + 60 )) python3 tools/bench_block_sparse.py --table --table-kernels flex --resume \
    --budget-s $left --out $W/kernels/table
}
stage_table_math() {   # the kernel table's math rows (H=5 at 32K: its fp32 score matrix), a job of their own
  keep kernels/table_math 240 python3 tools/bench_block_sparse.py --table --table-kernels math --resume \
    --budget-s 170 --out $W/kernels/table_math
}
stage_table_rest() {   # the kernel table's rows left on 2026-11-26 (flex at 128K, H=5, and one H=40 row), resumed
  # from that table's JSON in the tree; dense floors timed again on this machine (--retime-dense) so every ratio is
  # against a dense row of this GPU
  mkdir -p $W/kernels/table_rest
  cp results/2026-11-26_h200x4_table_steps_cudnn/call3/kernels/table_all/bench_block_sparse.json \
    $W/kernels/table_rest/
  local left=$(( DEADLINE - $(date +%s) - 90 ))
  keep kernels/table_rest $(( left + 60 )) python3 tools/bench_block_sparse.py --table --table-kernels flex --resume \
    --retime-dense --budget-s $left --out $W/kernels/table_rest
}
stage_c2_fa4suite() {   # call 2 (part.ab), GPU 0: the checks of the paths the call's figures time, on this machine:
  # FA4's block sparsity in every mode (P=2 and 4 over gloo) and the DiT's sparse family at P=2
  suite c2/fa4_block_sparse 330 "fa4_block_sparse_family"
  suite c2/dit_sparse 200 "dit_sparse and 2-gloo"
}
stage_n1() {   # 2026-11-26 session 2, call 1 (part.aa: no FA4, the local kernel cuDNN, sparse on flex), every GPU:
  # the suite over NCCL, one rank per GPU (P=2 and P=4 where there are 4), the round's paths first (the one ring,
  # the DiT's sparse family with its SparseStepCache, flex block sparsity), then the rest
  suite n1/ring 130 "nccl and (one_ring_family or ring_family)"
  suite n1/sparse 130 "nccl and (block_sparse_family or dit_sparse_family) and not fa4"
  suite n1/ulysses 120 "nccl and (ulysses_family or call_order)"
  suite n1/mesh 100 "nccl and (mesh_family or fsdp2_model or dit_entry)"
}
stage_dit_sparse() {   # the DiT's sparse family at P=2 ranks on this GPU (gloo), before its step is timed (FA4
  # compiling cold on a fresh machine took over 200 s on 2026-11-26: DIT_SPARSE_S raises the limit)
  suite dit_sparse ${DIT_SPARSE_S:-200} "dit_sparse and 2-gloo"
}
stage_n2() {   # call 2 (part.ab), two GPUs: FA4's block sparsity and the DiT's sparse family over NCCL at P=2, then
  # the step at SP=2 (one rank per GPU), wan-14b 4 layers, 75,600 tokens, dense beside window90 / topk90
  suite n2/fa4_nccl 200 "2-nccl and (fa4_block_sparse_family or dit_sparse_family)"
  stage_sp2
}
stage_n4() {   # call 3, four GPUs: the same checks at P=4 over NCCL, then the step at SP=4
  suite n4/fa4_nccl 200 "4-nccl and (fa4_block_sparse_family or dit_sparse_family)"
  keep sp4/step 300 torchrun --nproc-per-node 4 tools/bench_train_step.py \
    --variants guarded,sparse_window90,sparse_topk90 --log-interval 4 --out $W/sp4/wan14b_4l_21x45x80 -- \
    --model wan-14b --num-layers 4 --bf16 --train-iters 12 --timing-bare-steps 4 --ddp-impl torch \
    --recompute-granularity full --context-parallel-size 4 --frames 21 --latent-size 90x160
}
# ---- #67: recompute that keeps the attention, the memory plan at 2 and 4 ranks, full-depth wan-14b on 4 GPUs ----
stage_fsdp2_nccl() {   # the CUDA suite's FSDP2 families over NCCL (one rank per GPU: P=2, and P=4 on 4 GPUs), first,
  # then the recompute family (#67: full / outside_core_attn / + offload against none on FA4 or cuDNN, one GPU and
  # over NCCL)
  suite fsdp2_nccl/suite 300 "nccl and (fsdp2_model or fsdp2_entry)"
  suite fsdp2_nccl/recompute 200 "recompute_family"
}
stage_recompute2() {   # 2 GPUs, ONE job: wan-14b 4 blocks, 75,600 tokens, SP=2 (megatron DDP: the plan's "none"),
  # full recompute beside selective (--recompute-modules outside_core_attn: the attention core kept, never rerun);
  # recompute_selective_speedup = full / selective entry step (target >= 1.15), each with plan_gib beside its peak
  # (plan 46.2 / 53.4 GiB). ~4-5 min on 2 x H200 (2 x 24 steps of ~2.2 s, bare steps, build)
  keep recompute2/step ${RECOMPUTE2_S:-500} torchrun --nproc-per-node 2 tools/bench_train_step.py \
    --variants recompute_full,recompute_selective --log-interval 4 --out $W/recompute2/wan14b_4l_21x45x80 -- \
    --model wan-14b --num-layers 4 --bf16 --train-iters 24 --timing-bare-steps 4 --context-parallel-size 2 \
    --frames 21 --latent-size 90x160
}
stage_recompute2_offload() {   # the same job with --cpu-offloading (the kept core tensors in pinned host memory,
  # plan 47.6 GiB, 5.8 GiB on the host per rank) beside selective without it
  keep recompute2/offload ${RECOMPUTE2_S:-500} torchrun --nproc-per-node 2 tools/bench_train_step.py \
    --variants recompute_selective,recompute_selective_offload --log-interval 4 \
    --out $W/recompute2/wan14b_4l_21x45x80_offload -- --model wan-14b --num-layers 4 --bf16 --train-iters 24 \
    --timing-bare-steps 4 --context-parallel-size 2 --frames 21 --latent-size 90x160
}
stage_peaks2() {   # the memory plan's validation points at 2 ranks (SP=CP=2; FSDP2 and megatron DDP, full / selective
  # / offload, 32,760 and 75,600 tokens; tools/measure_peaks.py CONFIGS_SHARDED), ~5 min
  keep peaks2 ${PEAKS_S:-480} torchrun --nproc-per-node 2 tools/measure_peaks.py --out $W/peaks2 --budget-s 380
}
stage_peaks4() {   # the same at 4 ranks (SP=CP=4), ~5 min
  keep peaks4 ${PEAKS_S:-480} torchrun --nproc-per-node 4 tools/measure_peaks.py --out $W/peaks4 --budget-s 380
}
full40() {   # full40 NAME TOKENS SP RECOMPUTE...: wan-14b at full depth (40 blocks) on 4 GPUs, FSDP2 beside SP, one
  # bench_train_step job over F40_VARIANTS (default guarded = dense; then sparse_window90, sparse_topk90: one call
  # each, the time below), ${ITERS40:-20} steps each (bench_train_step keeps each finished variant in its
  # .partial.json if the call's limit cuts the job). --lr 1e-4 (LR40): at the entry's default 2e-3 the 40-block
  # wan-14b diverged on 2026-11-27 (4 x H200: loss 1.42 at step 1, running median 144 by step 10)
  local name=$1 tokens=$2 sp=$3; shift 3
  local size=60x104; [ "$tokens" = 75600 ] && size=90x160
  keep full40/$name ${FULL40_S:-530} torchrun --nproc-per-node 4 tools/bench_train_step.py \
    --variants ${F40_VARIANTS:-guarded} --log-interval 5 --out $W/full40/$name${F40_TAG:-} -- \
    --model wan-14b --bf16 --use-torch-fsdp2 --context-parallel-size $sp --frames 21 --latent-size $size \
    --train-iters ${ITERS40:-20} --timing-bare-steps 2 --lr ${LR40:-1e-4} "$@"
}
# Per GPU by training/video_dit/memory_plan.py (FSDP2 over 4, 2026-11-27): the optimizer step alone is 96.3 GiB (fp32 params,
# grads, Adam and foreach AdamW's temporary: 20.5B parameters), so none of these fits 4 x H100 (78 GiB): 4 x H200.
# 32,760: SP=2 selective 102.5, SP=4 selective 96.3 | 75,600: SP=4 selective 109.0, SP=2 selective 157.7 (no):
# full 96.3 or selective + --cpu-offloading 99.8. Time (5.0e15 / 2.0e16 model FLOPs a step at 32,760 / 75,600 tokens:
# ~3-4 s / 11-14 s a step at 35-45% MFU on 4 GPUs): a 32,760 variant ~3-5 min with the 20.5B build and FA4's
# compile (F40_VARIANTS=guarded,sparse_window90 fits one call), a 75,600 variant ~6-8 min (one per call; set F40_TAG
# to keep each call's JSON apart).
SEL=(--recompute-granularity selective --recompute-modules outside_core_attn)
stage_full40_32k_sp4() { full40 wan14b_40l_32k_sp4 32760 4 "${SEL[@]}"; }
stage_full40_32k_sp2() { full40 wan14b_40l_32k_sp2 32760 2 "${SEL[@]}"; }
stage_full40_75k_sp4() { full40 wan14b_40l_75k_sp4 75600 4 "${SEL[@]}"; }
stage_full40_75k_sp2() { full40 wan14b_40l_75k_sp2 75600 2 "${SEL[@]}" --cpu-offloading; }
stage_full40_75k_sp2_full() { full40 wan14b_40l_75k_sp2_full 75600 2 --recompute-granularity full; }
R40=(--model wan-14b --num-layers ${R40_LAYERS:-40} --bf16 --use-torch-fsdp2 --context-parallel-size 4 --lr 1e-4 --frames 21
  --latent-size 60x104 --log-interval 1 --num-workers 2 "${SEL[@]}" --deterministic-mode --sp-attention-backend fa4
  --cp-comm-type hcms)
# (--deterministic-mode with FA4's deterministic backward since 2026-11-28: without it a rerun of the same steps
# differs by the kernels' atomics, so "bit-identical" could not be asked of the resume)
ck40_dir() {   # where the checkpoint fits: 12 B a parameter (fp32 params + Adam), 0.51B a block: ~230 GiB at 40
  # blocks; /dev/shm first (a container's may be small), then this machine's disk; R40_LAYERS=20 halves it
  local need=$(( ${R40_LAYERS:-40} * 6 + 4 )) d
  for d in ${CK40_DIR:-} /dev/shm/spx_ck40 $W/ck40; do
    [ -z "$d" ] && continue; mkdir -p "$d" 2>/dev/null || continue
    if [ $(( $(df -Pk "$d" | awk 'NR == 2 {print $4}') / 1048576 )) -ge $need ]; then echo "$d"; return 0; fi
  done
  return 1
}
stage_resume40a() {   # full-depth resume, call 1 (4 GPUs, 32,760 tokens, SP=4, FSDP2, selective): the uninterrupted 8
  # steps, then 4 steps saving the DCP checkpoint (kept for resume40b on this warm machine); ~6-8 min
  local ck; ck=$(ck40_dir) || { echo "[resume40a: not started: no file system with $(( ${R40_LAYERS:-40} * 6 + 4 ))"\
    "GiB free for the checkpoint (set CK40_DIR, or R40_LAYERS=20)]"; df -h /dev/shm $W; return 0; }
  echo "checkpoint dir: $ck"; echo "$ck" > /tmp/spx_ck40_dir; rm -rf "$ck"/*
  keep resume40/straight 240 torchrun --nproc-per-node 4 training/pretrain_video_dit.py "${R40[@]}" --train-iters 8 \
    --log-dir $W/resume40/straight
  keep resume40/first 280 torchrun --nproc-per-node 4 training/pretrain_video_dit.py "${R40[@]}" --train-iters 4 \
    --save "$ck" --log-dir $W/resume40/first
  du -sh "$ck"
}
stage_resume40b() {   # call 2: resume from that checkpoint to step 8 and compare every logged loss, bit for bit
  local ck; ck=$(cat /tmp/spx_ck40_dir 2>/dev/null) || { echo "[resume40b: run resume40a first]"; return 0; }
  keep resume40/resumed 400 torchrun --nproc-per-node 4 training/pretrain_video_dit.py "${R40[@]}" --train-iters 8 \
    --load "$ck" --log-dir $W/resume40/resumed
  keep resume40/check 30 python3 tests/gpu/check_resume.py --straight $W/resume40/straight --resumed \
    $W/resume40/resumed --first $W/resume40/first --out $W/resume40/check_resume.json
  rm -rf "$ck"
}
WAN_BENCH="torchrun --nproc-per-node 2 tools/bench_diffusers_wan.py"
# 2026-11-27 (issues #65-#70) on 2 GPUs: call 1 (part.aa): r7a | call 2 (part.ab): r7b | call 3 (part.ac): r7c |
#   call 4: r7d | call 5: r7e.
stage_r7a() {   # call 1 (no FA4: the local kernel cuDNN, tiles on flex/math): the round's new paths on CUDA first:
  # the diffusers client (#65) over NCCL and on one GPU, its block sparsity, the call-order family after the mode
  # registry (#66), and the recompute choices' first step (#67) in one small job
  suite r7a/diffusers 220 "test_diffusers_family and (2-nccl or 2-gloo)"
  suite r7a/diffusers_sparse 150 "test_diffusers_sparse_family and 2-nccl"
  suite r7a/order 60 "test_call_order_regression and 2-nccl"
  keep r7a/recompute 120 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants \
    recompute_full,recompute_selective,recompute_selective_offload --log-interval 2 --out $W/r7a/recompute_small -- \
    --model wan-1.3b --num-layers 2 --bf16 --frames 5 --latent-size 32x64 --train-iters 4 --timing-bare-steps 2 \
    --ddp-impl torch --context-parallel-size 2
}
stage_r7s() {   # call 2 (part.ab): the diffusers families again (call 1 skipped them: the carried huggingface_hub 2.4
  # needed truststore; gpu_install.sh now keeps the image's)
  suite r7s/diffusers 200 "test_diffusers_family and (2-nccl or 2-gloo)"
  suite r7s/diffusers_sparse 120 "test_diffusers_sparse_family and 2-nccl"
}
stage_r7b() {   # call 2 (part.ab): diffusers' own context parallelism on its best backend (needs no FA4), 720p, 480p
  keep r7b/720p 330 $WAN_BENCH --grid 720p --variants diffusers-ulysses,diffusers-ring --steps 4 --warmup 2 \
    --out $W/r7b/720p_diffusers.json
  keep r7b/480p 200 $WAN_BENCH --grid 480p --variants diffusers-ulysses,diffusers-ring --steps 4 --warmup 2 \
    --out $W/r7b/480p_diffusers.json
}
stage_r7c() {   # call 3 (part.ac: FA4 and cuDNN frontend there): the checks of what the rows time, on FA4, then
  # ours-auto at 720p
  suite r7c/diffusers 160 "test_diffusers_family and 2-nccl"
  suite r7c/diffusers_sparse 160 "test_diffusers_sparse_family and 2-nccl"
  keep r7c/720p 150 $WAN_BENCH --grid 720p --variants ours-auto --steps 4 --warmup 2 --out $W/r7c/720p_auto.json
  suite r7c/cudnn_bs 150 "test_cudnn_block_sparse_family and 2-gloo"
}
stage_r7d() {   # call 4: our modes and block sparsity at 720p, ours-auto at 480p
  keep r7d/720p 420 $WAN_BENCH --grid 720p --variants ours-hcms,ours-ring,ours-auto-window90,ours-auto-topk90 \
    --steps 4 --warmup 2 --out $W/r7d/720p_ours.json
  keep r7d/480p 120 $WAN_BENCH --grid 480p --variants ours-auto --steps 4 --warmup 2 --out $W/r7d/480p_auto.json
}
stage_r7e() {   # call 5: 50-step bf16 loss curves (ours-auto vs diffusers' best CP, 480p), selective vs full recompute
  # (#67: wan-14b 4 blocks, 75,600 tokens, SP=2), the mask check per call vs once per mask (#66)
  keep r7e/curves 260 $WAN_BENCH --grid 480p --curves 50 --out $W/r7e/480p.json
  keep r7e/recompute 200 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants \
    recompute_full,recompute_selective --log-interval 4 --out $W/r7e/recompute_14b -- --model wan-14b --num-layers 4 \
    --bf16 --frames 21 --latent-size 90x160 --train-iters 12 --timing-bare-steps 4 --ddp-impl torch \
    --context-parallel-size 2
  keep r7e/sparse_sync 120 torchrun --nproc-per-node 2 tools/profile_sparse_sync.py --out $W/r7e/sparse_sync.json \
    --model wan-14b --num-layers 2 --frames 21 --latent-size 60x104 --sparsity 0.9 --bf16 --steps 10
}
# 2026-11-27 evening (issues #65 #67 #69 #70) on 4 GPUs: call 1 (part.aa, no FA4): r8a65@0,1 r8a67@2,3 | call 2
#   (part.ab): r8a4, then peaks2@0,1 <#70 stages>@2,3 | call 3 (part.ac, FA4): r8c65@0,1 r8c67@2,3 | call 4:
#   full40_32k_sp4 (4 x H200), or r8d69a@0 r8d69b@1 r8d66@2,3.
# Next session on 4 GPUs (what 2026-11-27's r8 left; 30 min): call 1 (part.aa): r9a (the fused-RoPE bitwise test:
#   its suite never ran, gpu_install raced; the diffusers P=4 families, test fixed), then i70_resume@0,1 i70_ds@2,3
#   (lr 1e-4) | call 2 (part.ab): i70_transport+i70_tpcp | call 3 (FA4): full40_32k_sp4 with ITERS40=20 (falling
#   loss at lr 1e-4), then full40_75k_sp4 (F40_VARIANTS=guarded,sparse_window90: one call) | call 4: r8d69a@0
#   r8d69b@1 r8d66@2,3 | resume40a/b.
stage_r9a() {   # 1 GPU then 4: the fused Wan RoPE bitwise against diffusers' ops, then the diffusers families at P=4
  suite r9a/rope 120 "test_wan_rope_fused_bitwise"
  suite r9a/diffusers4 200 "(test_diffusers_family or test_diffusers_sparse_family) and 4-nccl"
}
# 2026-11-27 night, 4 x H100 (nvidia-h100-x4; no 4 x H200 lent): call 1 (part.aa + .ds): i70_ds@0,1
#   r10_rope+i70_resume@2,3 | call 2 (part.ab): r10_d4 i70_transport | call 3 (part.ac, FA4): r10_65@0,1 r8d69a@2
#   r8d69b@3 | call 4: r10_67.
# NEXT SESSION (after 2026-11-29 00:16, results/2026-11-29_h200: one H200 only; the plan below is still open). First
#   on any machine: the paths 53053cb..e4c57d6 added: the DiT families on Wan's AdaLN where they need FA4 (the DiT
#   sparse family: 6 of 18 ran) and the block-sparse families with the factory's auto (r16_cudnn2 / r16_cudnn4:
#   over NCCL auto calibrates with the mask), before any timing.
# Before (after 2026-11-28 20:12, results/2026-11-28_h200x4_2010): 4 GPUs: call 1 (part.aa + manifest + commit):
#   i70_dyn_check (P=2 and P=4) | call 2 (part.ab): i68_views32@0,1 r16_prof69@2,3 | call 3: i70_dyn4 |
#   call 4 (.te): i68_cp4_nv with I68_SEQLENS=131072 | call 5: i68_cp2_host (I68_SEQLENS=131072, DEADLINE_S=560).
#   i68_sp1 (one GPU) beside a 2-GPU stage, e.g. call 5: i68_cp2_host@0,1 i68_sp1@2 (FA4 installed by then).
#   The 2-GPU stages below as before (r11_69sp2, i70_dyn_prof).
# Before (after 2026-11-28 17:23, results/2026-11-28_h200x4_1800). 4 GPUs: call 1 (part.aa + manifest +
#   .fa4/commit): r18b@0,1 i70_dyn_check@2,3 (the paths changed since: telemetry's alloc_retries, the loss curve) |
#   call 2 (part.ab): r19_full32 | call 3 (.te): r19_prof75 (TE installs beside it) | call 4: i68_cp4_nv |
#   call 5: i68_emu22 | call 6: i70_dyn4; then resume40a / resume40b, r19_topk75 (a call each). 2 GPUs: the 2-GPU plan below (r17_69overlap,
#   r16_prof69, r11_69sp2, i70_dyn_prof).
# 2026-11-28 sixth session, 4 x H200 (nvidia-h200-x4 lent): call 1 (part.aa + manifest + .ds + .fa4/commit):
#   r18a@0,1 r18b@2,3 r18c | call 2 (part.ab): r16_cudnn2@0 r16_cudnn4@1 i70_dyn_check+i70_dyn2@2,3 r18_full32 |
#   call 3: r18_full75 | call 4 (if time): i70_tpcp.
# Before (after 2026-11-28 13:45; results/2026-11-28_h200x2_1345). Issue each call AT ONCE after the previous.
#   2 GPUs: call 1 (part.aa + manifest + .ds + .fa4/commit): i70_dyn_check+i70_dyn2+i70_dyn_prof@0,1 (c677b06's
#     dynamic-SP views: dynamic vs uniform again, then the profile of both) | call 2 (part.ab): r16_cudnn2@0
#     r16_cudnn4@1 (aaac78d's dead-block zeroing checked first) | call 3: r17_69overlap@0,1 (the DiT entry's
#     --overlap-grad-reduce case, then 480p VSA SP=2 with the all-reduce after vs during the backward) | call 4:
#     r16_prof69@0,1 (where the top-k row's elementwise excess went) | call 5: r11_69sp2@0,1 (128-token SP=2 row).
#   4 GPUs: r16_cudnn2@0 r16_cudnn4@1 + the 4-GPU plan below (#67 full depth, TP2 x CP2, P=4 grid, i70_dyn4).
# 2026-11-28 fifth session, 2 x H200 (x4 not lent), as run: call 1 (part.aa + manifest + .ds + .fa4/commit):
#   i70_dyn_check+i70_dyn2@0,1 (cuDNN: no FA4 yet) | call 2 (part.ab): r16_cudnn2@0 r16_cudnn4@1 | call 3 (.te):
#   i68_cp2_nv@0,1 | call 4: r13_69vsa_sp2@0,1 | call 5: I68_SEQLENS=32768 i68_cp2_host+r16_prof69@0,1 | call 6:
#   I68_SEQLENS=65536 i68_cp2_host@0,1.
# Before: (after 2026-11-28 10:30: #65's rows and the fa4 family P=4 are done). Issue each call AT ONCE after
# the previous returns: the machine goes back after 30 s idle. Prepare every command first.
#   2 GPUs: call 1 (part.aa + .ds + .fa4/commit): i70_resume@0,1 | call 2 (part.ab): r15_cudnn@0 r13_det_kernel@1,
#     then r15_69@0,1 (the cuDNN family first on that machine, then #69's VSA SP=2 rows and their profile) |
#     call 3 (.te): i68_cp2_nv@0,1 | call 4: r11_69sp2@0,1 (the 128-token SP=2 row) or i70_dyn2@0,1.
#   1 GPU: call 1 (part.aa): r15_cudnn | call 2 (part.ab): r8d69b (the kernel table after its family) | call 3: #68's
#     SP=1 profile. 4 GPUs: the 4-GPU plan below (#67 full depth, TP2 x CP2, P=4 rows) with r15_cudnn first.
# Before (4 GPUs). Issue each call AT ONCE after the previous returns (the machine goes back after 30 s idle):
#   call 1 (.te + .ds + .fa4/commit): i68_te_install@0,1 i70_transport@2,3 (the round's new TE cuDNN path first:
#     tools/te_peer.share_torch_cudnn; TE stays installed in /tmp/te_site for call 4) | call 2 (part.aa):
#     i70_ds_time@0,1 r12_bs4@2,3 | call 3 (part.ab: FA4 from here): r12_65@0,1 r12_fa4p4@2 r11_69vsa@3 |
#   (r12_det_fa4@x,y: FA4's deterministic backward and a bit-for-bit resume, where two GPUs are free) |
#   call 4: i68_cp2_nv@0,1 i68_cp2_host@2,3 (32K and 64K; the 128K row in a call of its own: I68_SEQLENS=131072).
#   Results of 2026-11-28: results/2026-11-28_h100x4_0029/ and results/2026-11-28_h100x4_0359/ (README.md each).
# 2026-11-28 fourth session, ONE H200 (only nvidia-h200 lent). Issue each call AT ONCE after the previous returns:
#   call 1 (part.aa + manifest + .ds + .fa4/commit): r14_first | call 2 (part.ab): r14_more | call 3: r8d69b; then
#   2 x H200 (lent from 10:44): gpu_run.sh "test_diffusers_family and 2-nccl" (part.aa) | r13_65@0,1 (part.ab) |
#   r13_65ring@0,1 | r13_69vsa_sp2@0,1. Results: results/2026-11-28_h200_1030/README.md. r14_first's 720p job died:
#   diffusers' CP over gloo with CUDA tensors segfaults (bench_diffusers_wan now skips it under --ranks-share-gpu).
# ---- 2026-11-28 sixth session (4 x H200): the round's unchecked paths first, then #67 at full depth ----
stage_r18a() {   # call 1 (part.aa: no FA4, the local kernel cuDNN), GPUs 0,1: dynamic SP's views (c677b06) and the DiT
  # entry's megatron-DDP --overlap-grad-reduce case (c27abb7), over NCCL at P=2
  suite r18a/suite 260 "(test_dit_dynamic_family or test_dit_entry_sp_vs_sp1) and 2-nccl"
}
stage_r18b() {   # call 1, GPUs 2,3: the recompute family (its new case: --recompute-num-layers 1 with outside_core_attn)
  # at P=1 and P=2, the FSDP2 families and the transports over NCCL at P=2
  suite r18b/suite 260 "(test_recompute_family or fsdp2_model or fsdp2_entry or test_transport_family) and not (2-gloo or 4-gloo)"
}
stage_r18c() {   # call 1, all 4 GPUs after r18a/b: the same families at P=4 over NCCL, and TP2 x CP2 (i70_tpcp's checks)
  suite r18c/suite 300 "4-nccl and (test_recompute_family or fsdp2_model or test_transport_family or test_dit_dynamic_family or test_tp_cp_block or test_tp_cp_vs_megatron_layer)"
}
stage_r18_full32() {   # 4 GPUs (FA4), after r18c: #67 wan-14b 40 blocks, FSDP2 + SP=4, 32,760 tokens, dense, 20 steps at lr
  # 1e-4: selective recompute on every block (the 11-27 row, 2,946 ms = 43.1% MFU) against the first 10 only
  # (`python -m training.video_dit.memory_plan ... --recompute-num-layers auto`: 124.7 GiB planned of 139), the
  # allocator's expandable segments on for both; if 10 runs out of memory, 16
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  ITERS40=20 full40 wan14b_40l_32k_sp4_sel 32760 4 "${SEL[@]}"
  ITERS40=20 full40 wan14b_40l_32k_sp4_sel10 32760 4 "${SEL[@]}" --recompute-num-layers 10
  if grep -q "out of memory" "$W/full40/wan14b_40l_32k_sp4_sel10.log"; then
    ITERS40=20 full40 wan14b_40l_32k_sp4_sel16 32760 4 "${SEL[@]}" --recompute-num-layers 16
  fi
  unset PYTORCH_CUDA_ALLOC_CONF
}
stage_r18_full75() {   # 4 GPUs (FA4): #67 wan-14b 40 blocks, FSDP2 + SP=4, 75,600 tokens (720p), selective on every block
  # (auto gives 35 of 40 there: not worth a second job), dense then window90 (target >= 2.5x), 16 steps each
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  ITERS40=16 F40_VARIANTS=guarded,sparse_window90 full40 wan14b_40l_75k_sp4 75600 4 "${SEL[@]}"
  unset PYTORCH_CUDA_ALLOC_CONF
}
# ---- 2026-11-28 seventh session (4 x H200): the paths changed since 28074fc, then #68's profile and P=4 / 128K rows ----
# Call 1 (part.aa + manifest + .fa4/commit): r20_first@0,1 i70_dyn_check@2,3 | call 2 (part.ab): r16_cudnn2@0
#   r16_cudnn4@1 i68_prof32@2,3 | call 3 (.te): i68_cp4_nv (I68_SEQLENS=32768,65536) | call 4: r20_69overlap@0,1
#   i68_prof32_host@2,3 | call 5: i68_emu22 | call 6: i68_cp2_nv@0,1 i68_cp2_host@2,3 (I68_SEQLENS=131072).
R20_ENTRY=(training/pretrain_video_dit.py --model wan-1.3b --num-layers 2 --frames 5 --latent-size 32x32 --seed 7
  --log-interval 1 --quiet --context-parallel-size 2 --train-iters 3)
stage_r20_first() {   # 2 GPUs, part.aa (local kernel cuDNN): every path added since the last GPU run, first: the recompute
  # family at P=1 / P=2 over NCCL; the entry's --recompute-method block / uniform and --recompute-num-layers with
  # selective, 3 steps each at SP=2, every metrics row's alloc_retries a count (telemetry, CUDA only); bench_cp's
  # --profile-reps (tools/profile_calls.py: every rank profiled, categories gathered) on a small P=2 row
  suite r20/recompute 200 "test_recompute_family and (1-nccl or 2-nccl)"
  local name
  for name in block uniform selective1; do
    case $name in
      block) set -- --recompute-granularity full --recompute-method block --recompute-num-layers 1 ;;
      uniform) set -- --recompute-granularity full --recompute-method uniform ;;
      selective1) set -- "${SEL[@]}" --recompute-num-layers 1 ;;
    esac
    keep r20/entry_$name 120 torchrun --nproc-per-node 2 "${R20_ENTRY[@]}" "$@" --log-dir $W/r20/entry_$name
    keep r20/entry_${name}_rows 20 python3 -c "import json, math, sys; rows = [json.loads(l) for l in \
open('$W/r20/entry_$name/metrics.jsonl')]; r = [x.get('alloc_retries') for x in rows]; print(len(rows), 'rows', \
'losses', [round(x['loss'], 5) for x in rows], 'alloc_retries', r); sys.exit(0 if len(rows) == 3 and all(isinstance(\
v, int) and v >= 0 for v in r) and all(math.isfinite(x['loss']) for x in rows) else 1)"
  done
  keep r20/profile_smoke 150 torchrun --nproc-per-node 2 tools/bench_cp.py --heads 8 --seqlens 8192 --causal no,yes \
    --modes ulysses,hcms --iters 3 --warmup 1 --profile-reps 2 --out $W/r20/profile_smoke
  grep -A12 "Profiled" $W/r20/profile_smoke/bench_cp_nvlink_P2.md
}
I68_PROF=(--heads 40 --seqlens 32768 --causal no,yes --modes ulysses,hcms,auto --iters 5 --warmup 2 --profile-reps 3)
stage_i68_prof32() {   # 2 GPUs (FA4): where the 32K gap to the FA4 floor goes on NVLink (#68's missed rows: auto 1.12 /
  # 1.22 of the floor): the FA4 floor, ulysses, hcms, auto timed, then 3 fwd+bwd calls of each profiled on every rank
  # (attention / exchange / exposed exchange / copies / idle per call, max over ranks; rank 0's traces kept)
  keep i68_prof32/nv 400 torchrun --nproc-per-node 2 tools/bench_cp.py "${I68_PROF[@]}" --links nvlink \
    --profile-traces $W/i68_prof32/traces_nv --out $W/i68_prof32
  grep -A14 "Profiled" $W/i68_prof32/bench_cp_nvlink_P2.md
}
stage_i68_prof32_host() {   # 2 GPUs (FA4): the same on host links (32K causal: auto 1.575 of the floor, target 1.30)
  keep i68_prof32/host 420 torchrun --nproc-per-node 2 tools/bench_cp.py "${I68_PROF[@]}" --links host \
    --profile-traces $W/i68_prof32/traces_host --out $W/i68_prof32
  grep -A14 "Profiled" $W/i68_prof32/bench_cp_host_P2.md
}
stage_r20_69overlap() {   # 2 GPUs (FA4 + cuDNN frontend, after r16_cudnn2/4 on the machine): #69's 480p VSA-tile row
  # at SP=2 (top-k90 1.351x, target 1.5x) as r13 timed it (--ddp-impl torch: the gradient all-reduce after the
  # backward) and with megatron-core's DDP overlapping it with the backward (r17_69overlap without its suite: the
  # entry's --overlap-grad-reduce case passed over NCCL on 2026-11-28 17:23 and its code has not changed)
  local impl
  for impl in torch megatron_overlap; do
    keep r20/69vsa_sp2_480_$impl 200 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants \
      guarded,sparse_topk90 --sparse-args "--sparse-tile 4,4,4" --out $W/r20/69vsa_sp2_480_$impl \
      -- "${WAN14[@]}" --context-parallel-size 2 --frames 21 --latent-size 60x104 \
      $([ $impl = torch ] || echo "--ddp-impl megatron --overlap-grad-reduce")
  done
}
stage_i68_views32() {   # 2 GPUs (FA4; ~8 min): the 32K P=2 NVLink row with plain Ulysses on zero-copy views of the receive
  # buffer (qkv_contiguous=False: no copies into the kernel's layout, one packed dq|dk|dv exchange) beside the
  # default, each profiled (the copies were 2.5 ms of the 5.9 ms gap to the FA4 floor on 2026-11-28 20:19)
  # the word copies (layout.copy_bits, new 2026-11-28 21:00) checked first: the Ulysses / packed / exchange-copies families
  # over NCCL (HCMS == Ulysses bit for bit, every layout against float64), then their speed against value copies
  suite i68_views32/suite 270 "test_layout_word_copies_bitwise or ((test_ulysses_family or test_packed_family or test_exchange_copies_family or test_fa4_family) and 2-nccl)"
  keep i68_views32/words 60 python3 tools/bench_word_copies.py --out $W/i68_views32
  keep i68_views32/nv 400 torchrun --nproc-per-node 2 tools/bench_cp.py --heads 40 --seqlens 32768,65536 --causal \
    no,yes --modes ulysses,ulysses_views,hcms,auto --iters 7 --warmup 2 --profile-reps 3 \
    --profile-modes floor_fa4,ulysses,ulysses_views --links nvlink --out $W/i68_views32
  grep -A14 "Profiled" $W/i68_views32/bench_cp_nvlink_P2.md
}
# ---- 2026-11-29, ONE H200 (only nvidia-h200 lent): call 1 (part.aa + manifest + .fa4/commit): r21_first | call 2
#   (part.ab): i68_sp1 (the SP=1 step's profile, the "before" of #68 item 3) ----
stage_r21_first() {   # 1 GPU, part.aa (local kernel cuDNN): the path added since the last GPU run first: the Ulysses
  # layouts' word copies (layout.copy_bits) bit for bit against CPU value copies, then the Ulysses / packed /
  # exchange-copies families at P=2 and P=4 ranks sharing this GPU over gloo (HCMS == Ulysses bit for bit, every
  # layout against float64), then the words' speed against value copies
  suite r21/suite 300 "test_layout_word_copies_bitwise or ((test_ulysses_family or test_packed_family or test_exchange_copies_family) and (2-gloo or 4-gloo))"
  keep r21/words 90 python3 tools/bench_word_copies.py --out $W/r21
}
stage_r21_checks() {   # 1 GPU, part.aa (cuDNN; ~6 min): the model's Wan modulation (--modulation wan, the default since
  # 2026-11-29: one shared time projection plus a table per block) through every DiT family that runs on one GPU:
  # the entry at SP=2 vs SP=1, fused regions vs eager (bf16 and fp32), packed, dynamic SP, recompute, FSDP2
  suite r21c/suite 420 "(2-gloo and (test_dit_entry_sp_vs_sp1 or test_dit_fused_regions_match_eager or test_dit_packed_family or test_dit_dynamic_family)) or test_dit_fused_regions_fp32_match_eager or (1-gloo and (test_recompute_family or test_fsdp2_model_vs_unsharded)) or test_fsdp2_entry_vs_unsharded_entry"
}
stage_r21_sp1ab() {   # 1 GPU (FA4; ~8 min): #68's SP=1 step before / after in ONE job per size: the per-block Linear
  # AdaLN (modulation_linear: the model of every figure before 2026-11-29) against Wan's (guarded, the default), same
  # FLOPs; wan-14b 2 blocks at 32,760 and 75,600 tokens; first the DiT's sparse family on FA4 (the model's gates)
  suite r21s/suite 150 "test_dit_sparse_family and 2-gloo"
  local lat
  for lat in 60x104 90x160; do
    keep r21s/step_$lat 240 torchrun --nproc-per-node 1 tools/bench_train_step.py --variants \
      guarded,modulation_linear --out $W/r21s/step_$lat -- "${WAN14[@]}" --frames 21 --latent-size $lat
  done
  keep r21s/prof 200 torchrun --nproc-per-node 1 tools/profile_train_step.py --out $W/r21s/prof \
    --tag wan14b_2l_21x60x104_wanmod --warmup 6 --steps 2 -- "${WAN14[@]}" --frames 21 --latent-size 60x104 \
    --train-iters 12
}
stage_i68_sp1() {   # 1 GPU (FA4; ~6 min): #68's SP=1 step (target >= 63% MFU; 59.1% / 60.5% on 2026-11-25): wan-14b 2
  # blocks at 32,760 and 75,600 tokens, the entry's step time and MFU with its profile by category (the "before")
  local lat
  for lat in 60x104 90x160; do
    keep i68_sp1/$lat 240 torchrun --nproc-per-node 1 tools/profile_train_step.py --out $W/i68_sp1 \
      --tag wan14b_2l_21x$lat --warmup 6 --steps 2 -- "${WAN14[@]}" --frames 21 --latent-size $lat --train-iters 12
  done
}
# ---- next 4-GPU session: where the full-depth step goes, the partial recompute again, #68's P=4 rows ----
stage_r19_prof75() {   # 4 GPUs (FA4): the profile of r18_full75's dense step (rank 0, 2 steps after 3; ~4 min): where
  # 75,600 tokens at full depth lose the last points to 50% MFU (FSDP2's collectives beside the GEMMs, the all-to-alls,
  # the selective recompute's GEMMs)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True keep r19/prof75 420 torchrun --nproc-per-node 4 \
    tools/profile_train_step.py --out $W/r19/prof75 --tag full40_75k_sp4 --warmup 3 --steps 2 -- --model wan-14b \
    --bf16 --use-torch-fsdp2 --context-parallel-size 4 --frames 21 --latent-size 90x160 --train-iters 5 --lr 1e-4 \
    "${SEL[@]}"
}
stage_r19_full32() {   # 4 GPUs (FA4): r18_full32 again WITHOUT expandable segments (the 11-27 setting), every block
  # against the first 10 recomputed, now with the allocator's retries in each JSON (alloc_retries) and the loss curve
  unset PYTORCH_CUDA_ALLOC_CONF
  ITERS40=20 full40 wan14b_40l_32k_sp4_sel_r19 32760 4 "${SEL[@]}"
  ITERS40=20 full40 wan14b_40l_32k_sp4_sel10_r19 32760 4 "${SEL[@]}" --recompute-num-layers 10
}
stage_r19_topk75() {   # 4 GPUs (FA4): top-k90 at full depth, 75,600 tokens (r18_full75 ran dense and window90)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ITERS40=16 F40_VARIANTS=sparse_topk90 \
    full40 wan14b_40l_75k_sp4_topk90 75600 4 "${SEL[@]}"
}
stage_i68_cp4_nv() {   # 4 GPUs (FA4 + TE installed): #68's P=4 grid on NVLink in ONE job (32K, 64K, 128K; causal and
  # not; the FA4 floor, ulysses / hcms / ring / auto, then TE p2p / a2a / all_gather in their own torchrun)
  i68_te i68_cp4_nv && i70_need i68_cp4_nv 4 || return 0
  keep i68_cp4_nv/bench 540 torchrun --nproc-per-node 4 tools/bench_cp.py --heads 40 --seqlens \
    ${I68_SEQLENS:-32768,65536,131072} --causal no,yes --modes ulysses,hcms,ring,auto --peers te --iters 5 \
    --warmup 2 --links nvlink --time-limit $(( DEADLINE - $(date +%s) - 15 )) --out $W/i68_cp4_nv
}
stage_i68_emu22() {   # 4 GPUs (FA4): #68's emulated 2 x 2 cluster (two "machines" of 2 GPUs joined by host-staged
  # links, --links emu2): the topology-aware meshes (usp, tas, torus, tasp, mesh_auto) against flat Ulysses / HCMS
  i70_need i68_emu22 4 || return 0
  keep i68_emu22/bench 420 torchrun --nproc-per-node 4 tools/bench_attention.py --world-sizes 4 --heads 40 \
    --seqlens 32768,65536 --modes ulysses,hcms2,hcms4,auto,usp,tas,torus,tasp,mesh_auto --links emu2 --iters 5 \
    --warmup 2 --tag emu22 --out $W/i68_emu22
}
stage_r15_cudnn() {   # 1 GPU: cuDNN's block-sparse family (P=2 and P=4 ranks on this GPU), before any timing of that
  # kernel on the machine (the 10:30 table and VSA SP=2 rows ran without it on their machines)
  suite r15/cudnn 420 "test_cudnn_block_sparse_family and gloo"
}
stage_r16_cudnn2() {   # 1 GPU: r15_cudnn's P=2 half, then FA4's deterministic-backward case (beside r16_cudnn4 on the
  # other GPU: the family on the machine in half r15_cudnn's time)
  suite r16/cudnn2 300 "test_cudnn_block_sparse_family and 2-gloo"
  stage_r13_det_kernel
}
stage_r16_cudnn4() { suite r16/cudnn4 420 "test_cudnn_block_sparse_family and 4-gloo"; }   # 1 GPU: the P=4 half
stage_r15_69() {   # 2 GPUs (FA4 + cuDNN frontend), after r15_cudnn: #69's VSA SP=2 rows again (480p top-k90 missed
  # 1.5x at 1.37x) and the profile of that step, dense and top-k90 (where SP=2's constant ~50 ms goes)
  stage_r13_69vsa_sp2
  stage_r16_prof69
}
stage_r16_prof69() {   # 2 GPUs (FA4 + cuDNN frontend), after r13_69vsa_sp2 on the machine: r15_69's two profiles only
  # (480p SP=2, dense and top-k90 on VSA's tiles: where SP=2's constant ~50 ms goes)
  local v
  for v in dense "--sparse-attention tiles --sparse-tile 4,4,4 --sparse-topk 51"; do
    # shellcheck disable=SC2086
    keep r16/prof_$([ "$v" = dense ] && echo dense || echo topk90) 150 torchrun --nproc-per-node 2 \
      tools/profile_train_step.py --out $W/r16/prof --tag "480p_sp2_$([ "$v" = dense ] && echo dense || echo topk90)" \
      -- "${WAN14[@]}" --context-parallel-size 2 --frames 21 --latent-size 60x104 --train-iters 14 \
      $([ "$v" = dense ] || echo "$v")
  done
}
stage_r17_69overlap() {   # 2 GPUs (FA4 + cuDNN frontend), after r16_cudnn2/4 on the machine: (1) the DiT entry at SP=2
  # against SP=1 over NCCL, with its new case megatron-core DDP --overlap-grad-reduce; (2) #69's 480p VSA-tile SP=2
  # row three times in one call: as r13 timed it (--ddp-impl torch: one fp32 all-reduce AFTER the backward, 14.9 ms of the
  # 13:57 profile's step plus ~8 ms of cat/div/copy), with megatron-core's DDP after and during the backward
  suite r17/dit_entry 240 "test_dit_entry_sp_vs_sp1 and 2-nccl"
  # (megatron without the overlap too: --ddp-impl megatron also brings megatron-core's optimizer and clipping)
  local impl
  for impl in torch megatron megatron_overlap; do
    keep r17/69vsa_sp2_480_$impl 170 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants \
      guarded,sparse_topk90 --sparse-args "--sparse-tile 4,4,4" --out $W/r17/69vsa_sp2_480_$impl \
      -- "${WAN14[@]}" --context-parallel-size 2 --frames 21 --latent-size 60x104 \
      $([ $impl = torch ] || echo "--ddp-impl megatron") $([ $impl = megatron_overlap ] && echo "--overlap-grad-reduce")
  done
}
stage_r14_first() {   # 1 GPU, no FA4 (local kernel cuDNN): the view split (3f60ad4, CPU-tested only) on CUDA first:
  # diffusers' Wan family at P=2 and P=4 ranks on this GPU over gloo; then #65's 720p peaks with both ranks on this
  # GPU (--ranks-share-gpu: per-rank peaks valid, no speed), diffusers' Ulysses beside ours-auto, attributed
  suite r14/diffusers_gloo 240 "test_diffusers_family and gloo"
  keep r14/720p_shared_cudnn 280 $WAN_BENCH --ranks-share-gpu --grid 720p --variants diffusers-ulysses,ours-auto \
    --steps 1 --warmup 1 --memory-peak --out $W/r14/720p_shared_cudnn.json
}
stage_r14_more() { stage_r12_fa4p4; }   # 1 GPU: #66's fa4 family at P=4 ranks on this GPU (ring rows at 4,096 tokens)
stage_r12_det_fa4() {   # 2 GPUs (FA4): --deterministic-mode with FA4's deterministic backward (new 2026-11-28): the
  # i70_resume row (200 steps, stop and save at 100, resume; SP=1 resume) with --sp-attention-backend fa4 --bf16
  # bash: these locals are seen by the stage it calls; its own folder (beside i70_resume's), bf16's SP=1 tolerance,
  # twice the time (each torchrun compiles FA4's forward and deterministic backward)
  suite r12/det_fa4_kernel 120 "test_fa4_deterministic_backward"   # the kernel reruns bit for bit, right vs float64
  local I70_RESUME=("${I70_RESUME[@]}" --sp-attention-backend fa4 --bf16) I70_DIR=r12_det_fa4 I70_SP1_RTOL=2e-2 \
    I70_SECS_X=2
  stage_i70_resume
}
stage_r13_det_kernel() {   # 1 GPU (FA4): only the kernel case of r12_det_fa4 (FA4's backward under torch's
  # deterministic switch reruns bit for bit and matches float64), where no two GPUs are free for its resume rows
  suite r13/det_fa4_kernel 150 "test_fa4_deterministic_backward"
}
stage_r13_checks() {   # 2 GPUs (FA4), before r12_65 on the same machine: diffusers' CUDA family over NCCL
  # (P=2) and FA4's deterministic backward case
  suite r13/checks 200 "(test_diffusers_family and 2-nccl) or test_fa4_deterministic_backward"
}
stage_r13_65() {   # 2 GPUs (FA4), after r13_checks on that machine: #65's 720p row after the view split (3f60ad4:
  # blocks.0's shard a view under checkpointing): the peak of ours against diffusers' (expected 36.9 MiB under),
  # attributed; ~5 min
  keep r13/720p 450 $WAN_BENCH --grid 720p --variants diffusers-ulysses,ours-auto,ours-hcms --steps 2 --warmup 2 \
    --memory-peak --out $W/r13/720p_memory_peak.json
}
stage_r13_65ring() {   # 2 GPUs (FA4): #65's ring row: diffusers' ring CP runs only without gradient checkpointing
  # (its ring backward unpacks saved tensors per ring step), so the whole job runs --recompute none at 480p
  # (wan-1.3b 30 blocks, ~50 GiB a rank est.): diffusers' Ulysses and ring CP beside ours; ~4 min
  keep r13/480p_norecompute 300 $WAN_BENCH --grid 480p --recompute none --variants \
    diffusers-ulysses,diffusers-ring,ours-auto,ours-ring --steps 3 --warmup 2 --out $W/r13/480p_norecompute.json
}
stage_r13_69vsa_sp2() {   # 2 GPUs (FA4 + cuDNN frontend): #69's VSA-tile row at SP=2 (wan-14b 2 blocks, 4x4x4 tiles,
  # 480p then 720p), the mode auto picked per mask in the JSON; target as at SP=1 (1.5x / 2.0x)
  keep r13/69vsa_sp2_480 240 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants \
    guarded,sparse_topk90,sparse_window90 --sparse-args "--sparse-tile 4,4,4" --out $W/r13/69vsa_sp2_wan14b_21x30x52 \
    -- "${WAN14[@]}" --context-parallel-size 2 --frames 21 --latent-size 60x104
  keep r13/69vsa_sp2_720 260 torchrun --nproc-per-node 2 tools/bench_train_step.py --variants guarded,sparse_topk90 \
    --sparse-args "--sparse-tile 4,4,4" --out $W/r13/69vsa_sp2_wan14b_21x45x80 \
    -- "${WAN14[@]}" --context-parallel-size 2 --frames 21 --latent-size 90x160
}
stage_r12_bs4() {   # the rest of r11_66b (cut by its call's deadline): block_sparse P=4 and cuDNN's block sparsity
  suite r12/bs4 500 "(test_block_sparse_family and 4-gloo and not fa4 and not cudnn) or test_cudnn_block_sparse_family"
}
stage_r12_fa4p4() {   # the fa4 family at P=4 (4 ranks on one GPU) with the ring rows at 4,096 tokens (OOM at 8,192)
  suite r12/fa4p4 450 "test_fa4_family and 4-gloo"
}
#   r11_66a-d: the CUDA families of the one kernel chooser (#66 item 3, merged untested on GPUs), P=2 and P=4.
stage_r11_66a() { suite r11/66a 500 "(test_fa4_family or test_fa4_block_sparse_family) and gloo"; }
stage_r11_66b() {
  suite r11/66b 500 "(test_auto_family or test_block_sparse_family or test_cudnn_block_sparse_family) and gloo"
}
stage_r11_66c() {
  suite r11/66c 500 "(test_varlen_family or test_ring_varlen_family or test_packed_family or test_dit_packed_family \
or test_varlen_local_kernels) and (gloo or not nccl)"
}
stage_r11_66d() { suite r11/66d 500 "(test_dit_sparse_family or test_dit_dynamic_family or test_dropout_family) and gloo"; }
stage_r11_69sp2() {   # #69's SP=2 row (2 GPUs, FA4): full-depth wan-1.3b, 75,600 tokens, full recompute, 128-token
  # tiles: dense vs window90 vs top-k90, auto's mode per mask in the JSON; target window90 >= 3.5x, top-k90 >= 3.0x
  keep r11/69sp2 500 torchrun --nproc-per-node 2 tools/bench_train_step.py \
    --variants guarded,sparse_window90,sparse_topk90 --log-interval 4 --out $W/r11/69sp2_wan13b_21x45x80 -- \
    --model wan-1.3b --bf16 --train-iters 10 --timing-bare-steps 4 --ddp-impl torch --recompute-granularity full \
    --context-parallel-size 2 --frames 21 --latent-size 90x160
}
stage_r11_69vsa() {   # #69's VSA-tile row (1 GPU, FA4 + cuDNN frontend): wan-14b 2 blocks, 480p then 720p, the sparse
  # variants on VSA's 4x4x4 tiles (cuDNN's 64-token block sparsity by auto's tile order), dense without them;
  # target top-k90 >= 1.5x (480p) / 2.0x (720p) the dense step
  keep r11/69vsa480 250 $STEP --variants guarded,sparse_topk90,sparse_window90 --sparse-args "--sparse-tile 4,4,4" \
    --out $W/r11/69vsa_wan14b_21x30x52 -- "${WAN14[@]}" --frames 21 --latent-size 60x104
  keep r11/69vsa720 280 $STEP --variants guarded,sparse_topk90 --sparse-args "--sparse-tile 4,4,4" \
    --out $W/r11/69vsa_wan14b_21x45x80 -- "${WAN14[@]}" --frames 21 --latent-size 90x160
}
stage_r11_66e() {   # 2 GPUs: #66 item 6 (the DiT's one parallelize call) on the Megatron entry's CUDA cases, then the
  # DeepSpeed DiT entry (its core changed to make_attention) at SP=2 over NCCL against SP=1: 5 losses within 1e-4
  suite r11/66e 300 "test_dit_entry_sp_vs_sp1 or test_fsdp2_entry_vs_unsharded_entry or \
test_dit_entry_data_path_and_manual_gc or (test_recompute_family and 2-nccl)"
  local n
  for n in 1 2; do
    keep r11/66e_ds_sp$n 120 torchrun --nproc-per-node $n training/train_deepspeed.py --context-parallel-size $n \
      --model tiny --train-iters 5 --frames 4,3 --latent-size 6x10 --log-dir $W/r11/66e_ds_sp$n
  done
  python3 - "$W/r11" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/66e_ds_sp{n}/metrics.jsonl") if l.strip()] for n in (1, 2))
rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")
print(json.dumps({"sp1": a, "sp2": b, "max_rel": rel, "within_1e-4": rel <= 1e-4}))
PY
}
stage_r11_65mem() {   # 2 GPUs (FA4): #65's +0.27% peak attributed: one step of diffusers' Ulysses and of ours under the
  # allocator's history, what is alive at each step's peak by allocating code (tools/memory_peak.py), ~5 min
  keep r11/720p_mem 420 $WAN_BENCH --grid 720p --variants diffusers-ulysses,ours-ulysses,ours-hcms --steps 2 \
    --warmup 2 --memory-peak --out $W/r11/720p_memory_peak.json
}
stage_r12_65() {   # 2 GPUs (FA4): #65's 720p row with auto after its noise fix (calibration.spread) and the peak
  # attributed (the history with frames at allocations only, tools/memory_peak.py), diffusers' both CPs, ~5 min
  keep r12/720p 450 $WAN_BENCH --grid 720p --variants diffusers-ulysses,ours-ulysses,ours-hcms,ours-auto,diffusers-ring \
    --steps 2 --warmup 2 --memory-peak --out $W/r12/720p_memory_peak.json
}
stage_r10_rope() {   # 1 GPU: the fused Wan RoPE bit for bit against diffusers' ops (bf16/fp16/fp32, fwd + bwd)
  suite r10/rope 120 "test_wan_rope_fused_bitwise"
}
stage_r10_d4() {   # 4 GPUs: the diffusers families (dense and block-sparse) over NCCL at P=4
  suite r10/diffusers4 240 "(test_diffusers_family or test_diffusers_sparse_family) and 4-nccl"
}
stage_r10_65() {   # call 3 (FA4), 2 GPUs: ONE job at 720p, wan-1.3b 30 blocks, SP=2: diffusers' own Ulysses beside
  # ours-auto and the two modes auto chooses between, each with its whole-run and steady (timed steps) peak, ~6 min
  suite r10/diffusers 120 "test_diffusers_family and 2-nccl"
  keep r10/720p 400 $WAN_BENCH --grid 720p --variants diffusers-ulysses,ours-auto,ours-ulysses,ours-hcms --steps 4 \
    --warmup 2 --out $W/r10/720p_side_by_side.json
}
W14=(training/train_wan_diffusers.py --init random --model wan-14b --context-parallel-size 4 --cp-comm-type auto
  --use-torch-fsdp2 --bf16 --recompute-granularity full --frames 21 --timing --log-interval 1 --lr 1e-4 --seed 3)
w14_summary() {   # w14_summary DIR: median step time, MFU and peak over the steps after the first two
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
rows = [r for r in rows if "step_time_s" in r]
t = rows[2:] or rows
print(json.dumps({"dir": sys.argv[1], "steps": len(rows), "step_s": statistics.median(r["step_time_s"] for r in t),
                  "mfu": statistics.median(r.get("mfu") or 0 for r in t),
                  "peak_mem_gib": max(r.get("peak_mem_gib") or 0 for r in rows),
                  "losses": [round(r["loss"], 5) for r in rows]}))
PY
}
stage_r10_67() {   # call 4 (FA4), 4 GPUs: the real Wan 2.1 14B (diffusers' WanTransformer3DModel, 40 blocks, random
  # weights) at full depth: FSDP2 over the 4 ranks beside SP=4 (auto), bf16 autocast, diffusers' gradient
  # checkpointing: 720p dense, 720p window90 (tile 4,4,8, window 1,2,2: 91.4% sparse), 480p dense; ~8 min
  local r
  for r in "720p_dense 260 90x160 6" "720p_window90 200 90x160 6 --sparse-attention tiles --sparse-tile 4,4,8 \
      --sparse-window 1,2,2" "480p_dense 150 60x104 8"; do
    set -- $r
    local name=$1 secs=$2 grid=$3 iters=$4; shift 4
    keep r10_67/$name $secs torchrun --nproc-per-node 4 "${W14[@]}" --latent-size $grid --train-iters $iters \
      --log-dir $W/r10_67/$name "$@"
    [ -f $W/r10_67/$name/metrics.jsonl ] && w14_summary $W/r10_67/$name | tee $W/r10_67/$name.json
  done
}
stage_r8a65() {   # call 1, 2 GPUs: the round's new path (the fused Wan RoPE, bit for bit diffusers' ops) and the
  # diffusers families over NCCL with it (cuDNN: no FA4 yet), ~5 min
  suite r8a/rope 120 "test_wan_rope_fused_bitwise"
  suite r8a/diffusers 200 "test_diffusers_family and 2-nccl"
  suite r8a/diffusers_sparse 150 "test_diffusers_sparse_family and 2-nccl"
}
stage_r8a67() {   # call 1, 2 GPUs: #67's FSDP2 families over NCCL at P=2 and the recompute family, ~5 min
  suite r8a/fsdp2_p2 200 "(fsdp2_model and 2-nccl) or fsdp2_entry"
  suite r8a/recompute 150 "recompute_family"
}
stage_r8a4() {   # call 1, 4 GPUs: the P=4 rows over NCCL (diffusers' Wan, FSDP2, recompute), ~3 min
  suite r8a4/diffusers 150 "test_diffusers_family and 4-nccl"
  suite r8a4/fsdp2 100 "test_fsdp2_model_vs_unsharded and 4-nccl"
  suite r8a4/recompute 100 "test_recompute_family and 4-nccl"
}
stage_r8c65() {   # call 3 (FA4), 2 GPUs: the diffusers family on FA4 over NCCL, then ONE job at 720p: diffusers' own
  # Ulysses beside ours-auto with the fused RoPE and with diffusers' RoPE ops, each timed then profiled 2 steps
  # (kernel time by category), ~7 min
  suite r8c/diffusers 150 "test_diffusers_family and 2-nccl"
  keep r8c/720p 400 $WAN_BENCH --grid 720p --variants diffusers-ulysses,ours-auto,ours-auto@rope=eager --steps 4 \
    --warmup 2 --profile-steps 2 --out $W/r8c/720p_side_by_side.json
}
stage_r8c67() {   # call 3 (FA4), 2 GPUs: #67's selective vs full recompute, one job (stage recompute2), ~5 min
  RECOMPUTE2_S=480 stage_recompute2
}
stage_r8d69a() {   # call 4 (FA4 + cuDNN frontend), 1 GPU: cuDNN's block-sparse kernel checked against fp32 math on
  # this machine (exit 1 on a wrong case), with its first timing; then its CUDA family at P=2 on this GPU, ~4 min
  keep r8d/cudnn_check 200 python3 tests/gpu/check_cudnn_block_sparse.py --out $W/r8d/cudnn_check
  suite r8d/cudnn_bs 200 "test_cudnn_block_sparse_family and 2-gloo"
}
stage_r8d69b() {   # call 4, 1 GPU: #69's kernel table rows (H=40 and 5, S 32K / 75K, 90%, random / top-k / window, 64-
  # and 128-token tiles): cuDNN's block sparsity beside FA4's and dense FA4 / cuDNN, as far as the call allows
  local left=$(( DEADLINE - $(date +%s) - 60 ))
  keep r8d/table $(( left + 40 )) python3 tools/bench_block_sparse.py --table --table-kernels cudnn_block_sparse,fa4 \
    --table-seqlens 32768,75776 --table-sparsities 0.9 --budget-s $left --out $W/r8d/table
}
stage_r8d66() {   # call 4, 2 GPUs: #66's profile of the sparse DiT step at SP=2 (host syncs, the mask check's
  # collectives per step), ~2 min
  keep r8d/sparse_sync 200 torchrun --nproc-per-node 2 tools/profile_sparse_sync.py --out $W/r8d/sparse_sync.json \
    --model wan-14b --num-layers 2 --frames 21 --latent-size 60x104 --sparsity 0.9 --bf16 --steps 10
}
# ---- #70: the rows proven only on CPU, on 2 and 4 GPUs over NCCL: DeepSpeed's stock Ulysses script, resume, dynamic
# SP, TP2 x CP2, the copy-engine transports ----
# Wheels: part.aa is enough for every stage but i70_dyn_model (megatron-core; the local kernel is then cuDNN); with
# every part (FA4) the DiT's steps and checks run on FA4 instead (auto's first choice), as users with FA4 run them.
# i70_ds / i70_ds_time need DeepSpeed: the folder .ds (bash tools/ds_wheels.sh --gpu here; 5 MB, git-ignored), carried
# once per machine in any call (run's carry: [".ds"]); gpu_install.sh keeps it under /tmp/spx_ds. Times are estimates
# for 2-4 H100s from the jobs' sizes (the same jobs on CPU, earlier GPU runs of the same tools), not measured yet.
# On 4 GPUs (part.aa and .ds carried in call 1), most needed first: call 1: i70_ds@0,1 i70_resume@2,3 (~3 min) |
#   call 2: i70_transport+i70_tpcp (~5.5) | call 3: i70_dyn_check (~4: P=2 and P=4) | call 4: i70_dyn2@0,1
#   i70_ds_time@2,3 (~4) | call 5: i70_dyn4 (~4) | with every part (FA4): i70_dyn_prof@0,1 i70_dyn_model@2 (~3).
# On 2 GPUs: i70_ds+i70_resume | i70_transport+i70_dyn_check | i70_ds_time | i70_dyn2 | i70_dyn_prof (+i70_dyn_model).
i70_gpus() {   # GPUs this stage sees (CUDA_VISIBLE_DEVICES of a STAGE@GPU call; nvidia-smi -L ignores it)
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo $(( $(tr -cd , <<< "$CUDA_VISIBLE_DEVICES" | wc -c) + 1 ))
  else ngpu; fi
}
i70_need() {   # i70_need STAGE N: true when the stage sees >= N GPUs, else says why it does not start
  [ "$(i70_gpus)" -ge "$2" ] && return 0
  echo "[$1: not started: needs $2 GPUs, sees $(i70_gpus)]"; return 1
}
i70_deepspeed() {   # i70_deepspeed STAGE: true when deepspeed imports (the .ds folder installed), else says so
  python3 -c "import deepspeed" > /dev/null 2>&1 && return 0
  echo "[$1: not started: deepspeed does not import here; carry .ds (bash tools/ds_wheels.sh --gpu)]"; return 1
}
stage_i70_ds() {   # row 1 (2 GPUs, part.aa + .ds; ~2.5 min: 5 torchruns of ~20-30 s, 10 fp32 steps of 4,096 tokens
  # each): DeepSpeed's stock Ulysses script (training/ds_examples/train_ulysses.py through megatron_sp_ext.deepspeed.
  # launch) at SP=1 on one GPU, then SP=2 with DeepSpeed's own DistributedAttention and with our JSON block
  # (ulysses, hcms, ring), dropout 0, no clip: every loss (and grad norm / 2) within 1e-5 of SP=1's, the attention
  # classes named; exit 1 otherwise (check/deepspeed_sp1.json, .md)
  i70_need i70_ds 2 && i70_deepspeed i70_ds || return 0
  keep i70_ds/check 300 python3 tests/gpu/check_deepspeed_sp1.py --nproc 2 --out $W/i70_ds/check
}
stage_i70_ds_time() {   # row 1 (2 GPUs, part.aa + .ds; ~3 min): the DeepSpeed adapter family over NCCL first (ours
  # == DeepSpeed's DistributedAttention with the same local callable, P=2), then the stock script's bf16 step at SP=2
  # (32,768 tokens, hidden 2048, 16 heads, 2 layers, 20 steps, median after 5): DeepSpeed's DistributedAttention vs
  # our block (ulysses, hcms); 3 torchruns of ~40 s. Time it with nothing else on the machine where possible.
  i70_need i70_ds_time 2 && i70_deepspeed i70_ds_time || return 0
  suite i70_ds_time/adapter 90 "test_deepspeed_adapter_vs_distributed_attention and 2-nccl"
  keep i70_ds_time/time 240 python3 tests/gpu/check_deepspeed_sp1.py --time --nproc 2 --out $W/i70_ds_time/time
}
# --deterministic-mode with math (and lr 1e-4, not the chaotic default 2e-3): on 4 x H100 (2026-11-27) the same 200-step
# run twice differed from step 85 on cuDNN and on math without it, so no resume could be told bit for bit
I70_RESUME=(training/pretrain_video_dit.py --model wan-1.3b --num-layers 2 --frames 5 --latent-size 32x32 --seed 7
  --log-interval 1 --quiet --deterministic-mode --sp-attention-backend math --cp-comm-type hcms --lr 1e-4 \
  ${I70_RESUME_ARGS:-})   # (--deterministic-mode refuses --cp-comm-type auto since 2026-11-28: a timing-based pick)
stage_i70_resume() {   # row 2 (2 GPUs, part.aa; ~3 min: four entry runs of ~20 s start-up + 100-200 fp32 steps of
  # 1,280 tokens at ~20-40 ms, one ~1.5 GB checkpoint): wan-1.3b dims, 2 layers, SP=2 (ulysses), megatron DDP and
  # optimizer (dist_checkpointing; I70_RESUME_ARGS adds e.g. --use-distributed-optimizer or --use-torch-fsdp2):
  # 200 steps uninterrupted; 100 steps saving at the stop; a resume to 200: every resumed loss bit for bit
  # (check_resume.json; the saving run's steps 0-99 against the uninterrupted run are the control: a difference
  # there is the GPU step's own nondeterminism: then rerun with I70_RESUME_ARGS="--sp-attention-backend math" to
  # tell the kernel's atomics from the resume); then the same checkpoint resumed at SP=1 on ONE GPU for 20 steps:
  # within 1e-5 of the SP=2 run (check_sp1.json, bit_identical reported beside)
  i70_need i70_resume 2 || return 0
  local n=${I70_DIR:-i70_resume} x=${I70_SECS_X:-1}
  local ck=$W/$n/ck one=${CUDA_VISIBLE_DEVICES:-0} d=$W/$n; one=${one%%,*}; rm -rf "$ck"
  keep $n/straight $(( 100 * x )) torchrun --nproc-per-node 2 "${I70_RESUME[@]}" --context-parallel-size 2 \
    --train-iters 200 --log-dir $d/straight
  keep $n/first $(( 90 * x )) torchrun --nproc-per-node 2 "${I70_RESUME[@]}" --context-parallel-size 2 \
    --train-iters 100 --save "$ck" --log-dir $d/first
  du -sh "$ck"
  keep $n/resumed $(( 90 * x )) torchrun --nproc-per-node 2 "${I70_RESUME[@]}" --context-parallel-size 2 \
    --train-iters 200 --load "$ck" --log-dir $d/resumed
  keep $n/check $(( 30 * x )) python3 tests/gpu/check_resume.py --straight $d/straight --resumed $d/resumed \
    --first $d/first --out $d/check_resume.json
  CUDA_VISIBLE_DEVICES=$one keep $n/sp1 $(( 80 * x )) torchrun --nproc-per-node 1 "${I70_RESUME[@]}" \
    --context-parallel-size 1 --train-iters 120 --load "$ck" --log-dir $d/sp1
  keep $n/check_sp1 $(( 30 * x )) python3 tests/gpu/check_resume.py --straight $d/straight --resumed $d/sp1 --rtol ${I70_SP1_RTOL:-1e-5} \
    --out $d/check_sp1.json
  rm -rf "$ck"
}
stage_i70_dyn_check() {   # row 3's check (2 GPUs: P=2; 4 GPUs: P=2 and P=4; ~2 min per P): the CUDA suite's
  # dynamic-SP family over NCCL (the DiT under dynamic SP against SP=1 on the same pack: loss and gradients, fp32 and
  # bf16 autocast, on the kernel auto picks here: what i70_dyn2/4 time)
  i70_need i70_dyn_check 2 || return 0
  suite i70_dyn_check/suite 250 "test_dit_dynamic_family and ($([ "$(i70_gpus)" -ge 4 ] && echo "2-nccl or 4-nccl" \
    || echo 2-nccl))"
}
I70_MIX=(--model wan-14b --num-layers 2 --bf16 --ddp-impl torch --frames 21,1,1,1,11,1,1,1,5,1 --latent-size 60x104
  --pack-samples --max-tokens-per-step 75000)
i70_dyn_steps() {   # i70_dyn_steps P: dynamic vs uniform SP on the Wan mix (one pack of 10 samples per step, 68,640
  # tokens: clips of 21, 11, 5 frames at 60x104 and 7 single images), one bench_train_step job per SP mode, each
  # with "packed" (uniform SP) and "dynamic_cp" (12 steps + 4 bare; ~0.5 s a step at P=2 on H100: ~100 s a job)
  local p=$1 mode
  for mode in ulysses ring; do
    keep i70_dyn$p/$mode 130 torchrun --nproc-per-node $p tools/bench_train_step.py --variants packed,dynamic_cp \
      --log-interval 4 --out $W/i70_dyn$p/$mode -- "${I70_MIX[@]}" --context-parallel-size $p --cp-comm-type $mode \
      --train-iters 12 --timing-bare-steps 4
  done
}
stage_i70_dyn2() {   # row 3 (2 GPUs; ~4 min): dynamic_cp_speedup (uniform / dynamic step) at P=2, Ulysses and ring
  i70_need i70_dyn2 2 && i70_dyn_steps 2
}
stage_i70_dyn4() {   # row 3 (4 GPUs; ~4 min): the same at P=4
  i70_need i70_dyn4 4 && i70_dyn_steps 4
}
stage_i70_dyn_prof() {   # row 3's profile (2 GPUs; ~3 min): where rank 0's step time goes (attention, GEMM, exchange,
  # idle, ...; tools/profile_train_step.py, 2 steps after 6) under uniform and under dynamic SP, Ulysses, P=2
  i70_need i70_dyn_prof 2 || return 0
  local v
  for v in packed dynamic_cp; do
    keep i70_dyn_prof/$v 120 torchrun --nproc-per-node 2 tools/profile_train_step.py --out $W/i70_dyn_prof --tag $v \
      --warmup 6 --steps 2 -- "${I70_MIX[@]}" --context-parallel-size 2 --cp-comm-type ulysses --train-iters 10 \
      $([ $v = dynamic_cp ] && echo --dynamic-context-parallel)
  done
}
stage_i70_dyn_model() {   # row 3's model (ONE GPU, every part: FA4; ~2 min): the emulated per-rank breakdown of the
  # same comparison (tools/bench_dynamic_sp.py: kernels timed one by one, exchanges at a link rate) at P=2 and P=4
  # on a Wan mix of 20 samples, beside which the measured steps read (cuDNN crashed in this bench's varlen trials on
  # 2026-11-25: FA4 only)
  if [ "${SPX_REQUIRE_FA4:-}" != 1 ]; then echo "[i70_dyn_model: not started: needs FA4 (carry every part)]"; return 0; fi
  local p
  for p in 2 4; do
    keep i70_dyn_model/p$p 100 python3 tools/bench_dynamic_sp.py --model wan-14b --world $p --pack wan-mix \
      --backend fa4 --out $W/i70_dyn_model/p$p
  done
}
stage_i70_tpcp() {   # row 4 (4 GPUs, part.aa; ~4 min): TP2 x CP2 checked first over NCCL: the TP x CP block's forms
  # against float64 (test_tp_cp_block: 18 cases) and against Megatron's own TP sequence-parallel self-attention in the
  # same module and weights (test_tp_cp_vs_megatron_layer: output, input and every parameter gradient, fp32, 8 cases);
  # then tools/bench_block.py --tp 2 at wan-14b dims (5120, 40 heads of 128), fwd and fwd+bwd of the attention
  # block, non-causal, 32,760 and 75,600 tokens: "megatron" (megatron-core's TP-SP layers with our Ulysses core as
  # the CP: Megatron's own CP attention needs Transformer Engine, not on the image) against the block's forms and
  # auto, each output compared with Megatron's before timing (rel_diff_vs_megatron). Not here: the training step at
  # TP2 x CP2 (the DiT entry has no TP; Megatron-LM's pretrain_gpt is not carried).
  i70_need i70_tpcp 4 || return 0
  suite i70_tpcp/suite 150 "(test_tp_cp_block or test_tp_cp_vs_megatron_layer) and 4-nccl"
  local n
  for n in 8190 18900; do
    keep i70_tpcp/block_$n 120 torchrun --nproc-per-node 4 tools/bench_block.py --tp 2 --models wan-14b \
      --tokens-per-gpu $n --causal 0 --iters 10 --tag wan14b_$(( 4 * n )) --out $W/i70_tpcp
  done
}
stage_i70_transport() {   # row 5 (2 GPUs: P=2; 4 GPUs: P=2 and P=4; part.aa; ~1.5 min): the CUDA suite's transport
  # family over NCCL (tests/gpu/cuda_transport.py): symm_mem and copy_engine in Ulysses/HCMS against float64 and bit for
  # bit against NCCL (dq within NCCL's own rerun noise), the async block through them, the all-gather block on
  # torch's fused symm_mem all-gather / reduce-scatter matmuls against float64; 34 cases per P
  i70_need i70_transport 2 || return 0
  suite i70_transport/suite 200 "test_transport_family"
}
# #68: Transformer Engine's CP beside ours in ONE job (tools/bench_cp.py --peers te; docs/te_peer.md). TE travels as
# .te/ (bash tools/te_wheels.sh: ONE part of 42.9 MB, the core library pruned to sm_90 and xz'd; FORM=wheel gives 7
# parts of 44 MiB, one per back-to-back call, if the pruned library does not load). Carry ".te" in a call of its own
# (42.9 MB + the ~15 MB tree: no .fa4 part fits beside it; .ds does) running i68_te_install: gpu_install.sh installs
# it into /tmp/te_site (~2 min: the transformer_engine_torch build) and exports SPX_TE_SITE in every later call to
# the same warm machine. Then FA4's parts (their calls), then i68_cp2_nv and i68_cp2_host, one call each, in calls
# after the one that installed FA4 (its disk-cache probe, fa4_disk_cache, runs once per machine and takes minutes):
# our modes then run FA4 (and the FA4 floor is timed), TE runs cuDNN. 2 GPUs: 1 (.te) + FA4's parts + 2 calls.
i68_te() {   # i68_te STAGE: true when TE is installed (SPX_TE_SITE), else says why the stage does not start; waits
  # (<= 420 s) for an install that a stage beside it runs (gpu_install.sh's TE lock)
  if [ -z "${SPX_TE_SITE:-}" ] && [ -f /tmp/spx_te/manifest ]; then
    flock -w 420 /tmp/spx_te.lock true; cat /tmp/spx_te/install.tail 2>/dev/null
    [ -f /tmp/te_site/.spx_te_installed ] && export SPX_TE_SITE=/tmp/te_site
  fi
  [ -n "${SPX_TE_SITE:-}" ] && return 0
  echo "[$1: not started: no Transformer Engine (carry .te: bash tools/te_wheels.sh; /tmp/spx_te/install.log, build.log)]"; return 1
}
stage_i68_te_install() {   # (2 GPUs, the call carrying .te; ~3 min with the install): TE imports from SPX_TE_SITE
  # in its own process, then a tiny TE CP fwd+bwd check of p2p, a2a and all_gather (H=8, L=8192, causal and not)
  # against one full-sequence call (exit 1 when a peer errs or differs by more than 2e-2); NVTE_DEBUG logs which
  # attention backend TE picked (FusedAttention = cuDNN expected on sm_90)
  i68_te i68_te_install && i70_need i68_te_install 2 || return 0
  keep i68_te_install/import 60 env PYTHONPATH=$SPX_TE_SITE:$PYTHONPATH python3 -c "import os; from tools.te_peer \
import share_torch_cudnn as s, cudnn_after_te as a; print('before TE', s(os.environ)); import transformer_engine \
as t, transformer_engine.pytorch as te; print('TE', t.__version__, t.__file__); r = a(); print('after TE', r); \
raise SystemExit(0 if isinstance(r['torch_cudnn'], int) and len(r['mapped']) == 1 else 1)"
  keep i68_te_install/smoke 180 env PYTHONPATH=$SPX_TE_SITE:$PYTHONPATH NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=1 \
    torchrun --nproc-per-node 2 \
    tools/bench_cp_te.py --peers te --heads 8 --seqlens 8192 --causal no,yes --iters 2 --warmup 1 --require-ok \
    --out-json $W/i68_te_install/smoke.json
}
I68_CP2=(--heads 40 --seqlens ${I68_SEQLENS:-32768,65536} --causal no,yes --modes ulysses,hcms,ring,auto --peers te
  --iters 5 --warmup 2)
stage_i68_cp2_nv() {   # (2 GPUs, one call; ~5-7 min est.): the P=2 grid on NVLink in ONE job: the floor, ulysses,
  # hcms, ring, auto, then TE p2p / a2a / all_gather in their own torchrun; fwd and fwd+bwd; every output and
  # gradient against one full-sequence call; auto / TE p2p per row (bench_cp_nvlink_P2.json, .md)
  i68_te i68_cp2_nv && i70_need i68_cp2_nv 2 || return 0
  keep i68_cp2_nv/bench 520 torchrun --nproc-per-node 2 tools/bench_cp.py "${I68_CP2[@]}" --links nvlink \
    --time-limit $(( DEADLINE - $(date +%s) - 15 )) --out $W/i68_cp2_nv
}
stage_i68_cp2_host() {   # (2 GPUs, one call; ~6-8 min est.): the same grid with NCCL_P2P_DISABLE=1 (host links)
  i68_te i68_cp2_host && i70_need i68_cp2_host 2 || return 0
  keep i68_cp2_host/bench 520 torchrun --nproc-per-node 2 tools/bench_cp.py "${I68_CP2[@]}" --links host \
    --time-limit $(( DEADLINE - $(date +%s) - 15 )) --out $W/i68_cp2_host
}
run_stage() {   # run_stage STAGE[+STAGE...] [GPU[,GPU]]: the stages one after the other (on those GPUs); one summary
  # and one tarball per call of run_stage (the device returns 8 files: 4 stages at once at most), named with '_'
  local s=${1//+/_} parts=${1//+/ } g=${2:-} t0 part; t0=$(date +%s)
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .fa4/commit 2>/dev/null || echo \
    "$(git rev-parse --short HEAD) (the device copy's git metadata: may lag; carry .fa4/commit)"; date -u;
    echo "gpu: ${g:-all}"; } > "$W/$s.meta"
  if [ -n "$g" ]; then export CUDA_VISIBLE_DEVICES=$g PET_MASTER_PORT=$(( 29500 + 17 * (${g%%,*} + 1) )); fi
  for part in $parts; do "stage_$part"; done 2>&1 | tee "$W/$s.log" | tail -n 60 > "$OUT/$s.txt"
  echo "stage $s${g:+ (GPU $g)}: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/$s.txt"
  # what this stage wrote (files newer than its start; stages on other GPUs at the same time may add theirs),
  # checkpoints and files over 4 MB (profiler traces) left out
  (cd "$W" && find . -type f -newer "$s.meta" -size -4M ! -name '*.pt' ! -name '*.pth' ! -name '*.distcp' \
    ! -name '*.tgz' -print0 | tar --null -czf "$OUT/$s.tgz" "$s.meta" -T - 2>/dev/null)
}
pids=()
for arg in "$@"; do
  case $arg in
    *@*) (run_stage "${arg%@*}" "${arg#*@}") & pids+=($!) ;;
    *) for p in "${pids[@]}"; do wait "$p"; done; pids=(); run_stage "$arg" ;;
  esac
done
for p in "${pids[@]}"; do wait "$p"; done
for arg in "$@"; do s=${arg%@*}; s=${s//+/_}; echo "=== $s"; cat "$OUT/$s.txt"; done
