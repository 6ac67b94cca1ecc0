# The README's commands. Each target creates ./.venv on first use and installs what it needs.
#
#   make demo   - the main job: a 2-rank CPU training run of the example script
#   make test   - install everything and run the whole test suite
#   make bench  - collective and training benchmarks (tables against gloo / baselines)
#   make lint   - ruff (lint and format check) and mypy on the package
#
# torch is pinned to the CPU build available on these machines. Users with a CUDA build can
# override it, e.g. `make test TORCH_SPEC="torch==2.13.0"` against their own index; an
# unpinned `torch` pulls several GB of CUDA packages.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
NPROC      ?= 2
PY          = $(VENV)/bin/python
PIP         = $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: install build demo test test-fast bench lint clean

$(VENV)/.installed: setup.py pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -r requirements-dev.txt
	# No build isolation: the extension must be compiled against the torch installed above.
	$(PIP) install -q --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

# Recompiles torch_sagemaker._C in place when csrc/ changed (ninja makes this a no-op otherwise).
build: install
	$(PY) setup.py -q build_ext --inplace > $(VENV)/build.log 2>&1 || (cat $(VENV)/build.log; exit 1)

demo: build
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) examples/train.py \
		--smp-config examples/configs/full_shard.json

# --durations: the 25 slowest tests in every run (CI included), to keep the suite's time in view.
test: build
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS) tests

# The fast tier: no spawned ranks, no builds (tests/conftest.py marks tests by directory).
test-fast: build
	$(PY) -m pytest -q -m "not distributed and not slow" $(PYTEST_ARGS) tests

bench: build
	$(PY) -m torch_sagemaker.bench collectives --nprocs 2
	$(PY) -m torch_sagemaker.bench training --nprocs 2

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m mypy  # files and options: [tool.mypy] in pyproject.toml

clean:
	rm -rf build $(VENV) torch_sagemaker/_C*.so
