#!/usr/bin/env bash
# Everything measured on the GPU machines, in parts that each fit one device call:
#   bash tools/gpu_suite.sh A   # CUDA correctness (P=2,4) + P=4 HCMS grid
#   bash tools/gpu_suite.sh B   # ring/tasp CUDA check, P=4 ring/tasp and 2x2 mesh benchmarks, video-DiT steps
#   bash tools/gpu_suite.sh C   # P=2 benchmarks (HCMS grid, ring/tasp)
#   bash tools/gpu_suite.sh D   # video-DiT steps, then P=2 ring/tasp and HCMS grid
#   bash tools/gpu_suite.sh E   # P=4 HCMS grid again with interleaved timing
#   bash tools/gpu_suite.sh F   # A/B: packed vs contiguous q/k/v (qkv_contiguous) against DeepSpeed
#   bash tools/gpu_suite.sh G   # async block vs plain block (weak + strong scaling), not run yet
#   bash tools/gpu_suite.sh H   # copy-engine (symm_mem) transport: CUDA equality, micro-benchmark, attention, block
#   bash tools/gpu_suite.sh I   # symm_mem check, auto/auto_symm vs ulysses vs DeepSpeed, block (weak/strong, pre-attention, auto)
#   bash tools/gpu_suite.sh J   # video-DiT steps: --sp-async-qkv off / on / auto
#   bash tools/gpu_suite.sh K   # all-gather QKV block: CUDA equality, block weak/strong, DiT step forms interleaved
#   bash tools/gpu_suite.sh L   # K again after removing per-call host syncs; DiT forms P=2/4; 8K/16K auto vs DeepSpeed
#   bash tools/gpu_suite.sh M   # 8K host-vs-GPU profile (ours vs DeepSpeed); all-gather block NCCL vs fused symm_mem
#   bash tools/gpu_suite.sh N   # after plain Ulysses dropped its side stream: bitwise check, 8K profile, 8K-32K vs DS
#   bash tools/gpu_suite.sh O   # final set, rotated interleaving: block weak/strong, DiT step forms, attention 8K-32K
#   bash tools/gpu_suite.sh Q   # DiT step with every block form (strong P=2,4) and weak scaling at P=4
#   bash tools/gpu_suite.sh S   # kernel-free copy-engine transport (copy_engine): CUDA equality, overlap, HCMS at P=4
#   bash tools/gpu_suite.sh U   # block memory re-check on GPU; attention time beside each transport; copy_engine grids
#   bash tools/gpu_suite.sh V   # HCMS kernel-free schedule (every kernel on the compute stream) with copy_engine
#   bash tools/gpu_suite.sh W   # GPU timelines of one step + A/B of HCMS's two schedules through copy_engine
#   bash tools/gpu_suite.sh X   # final 2026-11-22 set: copy_engine (compiled exchanges) checks, P=4/P=2 grids, DiT step
#   bash tools/gpu_suite.sh Y   # diagnostic: bare copy-engine pulls and a local copy beside attention
#   (results of F on 2026-11-21 were taken when "packed" was the default: there "ulysses" = packed and
#    "ulysses_contig" = today's default; parts A-E measured the packed layout)
# Writes under $OUT (default ./gpu_out) and packs it into results_<part>.tar.gz.
set -uo pipefail
PART=${1:?part A or B}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -d wheels ] && ! python3 -c "import deepspeed, megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpus_$PART.txt"
GRID="--heads 24,40 --seqlens 8192,16384,32768,57344,131072"
HCMS_MODES=deepspeed,ulysses,hcms2,hcms3,hcms4,hcms5,hcms6,hcms8,auto
run() { echo "+ $*"; "$@" 2>&1 | grep -v -i "warn" | tee -a "$OUT/log_$PART.txt"; }
dit_steps() {  # wan-1.3b dims, 4 layers, 32,760 tokens/sample, bf16, CP=4: ulysses vs hcms auto vs usp 2x2
  for mode in ulysses hcms usp; do
    extra=""; [ "$mode" = hcms ] && extra="--hcms-head-chunks auto"; [ "$mode" = usp ] && extra="--sp-ulysses-size 2 --sp-nodes 2"
    run python3 -m torch.distributed.run --nproc-per-node 4 training/pretrain_video_dit.py --model wan-1.3b \
      --num-layers 4 --context-parallel-size 4 --cp-comm-type $mode $extra --frames 21 --latent-size 60x104 --bf16 \
      --lr 1e-4 --train-iters 10 --seed 1 --quiet --log-dir "$OUT/dit_$mode"
  done
}
if [ "$PART" = A ]; then
  run python3 tools/gpu_check.py --world-sizes 2,4 --out "$OUT"
  run python3 tools/bench_attention.py --tag hcms_p4 --world-sizes 4 $GRID --modes $HCMS_MODES --trace --out "$OUT"
