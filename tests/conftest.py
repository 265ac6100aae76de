"""Shared fixtures: the real local Kafka broker, a Config pointed at it, unique names.

The broker is the project's own (``combee-stream kafka start``) on the test ports
(COMBEE_TEST_KAFKA_PORT, default 19092; controller COMBEE_TEST_KAFKA_CONTROLLER_PORT, default
port + 1) with its state in .state/kafka-test. If it already runs (``make test`` starts it),
it is reused and left running; otherwise this session starts it and stops it at the end.
A broker that cannot start skips the Kafka tests locally and fails them loudly when CI=true.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from broker_support import broker_command
from ci_support import in_ci

from combee_stream.config import BrokerConfig, Config, load_config
from combee_stream.kafka.broker import broker_status

REPO = Path(__file__).resolve().parent.parent
# Room for the first start's Maven download on top of the broker's own ready timeout.
_START_SLACK_S = 600.0


def _test_broker() -> BrokerConfig:
    port = int(os.environ.get("COMBEE_TEST_KAFKA_PORT", "19092"))
    controller = int(os.environ.get("COMBEE_TEST_KAFKA_CONTROLLER_PORT", str(port + 1)))
    return BrokerConfig(
        port=port, controller_port=controller, state_dir=str(REPO / ".state" / "kafka-test")
    )


@pytest.fixture(scope="session")
def kafka_broker() -> BrokerConfig:
    """Where the test broker lives (ports, state dir), e.g. for ``kafka status`` or restarts."""
    return _test_broker()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker: BrokerConfig) -> Iterator[str]:
    """``"127.0.0.1:PORT"`` of a running, warmed-up broker for the whole session."""
    found = broker_status(kafka_broker)
    if found.status == "running" and found.state is not None:
        yield found.state.bootstrap
        return
    started = subprocess.run(
        broker_command("start", kafka_broker),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=kafka_broker.ready_timeout_s + _START_SLACK_S,
        check=False,
    )
    if started.returncode != 0:
        reason = (
            f"the local Kafka broker did not start (exit {started.returncode}):\n"
            f"{started.stderr.strip()}"
        )
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    try:
        yield started.stdout.strip()
    finally:
        subprocess.run(broker_command("stop", kafka_broker), cwd=REPO, check=False, timeout=60)


@pytest.fixture
def config(kafka_bootstrap: str, kafka_broker: BrokerConfig) -> Config:
    """The default Config, pointed at the test broker (and nothing from the caller's env)."""
    return load_config(
        None,
        env={
            "COMBEE__KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
            "COMBEE__BROKER__PORT": str(kafka_broker.port),
            "COMBEE__BROKER__CONTROLLER_PORT": str(kafka_broker.controller_port),
            "COMBEE__BROKER__STATE_DIR": f"'{kafka_broker.state_dir}'",  # TOML literal string
        },
    )


# The third-party task sets beside the clone (../shared/datasets), or where COMBEE_DATASETS says.
DATASETS = Path(
    os.environ.get("COMBEE_DATASETS") or Path(__file__).resolve().parents[2] / "shared" / "datasets"
)


@pytest.fixture
def datasets() -> Path:
    """The shared datasets: skipped on a laptop without them, a failure under CI=true."""
    if not DATASETS.is_dir():
        reason = f"the shared datasets are not at {DATASETS} (set COMBEE_DATASETS)"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return DATASETS


@pytest.fixture
def unique() -> str:
    """A short random suffix for topic and group names, so tests never share state."""
    return uuid.uuid4().hex[:8]


# Fixtures that hand out a source build (otel_support.otelcol_binary, test_real_model's
# llama_url, test_local_embeddings' minilm_dir, which `make llm-prepare` fetches): their tests
# are marked ``build`` and sorted last. `make test` (tests/timed_run.py) runs every other test
# while it builds them in the background, the real-model ones beside those as soon as
# llama-server is built, and the Collector's after them.
BUILD_FIXTURES = frozenset({"otelcol_binary", "llama_build", "llama_url", "minilm_dir"})


def _order(item: pytest.Item) -> int:
    """Tests that restart the shared broker first: a restart takes longer the more partitions
    the broker holds, and every test adds some (measured: 13 s early in a session, 39 s after
    a hundred tests). Tests that need a build last. The rest in file order (the sort is
    stable)."""
    if item.get_closest_marker("restarts_broker"):
        return 0
    return 2 if item.get_closest_marker("build") else 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "kafka_bootstrap" in fixtures:
            item.add_marker(pytest.mark.kafka)
        if BUILD_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.build)
    items.sort(key=_order)


@pytest.fixture(autouse=True)
def _isolated_logging() -> Iterator[None]:
    """Tests that run the CLI in process configure logging globally; undo it after each test."""
    yield
    structlog.reset_defaults()
