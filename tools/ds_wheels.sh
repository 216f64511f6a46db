#!/usr/bin/env bash
# Wheels for tests/gpu/check_deepspeed_ulysses.py on a GPU machine with Python 3.12 and torch, no registry:
#   bash tools/ds_wheels.sh [dir]            (here, with a registry; default dir: wheels/)
#   pip install --no-index --find-links wheels/ deepspeed==0.19.8 transformers==5.23.0   (there)
# deepspeed is an sdist: built here as a py3-none-any wheel; the rest are binary wheels for cp312.
set -euo pipefail
DIR=${1:-wheels}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q deepspeed==0.19.8 --no-deps --no-build-isolation -w "$DIR"
"$PY" -m pip download -q transformers==5.23.0 hjson msgpack ninja psutil py-cpuinfo "pydantic>=2" einops tqdm \
    --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$DIR"
ls "$DIR"
