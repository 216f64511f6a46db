#!/usr/bin/env bash
# Here (with a registry): the wheels the GPU machines lack, as parts small enough to carry one per device call.
#   bash tools/gpu_wheels.sh            -> .fa4/part.aa, .fa4/part.ab (+ .fa4/manifest), git-ignored
#   bash tools/gpu_wheels.sh lite       -> the same parts without DeepSpeed and its needs (smaller)
#   bash tools/gpu_wheels.sh xz         -> the parts again, wheels over 2 MB as xz'd trees: TWO parts of 39 MB
#                                          (2026-11-28; FA4 usable from the second call on)
#   PARTS=3 bash tools/gpu_wheels.sh lite   -> three parts (~35 MB each): with results at 12.7 MB the tree
#                                              (13.8 MB) and one of two lite halves went over 64 MiB (2026-11-26)
# Contents: flash-attn-4 and its CuTe DSL compiler (~102 MB), megatron-core 0.16.1, deepspeed 0.19.8, diffusers 0.42.1
# (the image's huggingface-hub 1.33 serves it), cuDNN frontend 1.32.0 (block-sparse attention; uses FA4's
# CuTe DSL) and their small needs (cp312, manylinux). There (tools/gpu_install.sh, sourced by tools/gpu_run.sh): each call carrying a
# part leaves it under /tmp/spx_parts; once every part of the manifest is there they are joined, checked
# (sha256) and installed with pip --no-index into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pack() {   # pack DIR: DIR's wheels -> .fa4/part.aa, .fa4/part.ab (PARTS of them, default 2) + .fa4/manifest (sha256 of
  # the whole); DIR removed.
  # Smallest first: the first part then holds every wheel but the CuTe DSL libraries whole (megatron-core, FA4's
  # Python), which gpu_install.sh installs from the first call on; two equal parts, each under 64 MiB with the tree
  rm -rf .fa4 && mkdir -p .fa4
  tar -C "$1" -cf .fa4/wheels.tar $(cd "$1" && ls -Sr)
  split -n "${PARTS:-2}" .fa4/wheels.tar .fa4/part.
  { echo "sha256 $(sha256sum .fa4/wheels.tar | cut -d' ' -f1)"; (cd .fa4 && ls part.*); } > .fa4/manifest
  rm -f .fa4/wheels.tar; rm -rf "$1"
  cat .fa4/manifest; du -sh .fa4/*
}
if [ "${1:-}" = lite ]; then   # the parts again without DeepSpeed and its needs (not used by tests/gpu/test_cuda.py
  # outside its DeepSpeed adapter case, which then skips by name; msgpack and py-cpuinfo are on the image): with the
  # tree at 12.3 MB, two halves of the whole set (55.1 MB each) went over the 64 MiB a call carries
  W=$(mktemp -d); (cd .fa4 && cat $(tail -n +2 manifest)) | tar -C "$W" -xf -
  rm -f "$W"/deepspeed-*.whl "$W"/hjson-*.whl "$W"/msgpack-*.whl "$W"/py_cpuinfo-*.whl "$W"/pydantic-*.whl \
    "$W"/pydantic_core-*.whl "$W"/annotated_types-*.whl "$W"/typing_inspection-*.whl
  pack "$W"; exit 0
fi
if [ "${1:-}" = xz ]; then   # the parts again, every wheel over 2 MB carried as its unpacked tree in xz -9
  # (<name>.whl.txz; gpu_install.sh zips it back into the wheel before pip): the CuTe DSL's 92 MB wheel is 63.5 MB
  # so, and the whole set fits TWO parts (~47 MB each; with the 17 MB tree under the 64 MiB a call carries); the
  # image's huggingface_hub is kept there (gpu_install.sh), so it and its httpx2 / httpcore2 are left out
  W=$(mktemp -d); (cd .fa4 && cat $(tail -n +2 manifest)) | tar -C "$W" -xf -
  rm -f "$W"/huggingface_hub-*.whl "$W"/httpx2-*.whl "$W"/httpcore2-*.whl
  for w in "$W"/*.whl; do
    [ "$(stat -c %s "$w")" -gt 2000000 ] || continue
    d=$(mktemp -d); (cd "$d" && unzip -q "$w") && tar -C "$d" -cf - . | xz -9 -T0 > "$w.txz" && rm -f "$w"; rm -rf "$d"
  done
  PARTS=${PARTS:-2} pack "$W"; exit 0
fi
W=$(mktemp -d)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 megatron-core==0.16.1 \
  hjson msgpack py-cpuinfo pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
  diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0 nvidia-cudnn-frontend==1.32.0
DS_BUILD_OPS=0 "$PY" -m pip wheel -q deepspeed==0.19.8 --no-deps --no-build-isolation -w "$W"
pack "$W"
