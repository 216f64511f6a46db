#!/usr/bin/env bash
# Checkpoint save / resume on GPU through the megatron-core entry point with Megatron's DDP and
# optimizer (megatron.core.dist_checkpointing, fully_reshardable optimizer format), then a resume at another
# SP size; prints the save and load times the entry point reports.
#   bash tools/ckpt_gpu.sh 4    # 4 GPUs: wan-1.3b full depth, SP=4 saves at step 4, SP=2 (x DP=2) resumes
#   bash tools/ckpt_gpu.sh 1    # 1 GPU: SP=1 save -> resume, exercises the Megatron-optimizer path
# Uses --use-distributed-optimizer when the entry point has it (the training-throughput branch).
# Writes $OUT/ckpt_gpu.log (default ./gpu_out). Expect: "saved ... in Xs", "resumed from ... in Ys",
# the resumed run continuing from step 4 with a finite loss close to the saving run's last loss.
set -uo pipefail
NGPU=${1:-4}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOG="$OUT/ckpt_gpu.log"
CK="$OUT/ckpt_wan13b"
rm -rf "$CK"
export PYTHONPATH=$PWD
DOPT=()
if python training/pretrain_video_dit.py --help 2>/dev/null | grep -q -- --use-distributed-optimizer; then
  DOPT=(--use-distributed-optimizer)
fi
if [ "$NGPU" -ge 4 ]; then
  MODEL=(--model wan-1.3b --frames 8 --latent-size 32x32); SP_A=4; SP_B=2; MODE_A=ulysses; MODE_B=hcms
else
  MODEL=(--model wan-1.3b --num-layers 4 --frames 4 --latent-size 16x16); SP_A=1; SP_B=1; MODE_A=ulysses; MODE_B=ulysses
fi
COMMON=("${MODEL[@]}" --ddp-impl megatron --bf16 "${DOPT[@]}" --distributed-timeout-minutes 10)
{
  echo "== $(date -u) NGPU=$NGPU distributed optimizer: ${DOPT[*]:-no}"
  torchrun --nproc-per-node "$NGPU" training/pretrain_video_dit.py "${COMMON[@]}" \
    --context-parallel-size "$SP_A" --cp-comm-type "$MODE_A" \
    --train-iters 4 --save "$CK" --save-interval 2 --keep-last 2 2>&1 | grep -E "saved|Error|error" ; \
  echo "-- checkpoint on disk:"; du -sh "$CK"/iter_* ; cat "$CK/latest"
  torchrun --nproc-per-node "$NGPU" training/pretrain_video_dit.py "${COMMON[@]}" \
    --context-parallel-size "$SP_B" --cp-comm-type "$MODE_B" $([ "$MODE_B" = hcms ] && echo --hcms-head-chunks 2) \
    --train-iters 6 --load "$CK" --log-dir "$OUT/ckpt_resumed" 2>&1 | tee "$OUT/resume_full.log" | grep -E "resumed|loss|Error|error"
  echo "-- resumed losses:"; cat "$OUT/ckpt_resumed/metrics.jsonl" | cut -c1-120
  if [ "$SP_A" = "$SP_B" ]; then  # same layout: the uninterrupted run is the reference for steps 5-6
    torchrun --nproc-per-node "$NGPU" training/pretrain_video_dit.py "${COMMON[@]}" \
      --context-parallel-size "$SP_A" --cp-comm-type "$MODE_A" --train-iters 6 --log-dir "$OUT/ckpt_ref" --quiet \
      2>&1 | grep -E "Error|error"
    echo "-- uninterrupted losses:"; cat "$OUT/ckpt_ref/metrics.jsonl" | cut -c1-120
  fi
} 2>&1 | tee "$LOG"
