# Quick start: `make demo` and `make test`. Both create .venv, install torch first (so nothing
# pulls a second one), then zerokit with its native extensions built by its own setup.py.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.zerokit-installed
NATIVE := $(shell find src/zerokit/csrc -name '*.cpp' -o -name '*.h' 2>/dev/null)
DEMO_STEPS ?= 300

.PHONY: compat install demo test test-fast bench-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml setup.py $(NATIVE)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[test,plot]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 2 --no-python \
		$(BIN)/zerokit train --stage 2 --steps $(DEMO_STEPS) --layers 4 --width 192 --heads 6 \
		--memory-plot demo-memory.png

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=30 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

# The `bench` extra: deepspeed's setup imports torch, so it must build against the venv's torch.
bench-deps: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-build-isolation deepspeed py-cpuinfo hjson ninja

# The `deepspeed` compatibility distribution (compat/deepspeed/README.md): `import deepspeed` becomes
# zerokit. It replaces a real DeepSpeed, so it refuses an environment that has one (bench-deps
# installs DeepSpeed here for the comparison benchmarks): PY=/other/venv/bin/python to choose.
PY ?= $(BIN)/python
compat:
	@$(PY) -c 'import importlib.metadata as m, sys; v = next((d.version for d in m.distributions() if d.metadata["Name"] == "deepspeed"), None); sys.exit(f"make compat: {sys.executable} has DeepSpeed {v}; installing the compatibility distribution would replace it. Use PY=/other/venv/bin/python" if v and not v.endswith("+zerokit") else 0)'
	$(PY) -m pip install --quiet --no-deps ./compat/deepspeed

clean:
	rm -rf $(VENV) build src/*.egg-info
	find src -name '*.so' -delete
