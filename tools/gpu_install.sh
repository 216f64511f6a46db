# Sourced by tools/gpu_run.sh on a GPU machine: installs the wheels carried as parts (tools/gpu_wheels.sh) once all
# parts have arrived (one per device call, kept under /tmp/spx_parts between calls to the same warm machine).
# Exports PYTHONPATH with /tmp/site (and FA4's CuTe DSL packages, which pip --target leaves off the path).
mkdir -p /tmp/spx_parts
if [ -d .fa4 ]; then cp -f .fa4/part.* .fa4/manifest /tmp/spx_parts/ 2>/dev/null; fi
if [ ! -f /tmp/site/.spx_installed ] && [ -f /tmp/spx_parts/manifest ]; then
  missing=$(tail -n +2 /tmp/spx_parts/manifest | while read -r p; do [ -f "/tmp/spx_parts/$p" ] || echo "$p"; done)
  if [ -n "$missing" ]; then
    echo "gpu_install: waiting for parts: $missing (carry them in the next call)"
  else
    want=$(head -1 /tmp/spx_parts/manifest | cut -d' ' -f2)
    (cd /tmp/spx_parts && cat $(tail -n +2 manifest) > /tmp/spx_wheels.tar)
    if [ "$(sha256sum /tmp/spx_wheels.tar | cut -d' ' -f1)" != "$want" ]; then
      echo "gpu_install: the joined parts do not match the manifest's sha256"; return 1
    fi
    rm -rf /tmp/spx_wheels && mkdir -p /tmp/spx_wheels && tar -C /tmp/spx_wheels -xf /tmp/spx_wheels.tar
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      /tmp/spx_wheels/*.whl && touch /tmp/site/.spx_installed && echo "gpu_install: installed $(ls /tmp/spx_wheels | wc -l) wheels"
  fi
fi
if [ -f /tmp/site/.spx_installed ]; then
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import flash_attn.cute" 2>/dev/null && export SPX_REQUIRE_FA4=1
fi
