# Two commands: `make demo` and `make test`. Each sets up .venv at the repo root when missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := .demo

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --progress-bar off --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e ".[xla,jax,dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	test -d $(DEMO)/mock-imagenet || $(BIN)/accel-prepare --out $(DEMO)/mock-imagenet --classes 10 --per-class 40
	$(BIN)/launch_single_task --model vit_micro --data $(DEMO)/mock-imagenet --epochs 3 \
		--batch_size 16 --mixup 0.8 --cutmix 1.0 --output $(DEMO)/runs

test: setup
	PJRT_DEVICE=CPU JAX_PLATFORMS=cpu $(BIN)/pytest -q tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python bench/compare_backends.py --models vit_micro,swin_micro \
		--backends eager,compile,jax,jax+kernel_opt --tag cpu-micro-all-backends

clean:
	rm -rf $(VENV) $(DEMO) runs
