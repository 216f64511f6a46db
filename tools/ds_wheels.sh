#!/usr/bin/env bash
# Wheels for tests/gpu/check_deepspeed_ulysses.py on a GPU machine with Python 3.12 and torch, no registry:
#   bash tools/ds_wheels.sh [dir]            (here, with a registry; default dir: wheels/)
#   pip install --no-index --find-links wheels/ deepspeed==0.19.8 transformers==5.23.0   (there)
#   bash tools/ds_wheels.sh --gpu            -> .ds/ (git-ignored, ~5 MB): DeepSpeed 0.19.8 (DS_BUILD_OPS=0) and the
#     needs the lent GPU machines' image lacks beside the "lite" wheel parts (hjson, pydantic 2.14.4, pydantic-core,
#     annotated-types, typing-inspection; typing-extensions 4.16 (pydantic 2.14 needs >= 4.16) and psutil (imported by
#     deepspeed.runtime.utils) as insurance: they shadow the image's copies); msgpack, py-cpuinfo, tqdm, einops are
#     on the image. Carry it (run's carry: [".ds"]) in any call: tools/gpu_install.sh keeps it under /tmp/spx_ds and
#     installs it into /tmp/site (again after the parts' full install empties /tmp/site).
# deepspeed is an sdist: built here as a py3-none-any wheel; the rest are binary wheels for cp312.
set -euo pipefail
PY=${PYTHON:-python3}
if [ "${1:-}" = --gpu ]; then
  cd "$(dirname "$0")/.."
  rm -rf .ds && mkdir -p .ds
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .ds \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 psutil==7.2.2
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q deepspeed==0.19.8 --no-deps --no-build-isolation -w .ds
  ls -la .ds; du -sh .ds
  exit 0
fi
DIR=${1:-wheels}
mkdir -p "$DIR"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q deepspeed==0.19.8 --no-deps --no-build-isolation -w "$DIR"
"$PY" -m pip download -q transformers==5.23.0 hjson msgpack ninja psutil py-cpuinfo "pydantic>=2" einops tqdm \
    --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$DIR"
ls "$DIR"
