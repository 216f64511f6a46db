#!/usr/bin/env bash
# Usage: tools/need_disk.sh GIB DIR WHAT
# Exits 1 with one clear line when the file system holding DIR has less than GIB GiB free, so that an install
# that cannot fit stops before it starts instead of failing mid-download with pip's "No space left on device".
set -eu
need_gib=$1; dir=$2; what=$3
mkdir -p "$dir"
free_kib=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
free_gib=$(( free_kib / 1048576 ))
if [ "$free_kib" -lt $(( need_gib * 1048576 )) ]; then
  echo "== $what needs about $need_gib GiB free on the disk that holds $dir; $free_gib GiB free." >&2
  echo "   Free disk space (old clones, build folders) and run it again, or run 'make test-oldest' (the full suite, ~2 GiB)." >&2
  exit 1
fi
