# Two commands: `make demo` and `make test`. Each sets up .venv at the repo root when missing.
# While editing, `make test-fast` (docs/development.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := .demo

LATEST := .venv-latest
# Python 3.12 for test-latest: on PATH, or pyenv's where its shim does not select it.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)

# The whole suite on two pytest-xdist workers: one at a time, its tests keep 1.1 of 2 cores busy
# (processes waiting on a rendezvous, on imports, on a compiler's single thread). Each worker
# takes whole groups (tests/conftest.py: worker_group), the longest first (LONGEST_FIRST; xdist's
# own reordering, by the count of a group's tests, off). The fast tier runs on the same two
# workers: 40 to 45 s of pytest there against 75 s in one process.
WORKERS := -n 2 --no-loadscope-reorder

.PHONY: setup demo test test-fast test-stress test-latest gpu-program lint bench plot notebooks convergence gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --progress-bar off --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e ".[xla,jax,dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	test -d $(DEMO)/mock-imagenet || $(BIN)/accel-prepare --out $(DEMO)/mock-imagenet --classes 10 --per-class 40
	PJRT_DEVICE=CPU $(BIN)/launch_single_task --compare eager,xla,jax --model vit_micro \
		--data $(DEMO)/mock-imagenet --epochs 3 --batch_size 16 --mixup 0.8 --cutmix 1.0 \
		--workers 2 --output $(DEMO)/runs

test: setup
	PJRT_DEVICE=CPU JAX_PLATFORMS=cpu ACCEL_REQUIRE_XLA=1 ACCEL_REQUIRE_JAX=1 $(BIN)/pytest -q $(WORKERS) --durations=25 tests

# Every edit: the unit tests and in-process runs of each backend; no test that starts a process
# (tests/conftest.py marks those slow). Under a minute on a 2-core machine.
test-fast: setup
	PJRT_DEVICE=CPU JAX_PLATFORMS=cpu ACCEL_REQUIRE_XLA=1 ACCEL_REQUIRE_JAX=1 $(BIN)/pytest -q $(WORKERS) \
		--durations=10 -m "not slow and not gpu" tests

# Every multi-process test file, ROUNDS times in a row on make test's two workers, each failure
# reported with its output (tests/stress.py): the proof that the suite does not fail by chance.
# Not part of CI; ten rounds take about an hour and a half on a 2-core machine.
ROUNDS ?= 10
test-stress: setup
	$(BIN)/python -m tests.stress --rounds $(ROUNDS) --out .stress

# The program an H200 runs for a training step, compiled on this machine without a GPU, and
# its estimated time by kind of work beside compile's measured one (bench/gpu_program.py,
# bench/gpu_estimate.py), in a venv of its own with JAX's CUDA plugin (the gpu-program extra):
# .venv and the suite never load the plugin.
H200 := .venv-h200
$(H200)/.installed: pyproject.toml
	test -x $(H200)/bin/python || $(PYTHON) -m venv $(H200)
	$(H200)/bin/python -m pip install -q --progress-bar off --upgrade pip
	$(H200)/bin/python -m pip install --progress-bar off -e ".[jax,gpu-program]" \
		torch==2.9.0 torchvision==0.24.0
	touch $@

gpu-program: $(H200)/.installed
	$(H200)/bin/python bench/gpu_program.py --record h200-program

# The newest torch, torchvision and jax pip finds, on Python 3.12, without torch_xla (whose last
# release pairs only with torch 2.9): the suite with the xla tests skipped. Not part of CI.
# PIP_CONFIG_FILE=/dev/null: a machine-wide pip cap must not hold torch back here.
$(LATEST)/.installed: pyproject.toml
	test -x $(LATEST)/bin/python || $(PYTHON312) -m venv $(LATEST)
	PIP_CONFIG_FILE=/dev/null $(LATEST)/bin/python -m pip install -q --upgrade pip
	PIP_CONFIG_FILE=/dev/null $(LATEST)/bin/python -m pip install --upgrade --progress-bar off \
		-e ".[jax,dev]" torch torchvision jax
	touch $@

test-latest: $(LATEST)/.installed
	$(LATEST)/bin/python -c "import torch, torchvision, jax; print('torch', torch.__version__, \
		'torchvision', torchvision.__version__, 'jax', jax.__version__)"
	JAX_PLATFORMS=cpu ACCEL_REQUIRE_JAX=1 $(LATEST)/bin/pytest -q $(WORKERS) --durations=25 tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/compare_backends.py --models vit_micro,swin_micro \
		--backends eager,compile,jax --launches 2 --fed --tag cpu-micro-all-backends

# The CPU comparison of docs/benchmarks.md: the same jobs on each backend, twice each in turn
# (--repeats 2), reported by accel-report into bench/results/plots and into that page's report
# block (table, provenance, the spread of each speed-up).
plot: setup
	rm -rf $(DEMO)/plot-runs
	for model in vit_micro swin_micro; do \
		PJRT_DEVICE=CPU $(BIN)/launch_single_task --compare eager,compile,xla,jax --repeats 2 \
			--model $$model --steps 40 --batch_size 32 --workers 2 \
			--output $(DEMO)/plot-runs || exit 1; \
	done
	$(BIN)/accel-report $(DEMO)/plot-runs --out bench/results/plots --readme docs/benchmarks.md

# The walkthroughs: JupyterLab into .venv, and the notebooks executed in place (their outputs are
# committed, so they read without running). Open them with .venv/bin/jupyter lab notebooks/
notebooks: setup
	$(BIN)/python -m pip install -q -e ".[notebooks]"
	cd notebooks && PJRT_DEVICE=CPU JAX_PLATFORMS=cpu ../$(BIN)/jupyter nbconvert --to notebook \
		--execute --inplace 01_quickstart.ipynb 02_swin_accel_vs_eager.ipynb 03_xla_recompiles.ipynb
	@echo "open them with: $(BIN)/jupyter lab notebooks/"

convergence: setup
	PJRT_DEVICE=CPU $(BIN)/python bench/convergence.py

# The GPU check's smoke run on this machine's CPU; on a GPU machine: bench/gpu_check.py --stage ...
gpu-check: setup
	$(BIN)/python bench/gpu_check.py --smoke

clean:
	rm -rf $(VENV) $(LATEST) $(H200) $(DEMO) .stress runs
