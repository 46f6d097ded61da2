# Two entry points for a fresh machine: `make demo` and `make test` (both install first).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo lint arm-runtime test test-fast bench clean

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

# MNN's ARM kernels for tests/test_arm_runtime.py and --verify_arm (docs/verification.md#arm-kernels): on a
# non-ARM machine Debian/Ubuntu's qemu-user-static first (installed here when we are root with
# apt-get, else a one-line error), then the arm64 runtime: Debian's python3.11 and MNN's aarch64
# wheel, fetched once into ~/.cache/llmexport/arm64 (LLMEXPORT_ARM_CACHE moves it).
arm-runtime: install
	@case "$$(uname -m)" in aarch64|arm64) ;; *) \
	  if [ -z "$$LLMEXPORT_QEMU" ] && ! command -v qemu-aarch64-static >/dev/null; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      echo "installing Debian's qemu-user-static (qemu-aarch64-static)"; \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static >/dev/null || \
	      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static >/dev/null; }; \
	    else echo "make arm-runtime: qemu-aarch64-static is missing: install the qemu-user-static package" \
	      "(sudo apt-get install qemu-user-static)" >&2; exit 1; fi; \
	  fi;; esac
	$(BIN)/python -m llmexport.mnn.arm

test: install lint arm-runtime
	$(PYTEST); code=$$?; \
		if [ $$code -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$code

test-fast: install
	$(PYTEST) -m "not slow"

bench: install
	$(BIN)/python bench/quant.py --quick

clean:
	rm -rf demo-out .pytest_cache
