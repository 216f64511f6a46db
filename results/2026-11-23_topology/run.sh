#!/usr/bin/env bash
# Regenerates this folder (CPU only: simulated gloo ranks, the volume model of topology/volume.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/2026-11-23_topology
for spec in "2 16" "4 32"; do
  set -- $spec
  for h in 40 12 32; do
    cmd="python tools/topology_report.py --world $2 --nodes $1 --heads $h --seqlen 131072"
    { echo "\$ $cmd"; PYTHONPATH=$PWD ${PYTHON:-python} ${cmd#python }; } > "$out/report_${1}x8_H${h}_L128K.txt" 2>&1
  done
done
# the emulated cluster of issue 20: 4 GPUs as 2 machines x 2 (SPX_EMULATED_MACHINE_SIZE=2)
for L in 32768 65536 131072; do
  cmd="python tools/topology_report.py --world 4 --nodes 2 --heads 40 --seqlen $L"
  { echo "\$ $cmd"; PYTHONPATH=$PWD ${PYTHON:-python} ${cmd#python }; } > "$out/report_2x2_H40_L$((L / 1024))K.txt" 2>&1
done
