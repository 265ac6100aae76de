"""The local development Kafka broker: ``combee-stream kafka start|stop|status``.

A real Apache Kafka (KRaft, one combined broker+controller node on loopback) assembled from
Maven Central jars, so development and tests need neither Docker nor a tarball. Layout of
``broker.state_dir``:

    lib-<version>/      the classpath, copied by Maven once (``.complete`` marks it usable),
                        and kafka.jsa, the class-data-sharing archive of the first clean run
    data/               log.dirs, formatted once and reused, so topics survive a restart
    server.properties   regenerated on every start from assets/server.properties.template
    kafka.log           the broker's stdout and stderr (the previous run's in kafka.log.1)
    broker.json         pid and ports of the running broker
    .lock               serialises start and stop on one state dir

The broker runs detached (own session, not a child of the caller), so it outlives the command
that started it and behaves the same whether started from the CLI or from the Python API.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Literal

import anyio
import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from combee_stream.config import BrokerConfig, Config
from combee_stream.errors import UserError
from combee_stream.logs import get_logger

log = get_logger(__name__)

_ASSETS = resources.files("combee_stream.kafka") / "assets"
_MAIN_CLASS = "kafka.Kafka"
_STORAGE_TOOL = "kafka.tools.StorageTool"
_COMPLETE_MARKER = ".complete"
_STOP_GRACE_S = 20.0
_KILL_WAIT_S = 5.0
_LOG_TAIL_LINES = 40
_WARMUP_ID = "combee-broker-warmup"

# Starts the broker as a grandchild: the launcher exits at once, so the broker is reparented
# and never becomes a zombie (or a ResourceWarning) of whoever called start_broker().
_LAUNCHER = """\
import os, subprocess, sys
with open(sys.argv[1], "ab") as out:
    proc = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
print(proc.pid, flush=True)
os._exit(0)
"""


class BrokerError(UserError):
    """The broker could not be started or stopped; ``log_tail`` is the end of kafka.log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class BrokerState(msgspec.Struct, frozen=True):
    """Contents of broker.json: what ``status`` and ``stop`` need to find the process."""

    pid: int
    host: str
    port: int
    controller_port: int
    kafka_version: str

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


class BrokerStatus(msgspec.Struct, frozen=True):
    """``running``: the client port accepts; ``starting``: process up, port not yet open."""

    status: Literal["running", "starting", "stopped"]
    state: BrokerState | None = None


class BrokerPaths(msgspec.Struct, frozen=True):
    state_dir: Path
    lib_dir: Path
    data_dir: Path
    pom: Path
    server_properties: Path
    log4j_properties: Path
    log_file: Path
    state_file: Path
    lock_file: Path

    @classmethod
    def of(cls, cfg: BrokerConfig) -> BrokerPaths:
        root = Path(cfg.state_dir).expanduser().resolve()
        return cls(
            state_dir=root,
            lib_dir=root / f"lib-{cfg.kafka_version}",
            data_dir=root / "data",
            pom=root / "pom.xml",
            server_properties=root / "server.properties",
            log4j_properties=root / "log4j2.properties",
            log_file=root / "kafka.log",
            state_file=root / "broker.json",
            lock_file=root / ".lock",
        )


# --- public API -----------------------------------------------------------------------------


def start_broker(cfg: BrokerConfig) -> str:
    """Start the broker (or find it already running) and return ``"host:port"`` once it serves.

    Synchronous (it runs its own event loop for the readiness check): call it from sync code.
    Raises BrokerError, with the log tail, when the broker does not become ready in time.
    """
    paths = BrokerPaths.of(cfg)
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    with _locked(paths):
        current = _read_state(paths)
        if current is not None and _is_our_broker(current.pid, paths):
            if (current.host, current.port) != (cfg.host, cfg.port):
                raise BrokerError(
                    f"the broker of {paths.state_dir} is already running on {current.bootstrap};"
                    " stop it first or use that address"
                )
            anyio.run(_bring_up, current, paths, cfg.ready_timeout_s, False)
            return current.bootstrap
        _clear_state(paths)
        for port in (cfg.port, cfg.controller_port):
            if not _port_free(cfg.host, port):
                raise BrokerError(
                    f"{cfg.host}:{port} is already in use by another process"
                    f" (not the broker of {paths.state_dir}); pick other ports with"
                    " --port/--controller-port"
                )
        began = time.monotonic()
        java = _java()
        lib = ensure_jars(cfg)
        _write_configs(cfg, paths)
        _format_storage(cfg, paths, java, lib)
        state = _spawn(cfg, paths, java, lib)
        try:
            anyio.run(_bring_up, state, paths, cfg.ready_timeout_s, True)
        except BaseException:
            _terminate(state.pid, paths)
            _clear_state(paths)
            raise
        log.info("kafka.started", bootstrap=state.bootstrap, seconds=_since(began))
        return state.bootstrap