elif [ "$PART" = B ]; then
  run python3 tools/gpu_check.py --world-sizes 2,4 --only ring_tasp --out "$OUT"
  run python3 tools/bench_attention.py --tag ring_p4 --world-sizes 4 --heads 40 --seqlens 16384,32768,57344 \
      --modes ulysses,ring,tasp --out "$OUT"
  run python3 tools/bench_attention.py --tag ring_causal_p4 --causal --world-sizes 4 --heads 40 \
      --seqlens 16384,32768,57344 --modes ulysses,ring,tasp --out "$OUT"
  run python3 tools/bench_attention.py --tag mesh_2x2 --world-sizes 4 --nodes 2 --heads 40 --seqlens 16384,32768 \
      --modes ulysses,usp,tas,torus,usp-tasp --out "$OUT"
  dit_steps
elif [ "$PART" = G ]; then
  run python3 tools/bench_block.py --world-sizes 2,4 --models wan-1.3b,wan-14b --tokens-per-gpu 16384 --out "$OUT"
  run python3 tools/bench_block.py --world-sizes 2,4 --models wan-1.3b --seqlen 32768 --out "$OUT/strong"
elif [ "$PART" = H ]; then  # copy-engine transport: correctness, micro-benchmark, attention and block
  run python3 tools/gpu_check.py --world-sizes 2,4 --only symm_mem --out "$OUT"
  run python3 tools/bench_transport.py --world-sizes 2,4 --heads 40 --seqlens 16384,32768 --out "$OUT"
  run python3 tools/bench_attention.py --tag symm_p4 --world-sizes 4 --heads 40 --seqlens 16384,32768 \
      --modes ulysses,ulysses_symm,hcms2,hcms2_symm,hcms3_symm,hcms4_symm --iters 10 --out "$OUT"
  run python3 tools/bench_block.py --world-sizes 2,4 --models wan-1.3b --tokens-per-gpu 16384 --iters 8 --out "$OUT"
elif [ "$PART" = I ]; then  # after H: transport check again, auto vs symm modes, block benchmark with pre-attention + auto
  run python3 tools/gpu_check.py --world-sizes 2,4 --only symm_mem --out "$OUT"
  run python3 tools/bench_attention.py --tag symm_auto_p4 --world-sizes 4 --heads 40 --seqlens 8192,16384,32768 \
      --modes deepspeed,ulysses,ulysses_symm,hcms2,hcms2_symm,auto,auto_symm --iters 10 --out "$OUT"
  run python3 tools/bench_block.py --tag weak --world-sizes 2,4 --models wan-1.3b,wan-14b --tokens-per-gpu 16384 \
      --iters 6 --out "$OUT"
  run python3 tools/bench_block.py --tag strong --world-sizes 2,4 --models wan-1.3b --seqlen 32768 --iters 6 --out "$OUT"
elif [ "$PART" = J ]; then  # video-DiT training steps (wan-1.3b dims, 4 layers, 32,760 tokens, CP=4): plain vs async vs auto
  for form in off on auto; do
    run python3 -m torch.distributed.run --nproc-per-node 4 training/pretrain_video_dit.py --model wan-1.3b \
      --num-layers 4 --context-parallel-size 4 --cp-comm-type ulysses --sp-async-qkv $form --frames 21 \
      --latent-size 60x104 --bf16 --lr 1e-4 --train-iters 12 --seed 1 --quiet --log-dir "$OUT/dit_async_$form"
  done
