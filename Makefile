# The README's commands. Each target creates ./.venv on first use and installs what it needs.
#
#   make demo   - the main job: a 2-rank CPU training run of the example script
#   make test   - install everything and run the whole test suite
#   make bench  - collective and training benchmarks (tables against gloo / baselines)
#   make lint   - ruff (lint and format check), mypy on the package, clang-format check of the C++
#   make format - ruff format and clang-format, in place
#   make test-cpp - the C++ tests of the smddp core (tests/cpp; g++ only, no torch)
#   make sanitize - the same under ASan+UBSan, then under TSan
#   make test-compat TORCH_SPEC=torch==2.11.0 - the fast tier and the compat subset on another torch
#   make gpu-check - on a GPU machine: build, GPU tests, GPU benchmark, report (scripts/gpu_check.py)
#   make fp8-curve - 200 steps of the example model, bf16 vs bf16 + FP8, plot in docs/ (docs/fp8.md)
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

.PHONY: install build demo test test-fast bench lint format clean test-cpp sanitize sanitize-asan gpu-check test-compat launchers \
	fp8-curve \
	sanitize-tsan

$(VENV)/.installed: setup.py pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" $(EXTRA_SPEC)
	$(PIP) install -q -r requirements-dev.txt
	# No build isolation: the extension must be compiled against the torch installed above.
	$(PIP) install -q --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

# Recompiles torch_sagemaker._C in place when csrc/ changed (ninja makes this a no-op otherwise).
#
# Then the checkout's Python is compiled to bytecode once. pip does that for what it installs,
# but this checkout is installed in editable mode, and where PYTHONDONTWRITEBYTECODE is set
# (as on these CI machines) Python never caches it itself: every process (each rank of each
# test, each torchrun worker) compiled the modules it imports again. Compiling them once made
# a sample of the distributed tests 5% faster (69 s against 73 s). Stale files are harmless:
# Python checks each one against its source's time stamp.
build: install
	$(PY) setup.py -q build_ext --inplace > $(VENV)/build.log 2>&1 || (cat $(VENV)/build.log; exit 1)
	$(PY) -m compileall -q -j 0 torch_sagemaker smdistributed _torch_sagemaker_alias.py \
		tests tools benchmarks examples > /dev/null

demo: build
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) examples/train.py \
		--smp-config examples/configs/full_shard.json

# The real launchers the launcher tests start (docs/launch.md): OpenMPI's mpirun, MPICH's
# mpiexec and SLURM (slurmctld, slurmd, srun). Installed with apt-get when absent and this runs
# as root on Debian/Ubuntu; otherwise the tests that need them skip, naming the package.
LAUNCHER_PACKAGES = openmpi-bin mpich slurm-wlm
launchers:
	@if command -v mpirun.openmpi >/dev/null && command -v mpiexec.hydra >/dev/null \
		&& command -v slurmd >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends $(LAUNCHER_PACKAGES) >/dev/null \
		|| { apt-get update -q >/dev/null && \
		     apt-get install -y -q --no-install-recommends $(LAUNCHER_PACKAGES) >/dev/null; } \
		|| echo "note: apt-get could not install $(LAUNCHER_PACKAGES); the launcher tests that need them skip"; \
	else \
		echo "note: $(LAUNCHER_PACKAGES) not installed (needs root and apt-get); the launcher tests that need them skip"; \
	fi

# --durations: the 25 slowest tests in every run (CI included), to keep the suite's time in view.
# Two xdist workers: the tests that start ranks in order on one, the single-process ones beside
# them (Note [Two workers, one of them for ranks] in tests/conftest.py). TEST_WORKERS=0 runs
# everything in one process.
TEST_WORKERS ?= 2
ifeq ($(TEST_WORKERS),0)
TEST_DIST :=
else
TEST_DIST := -n $(TEST_WORKERS)
endif
test: build launchers
	$(PY) -m pytest -q $(TEST_DIST) --durations=25 $(PYTEST_ARGS) tests

