# Two commands do everything on a fresh machine (each creates/updates its virtual environments first):
#   make demo   - the main job (sequence-parallel run on 4 CPU processes), ends with samples.png
#   make test   - both ends of the supported range:
#                 .venv          oldest pins: torch 2.13.0, megatron-core 0.16.1, deepspeed 0.19.8 (full suite)
#                 .venv-current  newer end: torch $(TORCH_CURRENT), megatron-core $(MCORE_CURRENT),
#                                deepspeed 0.19.8 (compatibility suite: adapters + a few algorithms).
#                                Its torch is PyPI's CUDA build, even on a CPU machine: ~5.6 GB with its NVIDIA
#                                libraries (9 GB free disk checked first). `make test-oldest`: .venv only.
#   make test-latest - the compatibility suite on the newest releases (tools/constraints-latest.txt)
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v7
CUR_VENV := .venv-current
CPY := $(CUR_VENV)/bin/python
CUR_STAMP := $(CUR_VENV)/.installed-v3
LATEST_VENV := .venv-latest
LATEST_STAMP := $(LATEST_VENV)/.installed-v1
LATEST_PINS := tools/constraints-latest.txt
# Installs that download are retried (tools/retry.sh), and pip resumes a dropped download up to 20 times.
RETRY := bash tools/retry.sh 3
export PIP_RESUME_RETRIES := 20
# The current end's pins, given to pip as its constraints file: they also replace a machine-wide pip
# constraints file that caps torch below the current release (some build machines have one).
CUR_PINS := tools/constraints-current.txt
TORCH_CURRENT := $(shell sed -n 's/^torch==//p' $(CUR_PINS))
MCORE_CURRENT := $(shell sed -n 's/^megatron-core==//p' $(CUR_PINS))
# The compatibility suite: both framework adapters, the DiT entry point on megatron-core's parallel_state,
# config validation, and the Ulysses/HCMS and ring algorithms on the current torch.
COMPAT_TESTS := tests/test_megatron.py tests/test_deepspeed.py tests/test_config.py tests/test_ulysses.py \
	tests/test_ring.py::test_zigzag_equals_megatron_split tests/test_ring.py::test_ring_fp32_matches_reference \
	tests/test_sample.py "tests/test_training.py::test_megatron_entry_3_steps_match_sp1"

# After the editable install: the DeepSpeed JSON switch is active at start-up (the .pth is in site-packages), so a
# stock DeepSpeed script in this venv switches by its "sequence_parallel_ext" block (docs/deepspeed.md). $(1): python
hook_check = DS_ACCELERATOR=cpu MEGATRON_SP_EXT_DEEPSPEED_HOOK=1 $(1) -c 'import sys, deepspeed; sys.exit(0 if \
	getattr(deepspeed.initialize, "_megatron_sp_ext", 0) is True else "the DeepSpeed JSON switch is not active \
	after pip install -e . (docs/deepspeed.md)")'

.PHONY: venv venv-current demo test test-oldest test-current test-latest test-gpu wheels clean

# Each environment is built once (about 2 minutes each on 2 cores); the pip output goes to <venv>/install.log
# and is shown only if the install fails.
$(STAMP): pyproject.toml setup.py
	@echo "== installing $(VENV): torch 2.13.0, megatron-core 0.16.1, deepspeed 0.19.8 (log: $(VENV)/install.log)"
	@mkdir -p $(VENV) && ( set -x; \
	{ test -x $(VPY) || $(PY) -m venv $(VENV); } && \
	$(RETRY) $(VPY) -m pip install -q --upgrade pip && \
	$(VPY) -m pip install -q torch==2.13.0 && \
	$(RETRY) $(VPY) -m pip install -q megatron-core==0.16.1 einops pytest matplotlib safetensors tqdm tensorboard transformers==5.23.0 diffusers==0.42.1 accelerate==1.15.0 peft==0.21.2 && \
	DS_BUILD_OPS=0 $(RETRY) $(VPY) -m pip install -q deepspeed==0.19.8 --no-build-isolation && \
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e . && \
	$(call hook_check,$(VPY)) ) > $(VENV)/install.log 2>&1 \
	|| { tail -n 40 $(VENV)/install.log; exit 1; }
	@touch $(STAMP)

