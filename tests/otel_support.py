"""A real OpenTelemetry Collector for the tests: OTLP receiver, batch processor, Kafka exporter.

The collector is the small Go program in ``tests/otelcol`` (core v0.165.0, contrib v0.165.1,
pinned by its go.sum), built from the Go module proxy into the user-level build cache
(combee_stream.buildcache, shared by every clone of the machine; ``make otelcol-prepare``) and
rebuilt only when its stamp changes (a hash of go.mod, go.sum, main.go and the build flags):

    otelcol/KEY/otelcol-combee   the static binary (and .stamp)
    otelcol/gopath/              GOPATH and module cache (kept, so a rebuild downloads nothing)
    otelcol/gocache/             Go's build cache (kept, so a rebuild compiles only what changed)

A first build on 2 cores takes a few minutes (downloads and compiles the whole collector); a
cache hit takes well under a second. ``run_collector`` starts the binary against a Kafka broker
on free local ports; the ``otelcol_binary`` fixture hands the tests a built binary (waiting for
a build in progress, building it when Go is there; skipped without Go, failed when CI=true).

CLI: ``python tests/otel_support.py build``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import pytest
from ci_support import in_ci

from combee_stream.buildcache import cache_root, cached, cached_build
from combee_stream.http import free_ports

REPO: Final = Path(__file__).resolve().parent.parent
SOURCE: Final = REPO / "tests" / "otelcol"
CACHE_NAME: Final = "otelcol"
BINARY_NAME: Final = "otelcol-combee"
SOURCE_FILES: Final = ("go.mod", "go.sum", "main.go")
# Static, reproducible, no VCS stamping (the sources sit in this repo's work tree), stripped.
BUILD_FLAGS: Final = ("-trimpath", "-buildvcs=false", "-ldflags=-s -w")
READY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 15.0

Encoding = Literal["otlp_proto", "otlp_json"]
# How the exporter maps a record key to a partition: "sarama_compat" (its default, FNV-1a, as
# the Sarama client did) or "murmur2" (the Java client's and aiokafka's default partitioner).
Hasher = Literal["sarama_compat", "murmur2"]
Say = Callable[[str], None]


class CollectorError(RuntimeError):
    """The collector could not be built or did not start; the message has Go's or its log."""


def source_stamp() -> str:
    """What a build is made of: the Go sources' hash and the build flags."""
    digest = hashlib.sha256()
    for name in SOURCE_FILES:
        digest.update(name.encode() + b"\0" + (SOURCE / name).read_bytes() + b"\0")
    return f"sha256:{digest.hexdigest()}\n{' '.join(BUILD_FLAGS)}\n"


def collector_binary() -> Path | None:
    """The cached build of the current sources, or None."""
    return cached(CACHE_NAME, source_stamp(), BINARY_NAME)


def is_built() -> bool:
    return collector_binary() is not None


def _go_env() -> dict[str, str]:
    cache = cache_root() / CACHE_NAME
    gopath = cache / "gopath"
    return {
        **os.environ,
        "GOPATH": str(gopath),
        "GOMODCACHE": str(gopath / "pkg" / "mod"),
        "GOCACHE": str(cache / "gocache"),
        # -modcacherw: the module cache stays deletable (rm -rf of the build cache).
        "GOFLAGS": "-mod=readonly -modcacherw",
        "GOTOOLCHAIN": "local",  # never fetch another Go toolchain: use the one on PATH
        "CGO_ENABLED": "0",
    }


def build_collector(say: Say = print) -> Path:
    """The built collector binary (idempotent: rebuilt only when ``tests/otelcol``'s sources
    or the build flags change; a build running elsewhere is waited for). Raises
    CollectorError."""
    found = collector_binary()
    if found is not None:
        return found
    go = shutil.which("go")
    if go is None:
        raise CollectorError("building the OpenTelemetry Collector needs Go (`go` on PATH)")
    return cached_build(
        CACHE_NAME, source_stamp(), BINARY_NAME, lambda into: _build(go, into / BINARY_NAME, say)
    )