# The fast tier: no spawned ranks, no builds (tests/conftest.py marks tests by directory).
test-fast: build
	$(PY) -m pytest -q -m "not distributed and not slow" $(PYTEST_ARGS) tests

bench: build
	$(PY) -m benchmarks collectives --nprocs 2
	$(PY) -m benchmarks training --nprocs 2

# docs/fp8.md: two 200-step runs of examples/train.py (2 ranks, niced), their losses compared
# (fails beyond 2%) and plotted to docs/fp8_loss_200steps.png. About 10 minutes on 2 cores.
fp8-curve: build
	$(PY) scripts/fp8_loss_curve.py --steps 200 --nproc 2

CPP_SOURCES = $(shell find csrc tests/cpp -name '*.cpp' -o -name '*.h' | sort)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CPP_SOURCES)
	$(PY) -m mypy  # files and options: [tool.mypy] in pyproject.toml

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CPP_SOURCES)

clean:
	rm -rf build $(VENV) torch_sagemaker/_C*.so

# The C++ tests (tests/cpp) of the smddp core: everything in csrc/smddp but the torch glue
# (csrc/smddp/backend/), built with plain $(CXX), ranks run as threads. One build per variant
# under build/cpptest/<variant>/. CPPTEST_ARGS selects cases by name substring.
CPPTEST_DIR  ?= build/cpptest
CPPTEST_ARGS ?=
CPP_CORE      = $(shell find csrc/smddp -path csrc/smddp/backend -prune -o -name '*.cpp' -print | sort)
CPP_TESTS     = $(wildcard tests/cpp/*.cpp)
CPP_HEADERS   = $(shell find csrc/smddp tests/cpp -name '*.h')
CPPTEST_BASE  = -std=c++17 -Icsrc -pthread -Wall -Wextra -Wno-unused-parameter
# The plain build unoptimised: the test suite compiles it on every run (tests/unit/
# test_cpp_core.py), and -O0 takes 26% less compiler time than -O1 here (35 s against 47 s
# of CPU for the 31 files); the cases run in seconds either way. It is also built without
# debug information (-g cost 20% of its compiler time: 44 s of CPU against 35 s); add it for a
# debugger with CPPTEST_DEBUG=-g. The sanitizer builds keep -O1, which the sanitizers' docs
# recommend for usable speed, and -g, for the file and line of each report.
CPPTEST_DEBUG ?=
CPPTEST_FLAGS_plain = $(CPPTEST_BASE) -O0 $(CPPTEST_DEBUG)
CPPTEST_FLAGS_asan  = $(CPPTEST_BASE) -g -O1 -fsanitize=address,undefined \
                      -fno-sanitize-recover=undefined -fno-omit-frame-pointer
CPPTEST_FLAGS_tsan  = $(CPPTEST_BASE) -g -O1 -fsanitize=thread

# Note [Precompiled standard headers]: half of the compiler's time on a file here went to
# parsing the same standard library headers (a 13-line file took 0.7 s of CPU); each variant
# compiles tests/cpp/std_pch.h once, with its own flags, and every file is compiled with it
# force-included: 30% less CPU for the plain build. A precompiled header that does not match
# the flags is ignored (-Winvalid-pch says so) and the header parsed instead, so the build
# stays correct either way.
CPPTEST_PCH = tests/cpp/std_pch.h

define cpptest_variant
$(CPPTEST_DIR)/$(1)/pch/std_pch.h.gch: $(CPPTEST_PCH)
	@mkdir -p $$(dir $$@)
	cp $$< $$(dir $$@)std_pch.h
	$$(CXX) $$(CPPTEST_FLAGS_$(1)) -x c++-header $$(dir $$@)std_pch.h -o $$@
$(CPPTEST_DIR)/$(1)/%.o: %.cpp $(CPP_HEADERS) $(CPPTEST_DIR)/$(1)/pch/std_pch.h.gch
	@mkdir -p $$(dir $$@)
	$$(CXX) $$(CPPTEST_FLAGS_$(1)) -Winvalid-pch -include $(CPPTEST_DIR)/$(1)/pch/std_pch.h \
		-c $$< -o $$@
$(CPPTEST_DIR)/$(1)/smddp_tests: $(addprefix $(CPPTEST_DIR)/$(1)/,$(CPP_CORE:.cpp=.o) $(CPP_TESTS:.cpp=.o))
	$$(CXX) $$(CPPTEST_FLAGS_$(1)) $$^ -o $$@
endef
$(foreach v,plain asan tsan,$(eval $(call cpptest_variant,$(v))))

test-cpp: $(CPPTEST_DIR)/plain/smddp_tests
	$< $(CPPTEST_ARGS)

# Both runs must pass; one after the other (their output would interleave under -j).
# UBSan findings abort (-fno-sanitize-recover); LeakSanitizer is on. TSan checks the threads
# of one rank (listener, send lane, abort), the scheduler's lanes, waiters and receive poller
# (test_scheduler.cpp, test_receive_poller.cpp) and the process-global state; it cannot see the
# ranks' synchronisation through shared memory, which each rank maps at its own address.
sanitize:
	$(MAKE) --no-print-directory sanitize-asan
	$(MAKE) --no-print-directory sanitize-tsan

sanitize-asan: $(CPPTEST_DIR)/asan/smddp_tests
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $< $(CPPTEST_ARGS)

sanitize-tsan: $(CPPTEST_DIR)/tsan/smddp_tests
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $< $(CPPTEST_ARGS)

# The GPU check (scripts/gpu_check.py): builds the extension against the Python's own torch,
# runs tests/gpu, the GPU benchmark and the staging tests, and writes a report to $OUT (or
# outputs/gpu-check). On a GPU machine whose torch is installed system-wide it runs with
# python3; here, without CUDA, it rehearses with .venv and skips the CUDA steps.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)

gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py

# The torch-version matrix (docs/compatibility.md): `make test-compat TORCH_SPEC=torch==2.11.0`
# copies the checkout to build/compat/<spec>/src (one built extension per torch, the main
# checkout's stays), installs that torch (and EXTRA_SPEC, e.g. "transformers==5.17.0") in
# build/compat/<spec>/venv, and runs the fast tier plus the `compat` distributed subset. Each run
# copies the tracked and new files afresh and keeps the previous copy's objects (ninja).
COMPAT_NAME = $(subst =,,$(subst $() ,_,$(strip $(TORCH_SPEC) $(EXTRA_SPEC))))
COMPAT_DIR  = $(CURDIR)/build/compat/$(COMPAT_NAME)
EXTRA_SPEC ?=

test-compat:
	mkdir -p $(COMPAT_DIR)
	rm -rf $(COMPAT_DIR)/objects && (test ! -d $(COMPAT_DIR)/src/build || mv $(COMPAT_DIR)/src/build $(COMPAT_DIR)/objects)
	rm -rf $(COMPAT_DIR)/src && mkdir -p $(COMPAT_DIR)/src
	git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C $(COMPAT_DIR)/src
	test ! -d $(COMPAT_DIR)/objects || mv $(COMPAT_DIR)/objects $(COMPAT_DIR)/src/build
	$(MAKE) -C $(COMPAT_DIR)/src VENV=$(COMPAT_DIR)/venv TORCH_SPEC="$(TORCH_SPEC)" \
		EXTRA_SPEC="$(EXTRA_SPEC)" build
	cd $(COMPAT_DIR)/src && $(COMPAT_DIR)/venv/bin/python -m pytest -q -rs --durations=10 \
		-m "(not distributed and not slow) or compat" $(PYTEST_ARGS) tests
