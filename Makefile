# Two commands do everything on a fresh machine (each creates/updates its virtual environments first):
#   make demo   - the main job (sequence-parallel run on 4 CPU processes), ends with samples.png
#   make test   - both ends of the supported range:
#                 .venv          oldest pins: torch 2.13.0, megatron-core 0.16.1, deepspeed 0.19.8 (full suite)
#                 .venv-current  current releases: torch $(TORCH_CURRENT), megatron-core $(MCORE_CURRENT),
#                                deepspeed 0.19.8 (compatibility suite: adapters + a few algorithms)
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v4
CUR_VENV := .venv-current
CPY := $(CUR_VENV)/bin/python
CUR_STAMP := $(CUR_VENV)/.installed-v2
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

.PHONY: venv venv-current demo test test-oldest test-current wheels clean

# Each environment is built once (about 2 minutes each on 2 cores); the pip output goes to <venv>/install.log
# and is shown only if the install fails.
$(STAMP): pyproject.toml setup.py
	@echo "== installing $(VENV): torch 2.13.0, megatron-core 0.16.1, deepspeed 0.19.8 (log: $(VENV)/install.log)"
	@mkdir -p $(VENV) && ( set -x; \
	{ test -x $(VPY) || $(PY) -m venv $(VENV); } && \
	$(RETRY) $(VPY) -m pip install -q --upgrade pip && \
	$(VPY) -m pip install -q torch==2.13.0 && \
	$(RETRY) $(VPY) -m pip install -q megatron-core==0.16.1 einops pytest matplotlib safetensors tqdm tensorboard transformers==5.23.0 && \
	DS_BUILD_OPS=0 $(RETRY) $(VPY) -m pip install -q deepspeed==0.19.8 --no-build-isolation && \
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e . ) > $(VENV)/install.log 2>&1 \
	|| { tail -n 40 $(VENV)/install.log; exit 1; }
	@touch $(STAMP)

# megatron-core >= 0.17 declares Python >= 3.12 but runs on 3.11: installed without its
# Requires-Python check and without deps; its imports (numpy, packaging, triton, einops) are listed here.
$(CUR_STAMP): pyproject.toml setup.py $(CUR_PINS)
	@echo "== installing $(CUR_VENV): torch $(TORCH_CURRENT), megatron-core $(MCORE_CURRENT), deepspeed 0.19.8 (log: $(CUR_VENV)/install.log)"
	@mkdir -p $(CUR_VENV) && ( set -x; export PIP_CONSTRAINT=$(CURDIR)/$(CUR_PINS); \
	{ test -x $(CPY) || $(PY) -m venv $(CUR_VENV); } && \
	$(RETRY) $(CPY) -m pip install -q --upgrade pip && \
	$(RETRY) $(CPY) -m pip install -q torch==$(TORCH_CURRENT) numpy packaging triton einops pytest matplotlib tqdm && \
	$(RETRY) $(CPY) -m pip install -q --no-deps --ignore-requires-python megatron-core==$(MCORE_CURRENT) && \
	DS_BUILD_OPS=0 $(RETRY) $(CPY) -m pip install -q deepspeed==0.19.8 --no-build-isolation && \
	$(CPY) -c "import torch, megatron.core, deepspeed; assert torch.__version__.split('+')[0] == '$(TORCH_CURRENT)', torch.__version__" && \
	$(CPY) -m pip install -q --no-deps --no-build-isolation -e . ) > $(CUR_VENV)/install.log 2>&1 \
	|| { tail -n 40 $(CUR_VENV)/install.log; exit 1; }
	@touch $(CUR_STAMP)

venv: $(STAMP)

venv-current: $(CUR_STAMP)

demo: $(STAMP)
	@PYTHON=$(VPY) bash configs/launch/dit_megatron_cpu.sh

test-oldest: $(STAMP)
	DS_ACCELERATOR=cpu $(VPY) -m pytest -q tests

test-current: $(CUR_STAMP)
	DS_ACCELERATOR=cpu $(CPY) -m pytest -q $(COMPAT_TESTS)

# Both suites run even if the first fails; the exit status is non-zero if either failed.
test: $(STAMP) $(CUR_STAMP)
	@rc=0; \
	echo "== full suite, oldest pins: $$($(VPY) tools/versions.py)"; \
	DS_ACCELERATOR=cpu $(VPY) -m pytest -q tests || rc=1; \
	echo "== compatibility suite, current releases: $$($(CPY) tools/versions.py)"; \
	DS_ACCELERATOR=cpu $(CPY) -m pytest -q $(COMPAT_TESTS) || rc=1; \
	exit $$rc

# wheels for the GPU machines (python 3.12, no registry there); see tools/results/README.md
wheels: $(STAMP)
	mkdir -p wheels
	$(VPY) -m pip download -q megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 -d wheels/
	$(VPY) -m pip wheel -q deepspeed==0.19.8 --no-deps --no-build-isolation -w wheels/
	$(VPY) -m pip wheel -q --no-deps -w wheels/ .

clean:
	rm -rf $(VENV) $(CUR_VENV) wheels build *.egg-info
