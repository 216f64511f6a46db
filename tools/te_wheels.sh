#!/usr/bin/env bash
# Here (with a registry): Transformer Engine 2.20.2 for the lent GPU machines (no TE, no registry there), as parts small
# enough to carry one per device call (the peer of tools/bench_cp.py --peers te; docs/te_peer.md):
#   bash tools/te_wheels.sh            -> .te/part.aa .. (+ .te/manifest: "sha256 <joined tar>", then the part names)
#   PART_MB=40 bash tools/te_wheels.sh    parts of 40 MiB (default 44: the tree, ~15 MB, plus one part stays under
#                                         the 64 MiB a call carries, with room for .ds/)
#   bash tools/te_wheels.sh measure    sizes of the core library deflated (as in the wheel), xz -9 and zstd -19 --long
#                                      (~6 min of CPU): whether recompressing saves a part
#   FORM=wheel bash tools/te_wheels.sh  the core wheel carried whole (7 parts of 44 MiB): the fallback if the pruned
#                                       library (below) does not load on the GPU
# Contents (one tar, split): the core wheel transformer_engine_cu13==2.20.2 (276 MB, of which libtransformer_engine.so
# 343 MB raw, 272 MB deflated) by default as tools/te_prune.py leaves it: cubins of sm_90 (H100/H200) only, the others
# zeroed in place, then xz -9 (23 MB; the rest of the wheel a 4 MB zip); the transformer_engine_torch==2.20.2 sdist
# (0.5 MB; built there with nvcc against the image's torch); the runtime needs the image lacks (TE's pytorch side
# imports onnx and onnxscript unconditionally, and pydantic; pydantic 2.14 wants typing-extensions >= 4.16); the
# build's own needs (wheel: its setup.py imports wheel.bdist_wheel; ninja for a parallel build; setuptools and
# packaging in case the image lacks them).
# Measured 2026-11-27 (the whole library): xz -9 ~0.83 of raw (stopped at 222 MB out for 268 of 343 MB in),
# zstd -19 --long=27 260 MB: no part fewer than the wheel's own deflate. Pruned to sm_90 + xz -9: 23.3 MB.
# There tools/gpu_install.sh joins the parts once every one is under /tmp/spx_te, checks the sha256, installs into
# /tmp/te_site (never the main site-packages), builds transformer_engine_torch and exports SPX_TE_SITE.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TE=2.20.2
SDIST=transformer_engine_torch-$TE.tar.gz
SDIST_SHA256=4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e   # PyPI's digest of the sdist
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
mkdir -p "$W/te/core" "$W/te/sdist" "$W/te/deps" "$W/te/build"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W/te/core" "transformer_engine_cu13==$TE"
if [ "${1:-}" = measure ]; then
  (cd "$W" && unzip -q te/core/*.whl 'transformer_engine/wheel_lib/libtransformer_engine.so')
  so=$W/transformer_engine/wheel_lib/libtransformer_engine.so
  echo "libtransformer_engine.so: raw $(stat -c %s "$so"), deflate (in the wheel)" \
    "$(unzip -v "$W"/te/core/*.whl | awk '/libtransformer_engine.so/ {print $3}')," \
    "xz -9 $(xz -9 -T1 -c "$so" | wc -c), zstd -19 --long=27 $(zstd -q -19 --long=27 -T1 -c "$so" | wc -c) bytes"
  exit 0
fi
# transformer_engine_torch is an sdist whose setup.py needs a CUDA torch even for its metadata, so pip download
# cannot fetch it here: its file from PyPI's simple index (PEP 691 JSON), checked against the pinned digest
URL=$("$PY" -c "import json, urllib.request
req = urllib.request.Request('https://pypi.org/simple/transformer-engine-torch/',
                             headers={'Accept': 'application/vnd.pypi.simple.v1+json'})
d = json.load(urllib.request.urlopen(req, timeout=60))
print(next(f['url'] for f in d['files'] if f['filename'] == '$SDIST'))")
"$PY" -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$URL" "$W/te/sdist/$SDIST"
echo "$SDIST_SHA256  $W/te/sdist/$SDIST" | sha256sum -c --quiet
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W/te/deps" onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 \
  ml-dtypes==0.6.0 protobuf==7.36.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W/te/build" wheel==0.48.0 ninja==1.13.2
# used there only if the image lacks them (torch needs setuptools on Python 3.12, transformers needs packaging)
mkdir -p "$W/te/build_fallback"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W/te/build_fallback" setuptools==80.9.0 packaging==26.4
if [ "${FORM:-sm90}" = sm90 ]; then   # the library pruned to sm_90 and xz'd, the rest of the wheel as a zip
  whl=$(ls "$W"/te/core/*.whl)
  "$PY" tools/te_prune.py "$whl" "$W/te/core" --keep-arch 90
  xz -9 -T0 "$W/te/core/libtransformer_engine.so"
  rm -f "$whl"
elif [ "${FORM}" != wheel ]; then
  echo "te_wheels.sh: FORM=${FORM}: valid are sm90 (default) and wheel"; exit 2
fi
# smallest first (the core wheel last): every part but the last is a prefix of the tar
rm -rf .te && mkdir -p .te
(cd "$W" && tar -cf - te/sdist te/build te/build_fallback te/deps te/core) > .te/te.tar
split -b "${PART_MB:-44}m" .te/te.tar .te/part.
{ echo "sha256 $(sha256sum .te/te.tar | cut -d' ' -f1)"; (cd .te && ls part.*); } > .te/manifest
rm -f .te/te.tar
cat .te/manifest; ls -l .te
