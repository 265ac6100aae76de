"""The project's own broker command, as the test fixtures and the broker tests run it."""

from __future__ import annotations

import sys

from combee_stream.config import BrokerConfig


def broker_command(action: str, broker: BrokerConfig) -> list[str]:
    """``combee-stream kafka ACTION`` for ``broker``'s ports and state dir."""
    return [
        sys.executable,
        "-m",
        "combee_stream",
        "--log-level",
        "warning",
        "kafka",
        action,
        "--port",
        str(broker.port),
        "--controller-port",
        str(broker.controller_port),
        "--state-dir",
        broker.state_dir,
    ]
