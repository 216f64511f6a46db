# Sourced by tools/gpu_run.sh on a GPU machine: installs the wheels carried as parts (tools/gpu_wheels.sh), kept
# under /tmp/spx_parts between calls to the same warm machine. The parts hold the wheels smallest first: from the
# first call on, the wheels the parts so far hold whole are installed, except FA4 and its CuTe DSL (megatron-core,
# deepspeed and their needs; FA4 half-installed would import and fail); once every part of the manifest is there
# they are joined, checked (sha256) and ALL installed afresh in one pip call (pip --target --upgrade replaces a
# package folder that two wheels share, e.g. nvidia_cutlass_dsl/). Exports PYTHONPATH with /tmp/site (and FA4's
# CuTe DSL packages, which pip --target leaves off the path).
mkdir -p /tmp/spx_parts /tmp/site
# One installer at a time: stages run side by side (gpu_round.sh STAGE@GPU) each source this file; on 2026-11-27 two
# of them copied the manifest at once and one read it empty ("parts do not match"), so that stage's suite never ran.
exec 8>/tmp/spx_install.lock && flock -w 900 8 || { echo "gpu_install: another install held the lock 900 s"; return 1; }
if [ -d .fa4 ]; then
  for f in .fa4/part.* .fa4/manifest; do [ -f "$f" ] && cp -f "$f" "/tmp/spx_parts/.$(basename "$f").tmp" && \
    mv -f "/tmp/spx_parts/.$(basename "$f").tmp" "/tmp/spx_parts/$(basename "$f")"; done
