# Two commands do everything on a fresh machine (each creates/updates .venv first):
#   make demo   - the main job (sequence-parallel run on 4 CPU processes)
#   make test   - the test suite
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v2

.PHONY: venv demo test wheels clean

$(STAMP): setup.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q megatron-core==0.16.1 einops pytest matplotlib safetensors tqdm tensorboard
	DS_BUILD_OPS=0 $(VPY) -m pip install -q deepspeed==0.19.8 --no-build-isolation
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PYTHON=$(VPY) ITERS=40 bash configs/launch/dit_megatron_cpu.sh

test: $(STAMP)
	DS_ACCELERATOR=cpu $(VPY) -m pytest -q tests

# wheels for the GPU machines (python 3.12, no registry there); see README "GPU runs"
wheels: $(STAMP)
	mkdir -p wheels
	$(VPY) -m pip download -q megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 -d wheels/
	$(VPY) -m pip wheel -q deepspeed==0.19.8 --no-deps --no-build-isolation -w wheels/
	$(VPY) -m pip wheel -q --no-deps -w wheels/ .

clean:
	rm -rf $(VENV) wheels build *.egg-info
