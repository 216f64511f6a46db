#!/usr/bin/env bash
# Transformer Engine 2.20.2 into a folder of its own on a GPU machine without a registry, from the parts that
# tools/te_wheels.sh wrote (.te/part.* + .te/manifest). Called by tools/gpu_install.sh (under its lock) once the parts
# are under PARTS; runnable alone:
#   bash tools/te_install.sh [PARTS=/tmp/spx_te] [SITE=/tmp/te_site]
# Exit 0: installed (SITE/.spx_te_installed; TE imports with SITE first on PYTHONPATH) or already there; 3: parts
# missing (their names printed: carry them in the next call); 1: anything else (the message says what).
# SITE is never the main site-packages: TE half-installed breaks `import megatron.core` (it catches only
# ImportError), and once loaded TE changes torch SDPA's cuDNN choice, so only the TE peer's processes put SITE on
# their PYTHONPATH (tools/bench_cp.py --peers; SPX_TE_SITE). Steps: join the parts and check the manifest's sha256;
# the core library (pruned: xz -d, its sha256 checked against prune.json; or the whole wheel with pip --target); the
# runtime needs (.whl, --no-deps); transformer_engine_torch built from its sdist with nvcc against the image's torch
# (no build isolation, no network: NVTE_PYTORCH_FORCE_BUILD; NVTE_WITH_NCCL_EP=0: no expert-parallel bindings,
# which would need nccl.h); a transformer_engine-2.20.2.dist-info stub (TE checks
# that the versions of transformer_engine, its core and its torch extension agree).
set -uo pipefail
PARTS=${1:-/tmp/spx_te}
SITE=${2:-/tmp/te_site}
TE=2.20.2
say() { echo "te_install: $*"; }
[ -f "$SITE/.spx_te_installed" ] && { say "already installed in $SITE"; exit 0; }
[ -f "$PARTS/manifest" ] || { say "no $PARTS/manifest (carry .te/: bash tools/te_wheels.sh)"; exit 3; }
parts=$(tail -n +2 "$PARTS/manifest")
[ -n "$parts" ] || { say "$PARTS/manifest lists no parts"; exit 1; }
missing=$(for p in $parts; do [ -f "$PARTS/$p" ] || echo -n "$p "; done)
[ -z "$missing" ] || { say "waiting for parts: $missing(carry .te/ with them in the next call)"; exit 3; }
want=$(head -1 "$PARTS/manifest" | cut -d' ' -f2)
(cd "$PARTS" && cat $parts) > "$PARTS/te.tar"
[ "$(sha256sum "$PARTS/te.tar" | cut -d' ' -f1)" = "$want" ] || {
  say "the joined parts do not match the manifest's sha256 (parts of two te_wheels.sh runs? carry them again)"; exit 1; }
X=$PARTS/x; NEW=$SITE.new
rm -rf "$X" "$NEW" && mkdir -p "$X" "$NEW" && tar -C "$X" -xf "$PARTS/te.tar" && rm -f "$PARTS/te.tar" || exit 1
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@"; }
if [ -f "$X/te/core/rest.zip" ]; then
  python3 -m zipfile -e "$X/te/core/rest.zip" "$NEW" || { say "rest.zip did not unpack"; exit 1; }
  lib=$NEW/transformer_engine/wheel_lib/libtransformer_engine.so
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'), 1 << 24)" \
    "$X/te/core/libtransformer_engine.so.xz" "$lib" || { say "the library did not decompress"; exit 1; }
  lib_want=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['pruned_sha256'])" "$X/te/core/prune.json")
  [ "$(sha256sum "$lib" | cut -d' ' -f1)" = "$lib_want" ] || { say "the library's sha256 is not prune.json's"; exit 1; }
