# The README's two commands: `make demo` and `make test`. Each creates .venv/ when missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "Python 3.11 is required ($(PY) not found)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch pinned exactly and first: a looser spec would pull a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# JAX's CUDA plugin for compile-only GPU targets (lrmq/targets.py), of the installed jax's version, in a side
	# directory: in site-packages JAX would load it at every start, printing 'Could not find cuda drivers' lines
	# on a machine without a GPU even with JAX_PLATFORMS=cpu. Only a GPU compile puts it on the path.
	if [ "$$(uname -sm)" = "Linux x86_64" ]; then v=$$($(BIN)/python -c 'import jax; print(jax.__version__)'); \
	  $(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(VENV)/lrmq-gpu-aot \
	  jax-cuda12-pjrt==$$v jax-cuda12-plugin==$$v; fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m lrmq.train --config configs/tiny_demo.yaml

# JAX_PLATFORMS=cpu: the test extra installs libtpu (for ahead-of-time TPU compiles), and without it jax
# would probe for a TPU at every start; the tests target TPUs through topologies, never the default backend.
# Two worker processes (TEST_WORKERS=0 runs in one): most of the suite is XLA compiles and Python, each
# mostly single-threaded, so two processes use both cores of a 2-core machine. A file's tests stay in one
# worker (--dist loadfile): module fixtures are built once. The heaviest files go first (conftest orders them by
# tests/suite_costs.json; --no-loadscope-reorder stops xdist from reordering by test count), so that the last file
# to start is a short one and neither worker waits for the other at the end.
# One JAX compilation cache for the whole run, shared by the workers and the CLIs the tests start (the same tiny
# programs compile once), in a temporary directory made here and removed at the end: nothing is cached across
# runs, so a compile failure can never hide behind an earlier run's cache. The last line is the run's time
# (the budget: CONTRIBUTING.md).
TEST_WORKERS ?= 2
test: $(STAMP)
	@start=$$(date +%s); cache=$$(mktemp -d "$${TMPDIR:-/tmp}/lrmq-test-jax-cache.XXXXXX"); \
	LRMQ_COMPILE_CACHE=$$cache JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q --durations=15 \
	  $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests; rc=$$?; \
	rm -rf "$$cache"; echo "make test: $$(( $$(date +%s) - start )) s (budget 720 s on 2 quiet cores)"; exit $$rc

bench: $(STAMP)
	$(BIN)/python benchmarks/generate.py --quick

clean:
	rm -rf $(VENV) runs