elif [ "$PART" = K ]; then  # all-gather QKV block: CUDA equality, block weak/strong + pre-attention, DiT step forms interleaved
  run timeout 150 python3 tools/gpu_check.py --world-sizes 2,4 --only allgather --out "$OUT"
  run timeout 200 python3 tools/bench_block.py --tag weak_ag --world-sizes 2,4 --models wan-1.3b,wan-14b \
      --tokens-per-gpu 16384 --iters 6 --out "$OUT"
  run timeout 90 python3 tools/bench_block.py --tag strong_ag --world-sizes 4 --models wan-1.3b --seqlen 32768 \
      --transports nccl --iters 6 --out "$OUT"
  run timeout 120 python3 tools/bench_dit_step.py --world-sizes 4 --forms plain,plain_hcms2,async,allgather,auto \
      --iters 6 --out "$OUT"
elif [ "$PART" = L ]; then  # after K: all-gather block without per-call host syncs, DiT forms at P=2/4, 8K/16K auto vs DS
  run timeout 120 python3 tools/gpu_check.py --world-sizes 2,4 --only allgather --out "$OUT"
  run timeout 150 python3 tools/bench_block.py --tag weak_ag2 --world-sizes 2,4 --models wan-1.3b,wan-14b \
      --tokens-per-gpu 16384 --transports nccl --iters 10 --out "$OUT"
  run timeout 60 python3 tools/bench_block.py --tag strong_ag2 --world-sizes 4 --models wan-1.3b --seqlen 32768 \
      --transports nccl --iters 10 --out "$OUT"
  run timeout 150 python3 tools/bench_dit_step.py --world-sizes 2,4 --forms plain,async,allgather,auto --iters 10 \
      --out "$OUT"
  run timeout 100 python3 tools/bench_attention.py --tag short_p4 --world-sizes 4 --heads 24,40 --seqlens 8192,16384 \
      --modes deepspeed,ulysses,hcms2,auto --iters 40 --out "$OUT"
elif [ "$PART" = M ]; then  # launch-bound check at 8K (host vs GPU time, top kernels); all-gather nccl vs fused
  run timeout 60 python3 tools/gpu_check.py --world-sizes 4 --only allgather --out "$OUT"
  run timeout 60 python3 tools/profile_step.py --world-size 4 --heads 24 --seqlen 8192 --modes deepspeed,ulysses,ulysses_packed --out "$OUT"
  run timeout 60 python3 tools/profile_step.py --world-size 4 --heads 40 --seqlen 8192 --modes deepspeed,ulysses --out "$OUT"
  run timeout 150 python3 tools/bench_block.py --tag weak_ag3 --world-sizes 2,4 --models wan-1.3b,wan-14b \
      --tokens-per-gpu 16384 --chunks 2 --iters 10 --out "$OUT"
elif [ "$PART" = N ]; then  # after M: plain Ulysses (C=1) on the caller's stream, no events: host time and 8K-32K vs DS
  run timeout 90 python3 tools/gpu_check.py --world-sizes 4 --only hcms_bitwise,ulysses_hcms_bf16 --out "$OUT"
  run timeout 60 python3 tools/profile_step.py --world-size 4 --heads 24 --seqlen 8192 --modes deepspeed,ulysses --out "$OUT"
  run timeout 150 python3 tools/bench_attention.py --tag short_p4_nostream --world-sizes 4 --heads 24,40 \
      --seqlens 8192,16384,32768 --modes deepspeed,ulysses,hcms2,auto --iters 30 --out "$OUT"
