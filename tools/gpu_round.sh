#!/usr/bin/env bash
# A GPU session on one warm machine: the stages of tools/gpu_stages.txt, each call of this script within one device
# call (<= 10 min), back to back or side by side.
#   bash tools/gpu_round.sh STAGE[+STAGE...][@GPU[,GPU...]] ...    e.g.  suite   |   suite@0 step@1 cp@2,3
#   bash tools/gpu_round.sh --list                 the stages, their GPUs, seconds and what each measures
#   bash tools/gpu_round.sh --dry-run [ARG ...]    the jobs the arguments (default: every stage) would run
# STAGE@GPU runs on those GPUs alone (CUDA_VISIBLE_DEVICES), beside the other @GPU arguments before the next
# argument without @ (one job per GPU: no timing shares a GPU); an argument without @ runs alone, on every GPU;
# A+B runs A then B under one summary. Every job's limit is cut to the call's deadline (DEADLINE_S, default 540 s
# after the start), so the files are written before the device's 600 s limit. Each argument writes $OUT/<name>.txt
# (each job's command, the tail of its log, its exit status) and $OUT/<name>.tgz (<name>.meta: GPUs, commit, date;
# every job's whole log and what the stage wrote, files over 4 MB and checkpoints left out); <name> is the
# argument with '+' as '_', without its @GPU.
# First, the wheels carried as .fa4/ parts (tools/gpu_wheels.sh), .ds/ (tools/ds_wheels.sh) and .te/
# (tools/te_wheels.sh) are installed (tools/gpu_install.sh; kept between calls to the same warm machine). Carry
# .fa4/commit too (git rev-parse --short HEAD > .fa4/commit): the device copy's git metadata has lagged the tree.
# FA4's disk cache of compiled kernels stays as the caller sets FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED (off).
# A new measurement adds lines to tools/gpu_stages.txt, not code here; what ran goes to a results/ folder's README.
set -uo pipefail
cd "$(dirname "$0")/.."
TABLE=${GPU_STAGES:-tools/gpu_stages.txt}
names=() gpus=() secs=() cmds=()
while IFS= read -r line; do
  [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
  read -r n g s c <<< "$line"
  if ! [[ $g =~ ^[1-9][0-9]*$ && $s =~ ^[1-9][0-9]*$ && -n $c ]]; then
    echo "gpu_round: $TABLE: '$line' is not NAME GPUS SECONDS COMMAND" >&2; exit 2
  fi
  names+=("$n"); gpus+=("$g"); secs+=("$s"); cmds+=("$c")
done < "$TABLE"
stages=$(printf '%s\n' "${names[@]}" | awk '!seen[$0]++' | tr '\n' ' ')

check_arg() {   # check_arg ARG: the argument's stages exist and its GPUs are a comma list of numbers
  local arg=$1 parts=${1%@*} st
  [[ $arg =~ ^[A-Za-z0-9_+]+(@[0-9]+(,[0-9]+)*)?$ ]] || {
    echo "gpu_round: '$arg' is not STAGE[+STAGE...][@GPU[,GPU...]] (e.g. suite, step@1, cp@2,3)" >&2; return 1; }
  for st in ${parts//+/ }; do
    [[ " $stages" == *" $st "* ]] || { echo "gpu_round: no stage '$st' in $TABLE; stages: $stages" >&2; return 1; }
  done
}
case ${1:-} in
  ""|-h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; echo "stages: $stages"; exit 0 ;;
  --list)
    for st in $stages; do
      g=0 t=0; for i in "${!names[@]}"; do
        [ "${names[i]}" = "$st" ] && { [ "${gpus[i]}" -gt $g ] && g=${gpus[i]}; t=$(( t + secs[i] )); }; done
      printf '%-10s %s GPU+  %4s s  %s\n' "$st" "$g" "$t" "$(grep -m1 "^## $st: " "$TABLE" | cut -d' ' -f3-)"
    done; exit 0 ;;
  --dry-run)
    shift; [ $# -gt 0 ] || set -- $stages
    for arg in "$@"; do check_arg "$arg" || exit 2; done
    for arg in "$@"; do parts=${arg%@*}; for st in ${parts//+/ }; do for i in "${!names[@]}"; do
      [ "${names[i]}" = "$st" ] && printf '%s\t%s\t%s\t%s\n' "$st" "${gpus[i]}" "${secs[i]}" "${cmds[i]}"
    done; done; done; exit 0 ;;
esac
for arg in "$@"; do check_arg "$arg" || exit 2; done

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ "${SPX_GPU_INSTALL:-1}" != 0 ]; then   # 0: nothing installed (the CPU test of this script)
  SPX_TE_BACKGROUND=1 source tools/gpu_install.sh || exit 1   # TE (if carried) installs beside the stages
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-./gpu_out}; WORK=${GPU_ROUND_WORK:-/tmp/gpu_round}; mkdir -p "$OUT" "$WORK"
DEADLINE=$(( $(date +%s) + ${DEADLINE_S:-540} ))
ngpu() {   # the GPUs this stage sees (CUDA_VISIBLE_DEVICES of an @GPU argument; nvidia-smi -L ignores it)
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo $(( $(tr -cd , <<< "$CUDA_VISIBLE_DEVICES" | wc -c) + 1 ))
  else nvidia-smi -L | wc -l; fi
}
run_job() {   # run_job STAGE I N: table line I, the stage's job N, its whole log in $WORK/STAGE/jobN.log
  local st=$1 i=$2 n=$3 left limit rc
  left=$(( DEADLINE - $(date +%s) - 5 )); limit=${secs[i]}; [ "$limit" -gt "$left" ] && limit=$left
  if [ "$(ngpu)" -lt "${gpus[i]}" ]; then echo "[$st job $n: not started: needs ${gpus[i]} GPUs, sees $(ngpu)]"; return 0; fi
  if [ "$limit" -lt 30 ]; then echo "[$st job $n: not started, ${left}s left of the call]"; return 0; fi
  echo "\$ ${cmds[i]}"
  W=$WORK/$st NGPU=$(ngpu) LEFT=$(( limit - 15 )) timeout "$limit" bash -c "${cmds[i]}" > "$WORK/$st/job$n.log" 2>&1
  rc=$?
  grep -v "UserWarning\|warnings.warn" "$WORK/$st/job$n.log" | tail -n 15
  echo "[$st job $n: exit $rc$([ $rc -eq 124 ] && echo ", stopped at its ${limit}s limit")]"
}
run_arg() {   # run_arg STAGE[+STAGE...] [GPUS]: the stages one after the other (on those GPUs), one summary, one tarball
  local parts=${1//+/ } s=${1//+/_} g=${2:-} t0 st i n; t0=$(date +%s)
  if [ -n "$g" ]; then export CUDA_VISIBLE_DEVICES=$g PET_MASTER_PORT=$(( 29500 + 17 * (${g%%,*} + 1) )); fi
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .fa4/commit 2>/dev/null || echo \
    "$(git rev-parse --short HEAD) (the device copy's git metadata: may lag; carry .fa4/commit)"; date -u;
    echo "gpu: ${g:-all}"; echo "stages: $parts"; } > "$WORK/$s.meta"
  for st in $parts; do
    rm -rf "${WORK:?}/$st"; mkdir -p "$WORK/$st"; n=0
    for i in "${!names[@]}"; do [ "${names[i]}" = "$st" ] && { n=$(( n + 1 )); run_job "$st" "$i" "$n"; }; done
  done 2>&1 | tee "$WORK/$s.log" | tail -n 60 > "$OUT/$s.txt"
  echo "stage $s${g:+ (GPU $g)}: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/$s.txt"
  (cd "$WORK" && find $parts -type f -size -4M ! -name '*.pt' ! -name '*.pth' ! -name '*.distcp' -print0 |
    tar --null -czf "$OUT/$s.tgz" "$s.meta" "$s.log" -T - 2>/dev/null)
}
pids=()
for arg in "$@"; do
  case $arg in
    *@*) (run_arg "${arg%@*}" "${arg#*@}") & pids+=($!) ;;
    *) for p in "${pids[@]}"; do wait "$p"; done; pids=(); run_arg "$arg" ;;
  esac
done
for p in "${pids[@]}"; do wait "$p"; done
for arg in "$@"; do s=${arg%@*}; s=${s//+/_}; echo "=== $s"; cat "$OUT/$s.txt"; done
