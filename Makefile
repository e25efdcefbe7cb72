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
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m lrmq.train --config configs/tiny_demo.yaml

# JAX_PLATFORMS=cpu: the test extra installs libtpu (for ahead-of-time TPU compiles), and without it jax
# would probe for a TPU at every start; the tests target TPUs through topologies, never the default backend.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/generate.py --quick

clean:
	rm -rf $(VENV) runs