elif [ "$PART" = O ]; then  # final set with rotated interleaving: block weak/strong, DiT step forms, attention 8K-32K
  run timeout 170 python3 tools/bench_block.py --tag weak_final --world-sizes 2,4 --models wan-1.3b,wan-14b \
      --tokens-per-gpu 16384 --chunks 2 --iters 12 --out "$OUT"
  run timeout 60 python3 tools/bench_block.py --tag strong_final --world-sizes 4 --models wan-1.3b --seqlen 32768 \
      --transports nccl --iters 12 --out "$OUT"
  run timeout 150 python3 tools/bench_dit_step.py --world-sizes 2,4 --forms plain,async,allgather,auto --iters 12 \
      --out "$OUT"
  run timeout 120 python3 tools/bench_attention.py --tag attn_final_p4 --world-sizes 4 --heads 24,40 \
      --seqlens 8192,16384,32768 --modes deepspeed,ulysses,hcms2,auto --iters 30 --out "$OUT"
elif [ "$PART" = Q ]; then  # DiT step, every block form side by side: strong (32,760 tokens, P=2,4) and weak (P=4, 16K/GPU)
  run timeout 170 python3 tools/bench_dit_step.py --tag strong_all --world-sizes 2,4 --iters 10 \
      --forms plain,plain_hcms2,async,async_hcms2,allgather,plain_symm,async_symm,allgather_symm,auto --out "$OUT"
  run timeout 90 python3 tools/bench_dit_step.py --tag weak_p4 --world-sizes 4 --frames 41 --iters 6 \
      --forms plain,async,allgather,auto --out "$OUT"
elif [ "$PART" = S ]; then  # kernel-free copy-engine transport: CUDA equality, overlap beside attention, HCMS at P=4
  run timeout 150 python3 tools/gpu_check.py --world-sizes 2,4 --only copy_engine,symm_mem --out "$OUT"
  run timeout 90 python3 tools/bench_transport.py --world-sizes 4 --heads 40 --seqlens 16384,32768 --out "$OUT"
  run timeout 200 python3 tools/bench_attention.py --tag ce_p4 --world-sizes 4 --heads 40 --seqlens 16384,32768 \
      --modes deepspeed,ulysses,hcms2,ulysses_ce,hcms2_ce,hcms3_ce,hcms4_ce,hcms5_ce --iters 20 --out "$OUT"
elif [ "$PART" = U ]; then  # after S: GPU re-check of the 2026-11-21 block memory change; attention kernel time beside each
  # transport; HCMS/auto with copy_engine vs NCCL vs DeepSpeed at 8K-32K; blocks with copy_engine and their peak memory
  run timeout 120 python3 tools/gpu_check.py --world-sizes 4 --only allgather,copy_engine --out "$OUT"
  run timeout 90 python3 tools/bench_transport.py --world-sizes 4 --heads 40 --seqlens 16384,32768 --out "$OUT"
  run timeout 170 python3 tools/bench_attention.py --tag ce_grid_p4 --world-sizes 4 --heads 24,40 \
      --seqlens 8192,16384,32768 --modes deepspeed,ulysses,hcms2,hcms3,auto,hcms2_ce,hcms3_ce,auto_ce --iters 30 --out "$OUT"
  run timeout 150 python3 tools/bench_block.py --tag weak_ce --world-sizes 4 --models wan-1.3b,wan-14b \
      --tokens-per-gpu 16384 --transports nccl,copy_engine --chunks 2 --iters 10 --out "$OUT"
elif [ "$PART" = V ]; then  # (run at commit 7ab77f5, whose kernel-free HCMS schedule was reverted after V/W) HCMS kernel-free schedule with copy_engine: CUDA equality, the P=4 grid vs NCCL and DeepSpeed
  run timeout 150 python3 tools/gpu_check.py --world-sizes 2,4 --only copy_engine,hcms_bitwise --out "$OUT"
  run timeout 300 python3 tools/bench_attention.py --tag kf_grid_p4 --world-sizes 4 --heads 24,40 \
      --seqlens 8192,16384,32768 --modes deepspeed,ulysses,hcms2,auto,hcms2_ce,hcms3_ce,hcms4_ce,hcms5_ce,auto_ce \
      --iters 30 --out "$OUT"