# The newer end (.venv-current, in `make test`) and the newest releases (.venv-latest, `make test-latest`) are
# built by one recipe from their constraints file. megatron-core >= 0.17 declares Python >= 3.12 but runs on
# 3.11: installed without its Requires-Python check and without deps; its imports (numpy, packaging, triton,
# einops) are listed here. Its torch is a CUDA build from PyPI (~3 GiB of wheels, ~5.5 GiB installed): the disk
# is checked first (CI once ran out of space mid-download) and pip keeps no cached copy of the wheels.
# $(1): venv dir, $(2): constraints file.
define install_newer
	@echo "== installing $(1): $$(grep -E '^(torch|megatron-core|deepspeed)==' $(2) | tr '\n' ' ')(log: $(1)/install.log)"
	@{ test -x $(1)/bin/python && $(1)/bin/python -c 'import torch' 2>/dev/null; } || bash tools/need_disk.sh 9 $(1) "$(1) (torch $$(sed -n 's/^torch==//p' $(2)), a CUDA build from PyPI)"
	@mkdir -p $(1) && ( set -x; export PIP_CONSTRAINT=$(CURDIR)/$(2) PIP_NO_CACHE_DIR=1; \
	T=$$(sed -n 's/^torch==//p' $(2)); M=$$(sed -n 's/^megatron-core==//p' $(2)); \
	{ test -x $(1)/bin/python || $(PY) -m venv $(1); } && \
	$(RETRY) $(1)/bin/python -m pip install -q --upgrade pip && \
	$(RETRY) $(1)/bin/python -m pip install -q torch==$$T numpy packaging triton einops pytest matplotlib tqdm && \
	$(RETRY) $(1)/bin/python -m pip install -q --no-deps --ignore-requires-python megatron-core==$$M && \
	DS_BUILD_OPS=0 $(RETRY) $(1)/bin/python -m pip install -q deepspeed==0.19.8 --no-build-isolation && \
	$(1)/bin/python -c "import torch, megatron.core, deepspeed; assert torch.__version__.split('+')[0] == '$$T', torch.__version__" && \
	$(1)/bin/python -m pip install -q --no-deps --no-build-isolation -e . && \
	$(call hook_check,$(1)/bin/python) ) > $(1)/install.log 2>&1 \
	|| { tail -n 40 $(1)/install.log; exit 1; }
	@touch $@
endef

$(CUR_STAMP): pyproject.toml setup.py $(CUR_PINS)
	$(call install_newer,$(CUR_VENV),$(CUR_PINS))

$(LATEST_STAMP): pyproject.toml setup.py $(LATEST_PINS)
	$(call install_newer,$(LATEST_VENV),$(LATEST_PINS))

venv: $(STAMP)

venv-current: $(CUR_STAMP)

demo: $(STAMP)
	@PYTHON=$(VPY) bash configs/launch/dit_megatron_cpu.sh

test-oldest: $(STAMP)
	DS_ACCELERATOR=cpu $(VPY) -m pytest -q tests

test-current: $(CUR_STAMP)
	DS_ACCELERATOR=cpu $(CPY) -m pytest -q $(COMPAT_TESTS)

# The compatibility suite on the newest releases (~3 GB of CUDA wheels to download; not part of `make test`).
test-latest: $(LATEST_STAMP)
	DS_ACCELERATOR=cpu $(LATEST_VENV)/bin/python -m pytest -q $(COMPAT_TESTS)

# Both suites run even if the first fails; the exit status is non-zero if either failed.
test: $(STAMP) $(CUR_STAMP)
	@rc=0; \
	echo "== full suite, oldest pins: $$($(VPY) tools/versions.py)"; \
	DS_ACCELERATOR=cpu $(VPY) -m pytest -q tests || rc=1; \
	echo "== compatibility suite, newer end: $$($(CPY) tools/versions.py)"; \
	DS_ACCELERATOR=cpu $(CPY) -m pytest -q $(COMPAT_TESTS) || rc=1; \
	exit $$rc

# The CUDA suite, on a GPU machine (first, before any benchmark): every algorithm's CUDA branches vs float64,
# P=2 and P=4 ranks on one GPU (and one rank per GPU where there are several). Uses the machine's python3.
test-gpu:
	bash tools/gpu_run.sh

# wheels for the GPU machines (python 3.12, no registry there); see results/README.md
wheels: $(STAMP)
	mkdir -p wheels
	$(VPY) -m pip download -q megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 -d wheels/
	$(VPY) -m pip wheel -q deepspeed==0.19.8 --no-deps --no-build-isolation -w wheels/
	$(VPY) -m pip wheel -q --no-deps -w wheels/ .

clean:
	rm -rf $(VENV) $(CUR_VENV) $(LATEST_VENV) wheels build *.egg-info