def _build(go: str, binary: Path, say: Say) -> None:
    env = _go_env()
    started = time.monotonic()
    say(f"building the OpenTelemetry Collector from {SOURCE.relative_to(REPO)} (a few min, once)")
    say("  resolving its Go packages (downloads modules from the Go module proxy once)")
    listed = _go([go, "list", "-deps", "."], env, "go list")
    total = max(1, len(listed.splitlines()))
    command = [go, "build", "-v", *BUILD_FLAGS, "-o", str(binary), "."]
    tail: list[str] = []
    built = 0
    shown = -1
    with subprocess.Popen(
        command, cwd=SOURCE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            tail = [*tail[-40:], line.rstrip()]
            if not line.startswith(("go: ", "#")):
                built += 1  # -v names each package as it is compiled
                percent = min(99, 100 * built // total)
                if percent >= shown + 10:
                    shown = percent
                    say(f"  otelcol build {percent}% ({built}/{total} packages)")
    if process.returncode != 0:
        raise CollectorError(
            f"building the collector failed (exit {process.returncode}):\n" + "\n".join(tail)
        )
    size_mb = binary.stat().st_size / 1e6
    say(f"collector ready ({size_mb:.0f} MB, {time.monotonic() - started:.0f} s)")


def _go(command: list[str], env: dict[str, str], what: str) -> str:
    done = subprocess.run(command, cwd=SOURCE, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        raise CollectorError(f"{what} failed (exit {done.returncode}):\n{output[-3000:]}")
    return done.stdout


def collector_config(
    bootstrap: str,
    *,
    http_port: int,
    grpc_port: int,
    encoding: Encoding,
    partition_traces_by_id: bool,
    traces_topic: str,
    logs_topic: str = "otlp_logs",
    hasher: Hasher = "sarama_compat",
) -> dict[str, Any]:
    """The collector's configuration (written as JSON, which is YAML): OTLP in on 127.0.0.1,
    a 200 ms batch, traces and logs out to ``bootstrap``'s topics."""
    return {
        "receivers": {
            "otlp": {
                "protocols": {
                    "http": {"endpoint": f"127.0.0.1:{http_port}"},
                    "grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
                }
            }
        },
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {
            "kafka": {
                "brokers": [b.strip() for b in bootstrap.split(",") if b.strip()],
                "traces": {"topic": traces_topic, "encoding": encoding},
                "logs": {"topic": logs_topic, "encoding": encoding},
                # At the exporter's top level in v0.165, not under traces:.
                "partition_traces_by_id": partition_traces_by_id,
                "record_partitioner": {"sticky_key": {"hasher": hasher}},
            }
        },
        "service": {
            "pipelines": {
                "traces": {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["kafka"]},
                "logs": {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["kafka"]},
            },
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
        },
    }


@dataclass(frozen=True)
class RunningCollector:
    http_endpoint: str  # "http://127.0.0.1:PORT"; traces go to f"{http_endpoint}/v1/traces"
    grpc_endpoint: str  # "127.0.0.1:PORT"
    config_path: Path
    log_path: Path
    pid: int

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def run_collector(
    bootstrap: str,
    *,
    encoding: Encoding,
    partition_traces_by_id: bool,
    traces_topic: str,
    logs_topic: str = "otlp_logs",
    hasher: Hasher = "sarama_compat",
    binary: Path | None = None,
) -> Iterator[RunningCollector]:
    """Run the collector against ``bootstrap`` until the block ends (SIGTERM, then kill).

    ``binary`` defaults to the cached build (which must exist). Raises
    CollectorError when it exits or does not listen within READY_TIMEOUT_S; an error raised
    in the block gets the collector's log attached as a note."""
    binary = binary or collector_binary()
    if binary is None:
        raise CollectorError("no current collector build in the build cache: make otelcol-prepare")
    http_port, grpc_port = free_ports(2)
    with tempfile.TemporaryDirectory(prefix="otelcol-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        config = collector_config(
            bootstrap,
            http_port=http_port,
            grpc_port=grpc_port,
            encoding=encoding,
            partition_traces_by_id=partition_traces_by_id,
            traces_topic=traces_topic,
            logs_topic=logs_topic,
            hasher=hasher,
        )
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        log_path = Path(tmp) / "otelcol.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [str(binary), "--config", f"file:{config_path}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        running = RunningCollector(
            http_endpoint=f"http://127.0.0.1:{http_port}",
            grpc_endpoint=f"127.0.0.1:{grpc_port}",
            config_path=config_path,
            log_path=log_path,
            pid=process.pid,
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not _accepts(http_port):
                if process.poll() is not None:
                    raise CollectorError(
                        f"the collector exited ({process.returncode}) before listening:\n"
                        + running.log_tail()
                    )
                if time.monotonic() > deadline:
                    raise CollectorError(
                        f"the collector did not listen on {http_port} within "
                        f"{READY_TIMEOUT_S:.0f} s:\n" + running.log_tail()
                    )
                time.sleep(0.05)
            try:
                yield running
            except BaseException as exc:
                exc.add_note(f"collector log:\n{running.log_tail() or '(empty)'}")
                raise
        finally:
            _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def otelcol_binary() -> Path:
    """The built collector (waited for while ``make otelcol-prepare`` builds it, built here
    when missing and Go is there). Without Go it skips the test locally and fails it when
    CI=true."""
    try:
        return build_collector(say=lambda line: print(line, file=sys.stderr))
    except CollectorError as exc:
        if shutil.which("go") is not None or in_ci():
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(f"no collector build in the build cache: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel_support", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build the test collector once (a no-op if built)")
    parser.parse_args(argv)
    try:
        binary = build_collector()
    except CollectorError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