fi
SPX_LATE='flash_attn|quack|cutlass|tvm_ffi|dlpack'   # FA4 and its DSL: installed only once every part is there
spx_install_whole() {   # $1: a tar stream's file (maybe cut short); $2: "early" leaves SPX_LATE's wheels out
  rm -rf /tmp/spx_wheels && mkdir -p /tmp/spx_wheels
  tar -C /tmp/spx_wheels -xf "$1" 2>/dev/null
  local todo=() t d
  for t in /tmp/spx_wheels/*.whl.txz; do   # a wheel carried as its unpacked tree in xz (gpu_wheels.sh xz): zipped
    # back into the wheel (stored; pip reads RECORD, not the compression); one cut short by a missing part is left
    [ -f "$t" ] || continue
    [ "${2:-}" = early ] && basename "$t" | grep -qE "$SPX_LATE" && continue
    d=$(mktemp -d)
    if xz -dc "$t" 2>/dev/null | tar -C "$d" -xf - 2>/dev/null; then
      python3 -c "import os, sys, zipfile
with zipfile.ZipFile(sys.argv[2], 'w', zipfile.ZIP_STORED) as z:
    for r, _, fs in os.walk(sys.argv[1]):
        for f in fs:
            z.write(os.path.join(r, f), os.path.relpath(os.path.join(r, f), sys.argv[1]))" "$d" "${t%.txz}"
    fi
    rm -rf "$d" "$t"
  done
  for w in /tmp/spx_wheels/*.whl; do
    [ -f "$w" ] || continue
    grep -qxF "$(basename "$w")" /tmp/site/.spx_wheels 2>/dev/null && continue
    [ "${2:-}" = early ] && basename "$w" | grep -qE "$SPX_LATE" && continue
    python3 -c "import sys, zipfile; sys.exit(0 if zipfile.is_zipfile(sys.argv[1]) else 1)" "$w" && todo+=("$w")
  done
  [ ${#todo[@]} -eq 0 ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${todo[@]}" || return 1
  for w in "${todo[@]}"; do basename "$w" >> /tmp/site/.spx_wheels; done
  echo "gpu_install: installed ${#todo[@]} wheels"
}
if [ ! -f /tmp/site/.spx_installed ] && [ -f /tmp/spx_parts/manifest ]; then
  parts=$(tail -n +2 /tmp/spx_parts/manifest)
  [ -n "$parts" ] || { echo "gpu_install: /tmp/spx_parts/manifest lists no parts"; flock -u 8; return 1; }
  missing=$(for p in $parts; do [ -f "/tmp/spx_parts/$p" ] || echo -n "$p "; done)
  if [ -n "$missing" ]; then
    have=""; for p in $parts; do [ -f "/tmp/spx_parts/$p" ] || break; have="$have /tmp/spx_parts/$p"; done
    if [ -n "$have" ]; then cat $have > /tmp/spx_wheels.tar && spx_install_whole /tmp/spx_wheels.tar early; fi
    echo "gpu_install: waiting for parts: $missing (carry them in the next call)"
  else
    want=$(head -1 /tmp/spx_parts/manifest | cut -d' ' -f2)
    (cd /tmp/spx_parts && cat $parts > /tmp/spx_wheels.tar)
    if [ "$(sha256sum /tmp/spx_wheels.tar | cut -d' ' -f1)" != "$want" ]; then
      echo "gpu_install: the joined parts do not match the manifest's sha256"; flock -u 8; return 1
    fi
    rm -rf /tmp/site && mkdir -p /tmp/site && spx_install_whole /tmp/spx_wheels.tar && touch /tmp/site/.spx_installed
  fi
fi
# DeepSpeed (#70), carried apart from the parts as .ds/ (tools/ds_wheels.sh --gpu, ~5 MB: deepspeed 0.19.8 built with
# DS_BUILD_OPS=0 and the needs the image lacks): kept under /tmp/spx_ds between calls to the same warm machine and
# installed into /tmp/site when its wheels are not there yet (also after the parts' full install emptied /tmp/site)
if [ -d .ds ]; then mkdir -p /tmp/spx_ds && cp -f .ds/*.whl /tmp/spx_ds/ 2>/dev/null; fi
spx_ds=(); for w in /tmp/spx_ds/*.whl; do
  [ -f "$w" ] && ! grep -qxF "$(basename "$w")" /tmp/site/.spx_wheels 2>/dev/null && spx_ds+=("$w"); done
if [ ${#spx_ds[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${spx_ds[@]}" || { flock -u 8; return 1; }
  for w in "${spx_ds[@]}"; do basename "$w" >> /tmp/site/.spx_wheels; done
  echo "gpu_install: installed ${#spx_ds[@]} DeepSpeed wheels (.ds): $(PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    python3 -c 'import deepspeed; print("deepspeed", deepspeed.__version__, "imports")' 2>&1 | tail -n 1)"
fi
unset spx_ds
# The image's huggingface_hub (1.33 on 2026-11-27) serves diffusers 0.42 (>= 1.32); a carried 2.x needs truststore,
# which the image lacks (diffusers' import then fails and its families skip): the image's copy is kept.
rm -rf /tmp/site/huggingface_hub /tmp/site/huggingface_hub-*.dist-info
# Transformer Engine (#68), carried as .te/ (tools/te_wheels.sh: parts + manifest, one part a call): kept under
# /tmp/spx_te between calls to the same warm machine; once every part is there tools/te_install.sh joins, checks and
# installs it into /tmp/te_site, NEVER /tmp/site (TE in the main path breaks `import megatron.core` and changes torch
# SDPA's cuDNN choice): only the TE peer's processes put it on their path, through SPX_TE_SITE. A failed TE install
# is reported and leaves the rest of this script as it was; without .te/ nothing here runs.
if [ -d .te ]; then
  mkdir -p /tmp/spx_te
  for f in .te/part.* .te/manifest; do [ -f "$f" ] && cp -f "$f" "/tmp/spx_te/.$(basename "$f").tmp" && \
    mv -f "/tmp/spx_te/.$(basename "$f").tmp" "/tmp/spx_te/$(basename "$f")"; done
  rm -f /tmp/spx_te/failed   # carried again: a failed install is tried again
fi
flock -u 8; exec 8>&-
# TE's install (~2-3 min: the transformer_engine_torch build) under a lock of its own, taken without waiting: the
# first stage of a call installs it, stages beside it on other GPUs go on without TE (they do not use it); a TE
# stage waits for that lock (tools/gpu_stages.txt: te) before it reads /tmp/te_site
if [ -f /tmp/spx_te/manifest ] && [ ! -f /tmp/te_site/.spx_te_installed ] && [ ! -f /tmp/spx_te/failed ]; then
  exec 9>/tmp/spx_te.lock
  if flock -n 9; then   # in the background (it keeps the lock until done) when gpu_round.sh asks (SPX_TE_BACKGROUND=1)
    spx_te_install() {
      bash tools/te_install.sh /tmp/spx_te /tmp/te_site > /tmp/spx_te/install.log 2>&1; local rc=$?
      tail -n 40 /tmp/spx_te/install.log
      if [ $rc = 1 ]; then touch /tmp/spx_te/failed
        echo "gpu_install: the TE install failed (/tmp/spx_te/install.log); not tried again until .te is carried again"
      fi
    }
    if [ "${SPX_TE_BACKGROUND:-}" = 1 ]; then echo "gpu_install: installing TE in the background"
      spx_te_install > /tmp/spx_te/install.tail 2>&1 &
    else spx_te_install; fi
    unset -f spx_te_install
  else echo "gpu_install: TE is being installed by another process (no TE here)"; fi
  exec 9>&-
fi
[ -f /tmp/te_site/.spx_te_installed ] && export SPX_TE_SITE=/tmp/te_site
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
if [ -f /tmp/site/.spx_installed ]; then
  python3 -c "import flash_attn.cute" 2>/dev/null && export SPX_REQUIRE_FA4=1
  # cuDNN frontend's block sparsity (#69), when carried: its family must then run (in a process of its own: importing
  # cudnn loads cuDNN)
  python3 -c "import cudnn.block_sparse_attention" 2>/dev/null && export SPX_REQUIRE_CUDNN_BSA=1
fi
