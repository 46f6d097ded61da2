# Two entry points for a fresh machine: `make demo` and `make test` (both install first).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo lint test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first: a looser spec would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	# DISABLE_CUDA=1: hqq's setup.py would otherwise try to build its CUDA kernels (unused here)
	# with whatever `python` is first on PATH.
	DISABLE_CUDA=1 $(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Train a small Gemma4 (E2B's structure) on the built-in text (cached after the first run), export it
# 4-bit to MNN with --verify, and continue a sentence of the book with HF and with the export.
demo: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m llmexport.demo demo-out

# ruff (style, imports, unused and undefined names) over everything; mypy over the package.
lint: install
	$(BIN)/ruff check llmexport tests bench
	$(BIN)/python -m mypy

# Two pytest workers (pytest-xdist), a test file per worker at a time so that a file's fixtures (its
# checkpoints and shared exports) are built once. OMP_NUM_THREADS=1: torch's intra-op threads on
# tiny models are overhead, and two workers' spinning thread pools on two cores cost more CPU than
# the tests themselves (measured: four test files 244 s -> 166 s). pytest exits 5 when it collects
# nothing: that is a failure here.
PYTEST := HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

test: install lint
	$(PYTEST); code=$$?; \
		if [ $$code -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$code

test-fast: install
	$(PYTEST) -m "not slow"

bench: install
	$(BIN)/python bench/quant.py --quick

clean:
	rm -rf demo-out .pytest_cache
