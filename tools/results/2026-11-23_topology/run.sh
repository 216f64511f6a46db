#!/usr/bin/env bash
# Regenerates this folder (CPU only: simulated gloo ranks, the volume model of topology/volume.py).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=tools/results/2026-11-23_topology
for spec in "2 16" "4 32"; do
  set -- $spec
  for h in 40 12 32; do
    cmd="python tools/topology_report.py --world $2 --nodes $1 --heads $h --seqlen 131072"
    { echo "\$ $cmd"; PYTHONPATH=$PWD ${PYTHON:-python} ${cmd#python }; } > "$out/report_${1}x8_H${h}_L128K.txt" 2>&1
  done
done
