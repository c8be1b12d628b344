# Two commands: `make demo` and `make test`. Each sets up .venv at the repo root when missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := .demo

.PHONY: setup demo test lint bench plot clean

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
	PJRT_DEVICE=CPU JAX_PLATFORMS=cpu $(BIN)/pytest -q tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python bench/compare_backends.py --models vit_micro,swin_micro \
		--backends eager,compile,jax --launches 2 --fed --tag cpu-micro-all-backends

# The README's comparison plot: the same job on each backend, parsed by accel-report.
plot: setup
	rm -rf $(DEMO)/plot-runs
	for model in vit_micro swin_micro; do \
		PJRT_DEVICE=CPU $(BIN)/launch_single_task --compare eager,xla,jax --model $$model \
			--steps 40 --batch_size 32 --workers 2 --output $(DEMO)/plot-runs || exit 1; \
	done
	$(BIN)/accel-report $(DEMO)/plot-runs --out bench/results/plots

clean:
	rm -rf $(VENV) $(DEMO) runs