elif [ "$PART" = W ]; then  # (run at commit 7ab77f5 + tools; _ce0 then meant the comm-stream schedule) why is V's kernel-free schedule slower? GPU timelines + A/B against the comm-stream schedule
  run timeout 120 python3 tools/profile_step.py --world-size 4 --heads 24 --seqlen 8192 --modes ulysses,hcms2_ce,hcms2_ce0 \
      --timeline --out "$OUT"
  run timeout 150 python3 tools/bench_attention.py --tag kf_ab_p4 --world-sizes 4 --heads 40 --seqlens 16384,32768 \
      --modes ulysses,hcms2_ce,hcms2_ce0,hcms4_ce,hcms4_ce0 --iters 20 --out "$OUT"
elif [ "$PART" = X ]; then  # final set of 2026-11-22: copy_engine with compiled exchanges (host cost), P=4 and P=2 grids, DiT step
  run timeout 120 python3 tools/gpu_check.py --world-sizes 2,4 --only copy_engine --out "$OUT"
  run timeout 60 python3 tools/profile_step.py --world-size 4 --heads 24 --seqlen 8192 --modes ulysses,hcms2,hcms2_ce --out "$OUT"
  run timeout 80 python3 tools/bench_transport.py --world-sizes 4 --heads 40 --seqlens 16384,32768 --out "$OUT"
  run timeout 200 python3 tools/bench_attention.py --tag final_p4 --world-sizes 4 --heads 24,40 \
      --seqlens 8192,16384,32768 --modes deepspeed,ulysses,hcms2,auto,ulysses_ce,hcms2_ce,hcms3_ce,hcms4_ce,auto_ce \
      --iters 30 --out "$OUT"
  run timeout 100 python3 tools/bench_attention.py --tag final_p2 --world-sizes 2 --heads 40 --seqlens 16384,32768 \
      --modes deepspeed,ulysses,hcms2,auto,hcms2_ce,hcms3_ce,auto_ce --iters 20 --out "$OUT"
  run timeout 120 python3 tools/bench_dit_step.py --world-sizes 4 --forms plain,plain_hcms2,plain_ce,plain_hcms2_ce,async_ce,auto \
      --iters 10 --out "$OUT"
elif [ "$PART" = Y ]; then  # diagnostic: do bare copy-engine pulls (no flags) or a local copy progress beside attention?
  run timeout 100 python3 tools/bench_transport.py --world-sizes 4 --heads 40 --seqlens 16384,32768 --out "$OUT"
elif [ "$PART" = F ]; then
  run python3 tools/bench_attention.py --tag contig_ab_p4 --world-sizes 4 --heads 40 --seqlens 16384,32768,57344 \
      --modes deepspeed,ulysses_packed,ulysses,hcms2_packed,hcms2 --iters 10 --out "$OUT"
elif [ "$PART" = E ]; then
  run python3 tools/bench_attention.py --tag hcms_p4_interleaved --world-sizes 4 $GRID --modes $HCMS_MODES --out "$OUT"
elif [ "$PART" = D ]; then
  dit_steps
  run python3 tools/bench_attention.py --tag ring_p2 --world-sizes 2 --heads 40 --seqlens 16384,32768,57344 \
      --modes ulysses,ring,tasp --out "$OUT"
  run python3 tools/bench_attention.py --tag hcms_p2 --world-sizes 2 $GRID --modes $HCMS_MODES --out "$OUT"
else
  run python3 tools/bench_attention.py --tag hcms_p2 --world-sizes 2 $GRID --modes $HCMS_MODES --out "$OUT"
  run python3 tools/bench_attention.py --tag ring_p2 --world-sizes 2 --heads 40 --seqlens 16384,32768,57344 \
      --modes ulysses,ring,tasp --out "$OUT"
  run python3 tools/bench_attention.py --tag ring_causal_p2 --causal --world-sizes 2 --heads 40 \
      --seqlens 16384,32768,57344 --modes ulysses,ring,tasp --out "$OUT"
fi
# the device tool returns at most 8 files: pack everything, keep the archive and the log
tar czf "/tmp/results_$PART.tar.gz" -C "$OUT" . && find "$OUT" -mindepth 1 ! -name "log_$PART.txt" -delete \
  && mv "/tmp/results_$PART.tar.gz" "$OUT/"