else
  pipi --target "$NEW" "$X"/te/core/*.whl || { say "pip could not install the core wheel"; exit 1; }
fi
# pip --target skips a top-level folder that already exists there (and --upgrade would delete it): each install goes
# into a folder of its own, merged into NEW with cp (the extension lands in NEW/transformer_engine/wheel_lib/)
pipi --target "$X/deps_site" "$X"/te/deps/*.whl && cp -a "$X/deps_site/." "$NEW/" ||
  { say "pip could not install TE's runtime needs"; exit 1; }
build_whl=("$X"/te/build/*.whl)
python3 -c "import setuptools" 2>/dev/null || build_whl+=("$X"/te/build_fallback/setuptools-*.whl)
python3 -c "import packaging.version" 2>/dev/null || build_whl+=("$X"/te/build_fallback/packaging-*.whl)
pipi --target "$X/build_py" "${build_whl[@]}" || { say "pip could not install the build's needs"; exit 1; }
# the CUDA headers torch's own nvidia-* wheels ship (cudnn.h among them) beside the toolkit's
inc=$(python3 -c "import os, nvidia; r = list(nvidia.__path__)[0]
print(':'.join(os.path.join(r, d, 'include') for d in sorted(os.listdir(r)) if os.path.isdir(os.path.join(r, d, 'include'))))" 2>/dev/null)
mkdir -p "$X/src" && tar -C "$X/src" -xzf "$X"/te/sdist/transformer_engine_torch-$TE.tar.gz || exit 1
t0=$(date +%s)
( cd "$X/src/transformer_engine_torch-$TE" &&
  PATH=$X/build_py/bin:$PATH PYTHONPATH=$X/build_py${PYTHONPATH:+:$PYTHONPATH} \
  CPLUS_INCLUDE_PATH=${inc}${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH} NVTE_PYTORCH_FORCE_BUILD=TRUE \
  NVTE_NO_LOCAL_VERSION=1 NVTE_WITH_NCCL_EP=0 NVTE_CUDA_ARCHS=90 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
    --target "$X/ext_site" . \
) > "$PARTS/build.log" 2>&1 || { tail -n 30 "$PARTS/build.log"; say "transformer_engine_torch did not build (log: $PARTS/build.log)"; exit 1; }
ls "$X"/ext_site/transformer_engine/wheel_lib/transformer_engine_torch*.so > /dev/null 2>&1 ||
  { say "the build left no transformer_engine/wheel_lib/transformer_engine_torch*.so: $(cd "$X/ext_site" && find . -name '*.so')"; exit 1; }
cp -a "$X/ext_site/." "$NEW/" || exit 1
say "transformer_engine_torch built in $(( $(date +%s) - t0 )) s"
# the stub: TE's load_framework_extension asserts the `transformer-engine` distribution exists "from a wheel" (a
# WHEEL file listed in its RECORD, Root-Is-Purelib: true) and that its version equals the core's and the extension's
D=$NEW/transformer_engine-$TE.dist-info
mkdir -p "$D"
printf 'Metadata-Version: 2.1\nName: transformer-engine\nVersion: %s\n' "$TE" > "$D/METADATA"
printf 'Wheel-Version: 1.0\nGenerator: megatron_sp_ext tools/te_install.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n' \
  > "$D/WHEEL"
echo spx > "$D/INSTALLER"
printf '%s\n' "transformer_engine-$TE.dist-info/METADATA,," "transformer_engine-$TE.dist-info/WHEEL,," \
  "transformer_engine-$TE.dist-info/INSTALLER,," "transformer_engine-$TE.dist-info/RECORD,," > "$D/RECORD"
PYTHONPATH=$NEW${PYTHONPATH:+:$PYTHONPATH} python3 -c "import transformer_engine.pytorch, transformer_engine as t
print('te_install: transformer_engine', getattr(t, '__version__', '?'), 'imports')" || {
  say "TE does not import from $NEW (kept there for a look)"; exit 1; }
rm -rf "$SITE" && mv "$NEW" "$SITE" && touch "$SITE/.spx_te_installed" && rm -rf "$X"
say "installed in $SITE"