def stop_broker(cfg: BrokerConfig) -> None:
    """Stop the broker of ``cfg.state_dir``: SIGTERM, then SIGKILL after a grace period.

    A no-op when nothing runs there. Data stays in ``data/`` for the next start.
    """
    paths = BrokerPaths.of(cfg)
    if not paths.state_dir.exists():
        return
    with _locked(paths):
        state = _read_state(paths)
        if state is not None and _is_our_broker(state.pid, paths):
            _terminate(state.pid, paths)
        _clear_state(paths)


def broker_status(cfg: BrokerConfig) -> BrokerStatus:
    """Whether the broker of ``cfg.state_dir`` runs, and where (read-only, no lock)."""
    paths = BrokerPaths.of(cfg)
    state = _read_state(paths)
    if state is None or not _is_our_broker(state.pid, paths):
        return BrokerStatus(status="stopped")
    if _accepts(state.host, state.port):
        return BrokerStatus(status="running", state=state)
    return BrokerStatus(status="starting", state=state)


def broker_running(cfg: BrokerConfig) -> bool:
    return broker_status(cfg).status == "running"


def ensure_jars(cfg: BrokerConfig) -> Path:
    """The broker classpath dir for ``cfg.kafka_version``; runs Maven only the first time."""
    paths = BrokerPaths.of(cfg)
    lib = paths.lib_dir
    if (lib / _COMPLETE_MARKER).exists():
        return lib
    if not cfg.kafka_version.startswith("4."):
        # 3.x needs reload4j instead of the Log4j2 binding and -Dlog4j.configuration.
        raise BrokerError(
            f"broker.kafka_version {cfg.kafka_version!r}: assets/pom.xml is for Kafka 4.x only"
        )
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            "Maven (mvn) is not on PATH; it fetches the Kafka jars once (apt-get install maven)"
        )
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    # A copy in the state dir: the package may be installed read-only, and Maven may write
    # next to its pom.
    paths.pom.write_text((_ASSETS / "pom.xml").read_text())
    partial = lib.with_name(lib.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(lib, ignore_errors=True)
    log.info("kafka.jars.fetch", version=cfg.kafka_version, into=str(lib))
    began = time.monotonic()
    done = subprocess.run(
        [
            mvn,
            "-B",
            "-q",
            "-f",
            str(paths.pom),
            "dependency:copy-dependencies",
            f"-Dkafka.version={cfg.kafka_version}",
            f"-DoutputDirectory={partial}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    broker_jar = partial / f"kafka_2.13-{cfg.kafka_version}.jar"
    if done.returncode != 0 or not broker_jar.exists():
        # Debian's Maven 3.8 colours its output even in batch mode
        plain = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
        output = _last_lines(plain, _LOG_TAIL_LINES)
        raise BrokerError(
            f"Maven could not assemble Kafka {cfg.kafka_version} (exit {done.returncode})",
            output,
        )
    (partial / _COMPLETE_MARKER).write_text(cfg.kafka_version + "\n")
    partial.rename(lib)
    log.info("kafka.jars.ready", version=cfg.kafka_version, seconds=_since(began))
    return lib


def new_cluster_id() -> str:
    """A KRaft cluster id: a random UUID as 22 base64url characters, like Kafka's Uuid."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        # Kafka's Uuid.randomUuid() avoids a leading '-', which command lines take for a flag.
        if not text.startswith("-"):
            return text


def jvm_flags(cfg: BrokerConfig) -> list[str]:
    """Modest flags for a shared 2-core machine (Kafka's own scripts use the same G1 set)."""
    return [
        f"-Xms{cfg.heap}",
        f"-Xmx{cfg.heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:InitiatingHeapOccupancyPercent=35",
        "-XX:+ExplicitGCInvokesConcurrent",
        "-XX:+ExitOnOutOfMemoryError",
        # C1 only: measured 1-3 s faster to ready on 2 busy cores, and no C2 compiler threads
        # competing with the tests; peak throughput does not matter for a dev/test broker.
        "-XX:TieredStopAtLevel=1",
        "-Djava.awt.headless=true",
    ]


def _class_data_sharing_flags(lib: Path) -> list[str]:
    """AppCDS: the first broker dumps its loaded classes when it exits cleanly, later starts
    map them (measured: warm start 2.7 s -> 1.5 s). A stale or broken archive only costs the
    speed-up: the JVM (-Xshare:auto) warns in kafka.log and loads classes normally."""
    archive = lib / "kafka.jsa"
    if archive.exists():
        return [f"-XX:SharedArchiveFile={archive}"]
    return [f"-XX:ArchiveClassesAtExit={archive}"]


def log_tail(cfg: BrokerConfig, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the broker's log (empty when there is none)."""
    return _tail_file(BrokerPaths.of(cfg).log_file, lines)


# --- start steps ----------------------------------------------------------------------------


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise BrokerError("java is not on PATH; Kafka 4.x needs a Java 17+ runtime")
    return found


def _write_configs(cfg: BrokerConfig, paths: BrokerPaths) -> None:
    template = string.Template((_ASSETS / "server.properties.template").read_text())
    paths.server_properties.write_text(
        template.substitute(
            host=cfg.host,
            port=cfg.port,
            controller_port=cfg.controller_port,
            data_dir=paths.data_dir,
        )
    )
    paths.log4j_properties.write_text((_ASSETS / "log4j2.properties").read_text())


def _format_storage(cfg: BrokerConfig, paths: BrokerPaths, java: str, lib: Path) -> None:
    if (paths.data_dir / "meta.properties").exists():
        return  # formatted before: reuse it, so topics and offsets survive a restart
    shutil.rmtree(paths.data_dir, ignore_errors=True)  # a half-formatted dir would be refused
    cluster_id = new_cluster_id()
    log.info("kafka.format", data_dir=str(paths.data_dir), cluster_id=cluster_id)
    done = subprocess.run(
        [
            java,
            "-Xmx256m",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j2.configurationFile={paths.log4j_properties}",
            "-cp",
            f"{lib}/*",
            _STORAGE_TOOL,
            "format",
            "-t",
            cluster_id,
            "-c",
            str(paths.server_properties),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        output = _last_lines(done.stdout + done.stderr, _LOG_TAIL_LINES)
        raise BrokerError(f"formatting {paths.data_dir} failed (exit {done.returncode})", output)


def _spawn(cfg: BrokerConfig, paths: BrokerPaths, java: str, lib: Path) -> BrokerState:
    if paths.log_file.exists():
        paths.log_file.replace(paths.log_file.with_name(paths.log_file.name + ".1"))
    command = [
        java,
        *jvm_flags(cfg),
        *_class_data_sharing_flags(lib),
        f"-Dlog4j2.configurationFile={paths.log4j_properties}",
        "-cp",
        f"{lib}/*",
        _MAIN_CLASS,
        str(paths.server_properties),
    ]
    launched = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(paths.log_file), *command],
        capture_output=True,
        text=True,
        check=False,
        cwd=paths.state_dir,
    )
    if launched.returncode != 0:
        raise BrokerError(f"could not launch java: {launched.stderr.strip()}")
    state = BrokerState(
        pid=int(launched.stdout.strip()),
        host=cfg.host,
        port=cfg.port,
        controller_port=cfg.controller_port,
        kafka_version=cfg.kafka_version,
    )
    paths.state_file.write_bytes(msgspec.json.encode(state))
    log.info("kafka.spawned", pid=state.pid, bootstrap=state.bootstrap)
    return state


async def _bring_up(state: BrokerState, paths: BrokerPaths, limit_s: float, warm: bool) -> None:
    """Wait for readiness (and warm up) within one deadline; BrokerError with the log tail."""
    began = time.monotonic()
    try:
        with anyio.fail_after(limit_s):
            await _await_ready(state, paths)
            log.info("kafka.ready", bootstrap=state.bootstrap, seconds=_since(began))
            if warm:
                await _warm_up(state.bootstrap)
    except TimeoutError:
        raise BrokerError(
            f"Kafka on {state.bootstrap} was not ready (port, metadata, group and transaction"
            f" coordinators) within {limit_s:g} s (log: {paths.log_file})",
            _tail_file(paths.log_file, _LOG_TAIL_LINES),
        ) from None


_DEAD_AFTER_LOOKS = 3


async def _await_ready(state: BrokerState, paths: BrokerPaths) -> None:
    """Ready = the client port accepts (Kafka opens it only once the broker is unfenced)
    AND a metadata round trip through aiokafka lists this broker."""

    misses = 0

    def check_alive() -> None:
        # Three looks in a row, one poll apart: a single failed look at /proc is not proof. A
        # CI run (2026-12-04, a Go build loading both cores) declared a just-spawned broker
        # dead and stopped it before it wrote a line of its log: nothing said the JVM failed.
        nonlocal misses
        misses = 0 if _is_our_broker(state.pid, paths) else misses + 1
        if misses >= _DEAD_AFTER_LOOKS:
            raise BrokerError(
                f"Kafka exited during startup (log: {paths.log_file})",
                _tail_file(paths.log_file, _LOG_TAIL_LINES),
            )

    while True:
        check_alive()
        if _accepts(state.host, state.port):
            break
        await anyio.sleep(0.2)
    while True:
        check_alive()
        if await _round_trip(state.bootstrap):
            return
        await anyio.sleep(0.5)


async def _round_trip(bootstrap: str) -> bool:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, client_id="combee-broker-check", request_timeout_ms=5000
    )
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
        return bool(cluster.get("brokers"))
    except (KafkaError, OSError):
        return False
    finally:
        with anyio.CancelScope(shield=True):
            await admin.close()


async def _warm_up(bootstrap: str) -> None:
    """Create __consumer_offsets and __transaction_state now rather than in the first test."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(_warm_group_coordinator, bootstrap)
        tg.start_soon(_warm_transaction_coordinator, bootstrap)


async def _warm_group_coordinator(bootstrap: str) -> None:
    # FindCoordinator makes the broker create __consumer_offsets; poll quietly until a group
    # lookup answers without error (not found / loading are retried), i.e. the coordinator
    # has loaded the partition. A consumer would do the same but log each retry as an error.
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id=_WARMUP_ID)
    try:
        await admin.start()
        while True:
            try:
                responses = await admin.describe_consumer_groups([_WARMUP_ID])
            except KafkaError:
                responses = []
            if responses and all(
                error_code == 0 for response in responses for error_code, *_ in response.groups
            ):
                return
            await anyio.sleep(0.1)
    finally:
        with anyio.CancelScope(shield=True):
            await admin.close()


async def _warm_transaction_coordinator(bootstrap: str) -> None:
    # A transactional producer's start() runs InitProducerId, which creates __transaction_state.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=_WARMUP_ID)
    await producer.start()
    with anyio.CancelScope(shield=True):
        await producer.stop()


# --- processes, ports, files ----------------------------------------------------------------


def _is_our_broker(pid: int, paths: BrokerPaths) -> bool:
    """``pid`` is alive (not a zombie) and is kafka.Kafka with this state dir's config."""
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self").exists():  # no procfs (macOS): trust the pid file
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        stat = (proc / "stat").read_text()
        argv = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
        return False
    return _MAIN_CLASS.encode() in argv and str(paths.server_properties).encode() in argv


def _terminate(pid: int, paths: BrokerPaths) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    log.info("kafka.stopping", pid=pid)
    if _wait_gone(pid, paths, _STOP_GRACE_S):
        return
    log.warning("kafka.kill", pid=pid, after_s=_STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not _wait_gone(pid, paths, _KILL_WAIT_S):
        raise BrokerError(f"Kafka (pid {pid}) survived SIGKILL")


def _exited(pid: int) -> bool:
    """Every thread of ``pid`` has exited. A JVM's main thread can turn zombie (and its
    cmdline empty) while its other threads still close the listeners: a restart then found
    the controller port in use."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] not in ("Z", "X"):
            return False
    return True


def _wait_gone(pid: int, paths: BrokerPaths, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    procfs = Path("/proc/self").exists()
    while _is_our_broker(pid, paths) or (procfs and not _exited(pid)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same as Kafka's own listener: TIME_WAIT leftovers do not count as "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _read_state(paths: BrokerPaths) -> BrokerState | None:
    try:
        return msgspec.json.decode(paths.state_file.read_bytes(), type=BrokerState)
    except (OSError, msgspec.DecodeError):
        return None


def _clear_state(paths: BrokerPaths) -> None:
    paths.state_file.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(paths: BrokerPaths) -> Iterator[None]:
    with paths.lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tail_file(path: Path, lines: int) -> str:
    try:
        return _last_lines(path.read_text(errors="replace"), lines)
    except OSError:
        return ""


def _last_lines(text: str, lines: int) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def _since(began: float) -> float:
    return round(time.monotonic() - began, 2)


# --- CLI ------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kafka = subparsers.add_parser(
        "kafka", help="run the local development Kafka broker (KRaft, from Maven jars)"
    )
    actions = kafka.add_subparsers(dest="kafka_command", metavar="ACTION", required=True)
    for name, handler, help_text in (
        ("start", _cmd_start, "start the broker (idempotent) and print its bootstrap address"),
        ("stop", _cmd_stop, "stop the broker (SIGTERM, SIGKILL after 20 s); data is kept"),
        ("status", _cmd_status, "print running/stopped; exit 1 when it is not running"),
    ):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("--port", type=int, help="PLAINTEXT port (default: broker.port)")
        action.add_argument(
            "--controller-port",
            type=int,
            help="KRaft controller port (default: broker.controller_port)",
        )
        action.add_argument("--state-dir", help="jars, data and logs (default: broker.state_dir)")
        action.set_defaults(handler=handler)


def _broker_config(args: argparse.Namespace, config: Config) -> BrokerConfig:
    overrides = {
        "port": args.port,
        "controller_port": args.controller_port,
        "state_dir": args.state_dir,
    }
    return msgspec.structs.replace(
        config.broker, **{k: v for k, v in overrides.items() if v is not None}
    )


def _cmd_start(args: argparse.Namespace, config: Config) -> int:
    cfg = _broker_config(args, config)
    try:
        bootstrap = start_broker(cfg)
    except BrokerError as exc:
        print(f"combee-stream: kafka start: {exc}", file=sys.stderr)
        if exc.log_tail:
            print(f"--- last lines ---\n{exc.log_tail}", file=sys.stderr)
        return 1
    print(bootstrap)
    return 0


def _cmd_stop(args: argparse.Namespace, config: Config) -> int:
    stop_broker(_broker_config(args, config))
    return 0


def _cmd_status(args: argparse.Namespace, config: Config) -> int:
    cfg = _broker_config(args, config)
    found = broker_status(cfg)
    where = Path(cfg.state_dir)
    if found.state is None:
        print(f"stopped (state dir {where})")
        return 1
    detail = f"pid {found.state.pid}, Kafka {found.state.kafka_version}, state dir {where}"
    print(f"{found.status} {found.state.bootstrap} ({detail})")
    return 0 if found.status == "running" else 1


__all__ = [
    "BrokerError",
    "BrokerPaths",
    "BrokerState",
    "BrokerStatus",
    "broker_running",
    "broker_status",
    "ensure_jars",
    "jvm_flags",
    "log_tail",
    "new_cluster_id",
    "register",
    "start_broker",
    "stop_broker",
]
