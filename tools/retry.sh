#!/usr/bin/env bash
# Usage: tools/retry.sh N command [args...]
# Runs a network-bound install up to N times, 20 s apart, so that one dropped download (PyPI's CUDA
# wheels for the current torch are ~3 GB) does not fail the build. Exits with the last attempt's status.
set -u
n=$1; shift
rc=1
for i in $(seq 1 "$n"); do
  "$@" && exit 0
  rc=$?
  echo "== attempt $i/$n failed (exit $rc): $*" >&2
  if [ "$i" -lt "$n" ]; then sleep 20; fi
done
exit "$rc"
