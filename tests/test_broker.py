"""``combee-stream kafka start|stop|status`` and the broker it runs: a real Kafka 4.x node."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from broker_support import broker_command

from combee_stream.config import BrokerConfig
from combee_stream.http import free_ports
from combee_stream.kafka.broker import (
    BrokerState,
    broker_running,
    broker_status,
    start_broker,
    stop_broker,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _cli(action: str, broker: BrokerConfig) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        broker_command(action, broker),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
        check=False,
    )


def test_ports_asked_for_together_are_distinct_and_free() -> None:
    # One at a time, the kernel may give the same port twice: a spare broker given one port
    # for both listeners failed to format its storage (CI, 2026-12-07).
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def _spare_broker(state_dir: Path) -> BrokerConfig:
    port, controller_port = free_ports(2)
    return BrokerConfig(port=port, controller_port=controller_port, state_dir=str(state_dir))


async def _produce(bootstrap: str, topic: str, key: bytes, value: bytes) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


async def _consume_one(bootstrap: str, topic: str, group: str) -> tuple[bytes, bytes, int]:
    """The first record of ``topic`` as (key, value, committed offset after committing it)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        with anyio.fail_after(60):
            record = await consumer.getone()
        await consumer.commit()
        committed = await consumer.committed(TopicPartition(topic, 0))
    finally:
        await consumer.stop()
    return record.key, record.value, committed


def test_status_reports_the_running_broker(
    kafka_bootstrap: str, kafka_broker: BrokerConfig
) -> None:
    done = _cli("status", kafka_broker)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"running {kafka_bootstrap} ")
    assert "Kafka 4." in done.stdout
    assert broker_running(kafka_broker)


def test_second_start_returns_the_same_broker(
    kafka_bootstrap: str, kafka_broker: BrokerConfig
) -> None:
    before = broker_status(kafka_broker).state
    done = _cli("start", kafka_broker)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == kafka_bootstrap
    after = broker_status(kafka_broker).state
    assert before is not None and after is not None
    assert after.pid == before.pid  # reused, not restarted


@pytest.mark.anyio
async def test_produce_consume_round_trip(kafka_bootstrap: str, unique: str) -> None:
    topic = f"t.broker.{unique}"
    await _produce(kafka_bootstrap, topic, b"k", b"hello kafka")
    key, value, committed = await _consume_one(kafka_bootstrap, topic, f"g.broker.{unique}")
    assert (key, value) == (b"k", b"hello kafka")
    assert committed == 1


def test_status_and_stop_without_a_broker(tmp_path: Path) -> None:
    broker = _spare_broker(tmp_path / "nothing-here")
    status = _cli("status", broker)
    assert status.returncode != 0
    assert status.stdout.startswith("stopped")
    assert _cli("stop", broker).returncode == 0


def test_stale_pid_file_is_ignored_and_cleared(tmp_path: Path) -> None:
    broker = _spare_broker(tmp_path)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    state_file = tmp_path / "broker.json"
    state_file.write_bytes(
        msgspec.json.encode(
            BrokerState(
                pid=int(gone.stdout),
                host="127.0.0.1",
                port=broker.port,
                controller_port=broker.controller_port,
                kafka_version=broker.kafka_version,
            )
        )
    )
    assert _cli("status", broker).returncode != 0
    assert _cli("stop", broker).returncode == 0
    assert not state_file.exists()


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_start_refuses_a_port_taken_by_something_else(tmp_path: Path, busy_port: int) -> None:
    broker = msgspec.structs.replace(_spare_broker(tmp_path), port=busy_port)
    done = _cli("start", broker)
    assert done.returncode != 0
    assert f"127.0.0.1:{busy_port} is already in use" in done.stderr
    assert not (tmp_path / "broker.json").exists()
    assert not list(tmp_path.glob("lib-*"))  # refused before fetching or starting anything


def test_data_survives_a_restart(
    tmp_path: Path, unique: str, kafka_bootstrap: str, kafka_broker: BrokerConfig
) -> None:
    # A second, private broker: restarting the shared session broker would disturb other tests.
    broker = _spare_broker(tmp_path)
    # Hard-link the session broker's jars (kafka_bootstrap started it, so they exist):
    # this test is about the data dir, not Maven.
    lib = f"lib-{broker.kafka_version}"
    shutil.copytree(Path(kafka_broker.state_dir) / lib, tmp_path / lib, copy_function=os.link)
    topic, group = f"t.restart.{unique}", f"g.restart.{unique}"
    try:
        bootstrap = start_broker(broker)
        assert bootstrap == f"127.0.0.1:{broker.port}"
        anyio.run(_produce, bootstrap, topic, b"k", b"kept")
        cluster = (tmp_path / "data" / "meta.properties").read_text()

        stop_broker(broker)
        assert broker_status(broker).status == "stopped"
        assert _cli("status", broker).returncode != 0

        assert start_broker(broker) == bootstrap
        key, value, _ = anyio.run(_consume_one, bootstrap, topic, group)
        assert (key, value) == (b"k", b"kept")
        assert (tmp_path / "data" / "meta.properties").read_text() == cluster  # not reformatted
    finally:
        stop_broker(broker)
    assert not broker_running(broker)
