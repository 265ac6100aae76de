"""``make test``: the README's test command, every phase timed, the two source builds in the
background, and a one-screen summary of where the time went at the end.

    install      the venv and the package with its pinned tools       (make install)
    builds       started right after install, in the background at a lower CPU priority, each
                 logging to LOG_DIR: llama-server and SmolLM2 (make llm-prepare) and, lower
                 still, the tests' OpenTelemetry Collector (make otelcol-prepare); a cache hit
                 once built on this machine (combee_stream.buildcache)
    broker       the test broker, in the background too                (make broker-test)
    lint         ruff                                                  (make lint)
    typecheck    mypy                                                  (make typecheck)
    pytest       once the broker is up: every test that needs neither build (-m "not build"),
                 while the builds run
    pytest (bg)  once llama-server is built, beside it at the builds' priority: the tests that
                 need a build and no broker (-m "build and not kafka": the real-model tests),
                 logging to LOG_DIR
    wait         until the Collector is built
    pytest       the tests that need a build and the broker (-m "build and kafka": the
                 Collector's), then the wait for the real-model tests

Why this order: the broker-bound tests wait on Kafka and timeouts (about a sixth of the CPU
over their wall time), and the real-model tests are CPU-bound; run one after the other, as
before, a run from nothing was the llama-server build and then the real-model tests end to end
(20 min 52 s on 2 cores). The llama-server build goes before the Collector's because the
real-model tests wait for it and the Collector's tests come after the broker-bound ones anyway.
The real-model tests use no broker, so the broker tests' restarts cannot touch them.

A failed phase does not stop the later ones (one run reports every failure), except install,
which everything needs. The exit status is 0 only when every phase passed. Standard library
only: it runs before the venv exists. The Makefile passes everything it needs; see ``--help``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

SLOWEST = 10


@dataclass
class Phase:
    name: str
    started: float  # seconds since the run began
    wall_s: float = 0.0
    cpu_s: float = 0.0  # user + system of the phase's processes (its waited-for children too)
    code: int | None = None  # None: still running
    note: str = ""
    background: bool = False
    log: Path | None = None
    thread: threading.Thread | None = None  # reaps the process and fills in the figures

    def wait(self) -> Phase:
        if self.thread is not None:
            self.thread.join()
        return self


@dataclass
class Run:
    began: float = field(default_factory=time.monotonic)
    phases: list[Phase] = field(default_factory=list)
    sessions: list[tuple[Phase, int]] = field(default_factory=list)  # low-priority: their pid

    def now(self) -> float:
        return time.monotonic() - self.began

    def start(
        self,
        name: str,
        command: list[str],
        *,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        low_priority: bool = False,
        nice: int = 10,
    ) -> Phase:
        """Start ``command`` (in the background when it has a ``log``); the returned phase is
        completed by a thread when it exits. ``low_priority``: in a session of its own at
        ``nice``, so it takes only the CPU that the rest leaves."""
        phase = Phase(name, self.now(), background=log is not None, log=log)
        self.phases.append(phase)
        print(f"\n=== {name}: {' '.join(command)}" + (f"  (log: {log})" if log else ""), flush=True)
        out = log.open("wb") if log else None
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=low_priority,
            preexec_fn=functools.partial(_lower_priority, nice) if low_priority else None,
            env=env,
        )
        if low_priority:
            self.sessions.append((phase, process.pid))

        def reap() -> None:
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            phase.wall_s = self.now() - phase.started
            phase.cpu_s = usage.ru_utime + usage.ru_stime
            phase.code = process.returncode
            if out:
                out.close()

        phase.thread = threading.Thread(target=reap, daemon=True)
        phase.thread.start()
        return phase

    def run(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Phase:
        return self.start(name, command, env=env).wait()

    def stop_sessions(self) -> None:
        """End the low-priority sessions still running (Ctrl-C does not reach them)."""
        for phase, pid in self.sessions:
            if phase.code is None:  # not reaped yet: the group is still this one
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGTERM)


def _lower_priority(nice: int) -> None:
    """In the child, in its new session: ``nice`` for the session's scheduling group too.
    With autogroup scheduling (Linux's default for sessions), CPU is shared between sessions
    first, and a nice value counts only inside its own session: the group's nice is what lets
    the tests' sessions (pytest, the engines it spawns, the broker) go first."""
    os.nice(nice)
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as group:
        group.write(str(nice))


@dataclass
class Tested:
    counts: str = "no report"  # "N passed, N failed, N skipped"
    times: list[tuple[float, str]] = field(default_factory=list)  # (seconds, test id)
    failed: list[str] = field(default_factory=list)


def read_report(xml: Path) -> Tested:
    """What a JUnit XML report of pytest says."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return Tested()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return Tested()
    total = int(suite.get("tests", 0))
    failures = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    tested = Tested(f"{total - failures - skipped} passed, {failures} failed, {skipped} skipped")
    for case in suite.iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test = f"{module}.py::{case.get('name')}"
        tested.times.append((float(case.get("time", 0.0)), test))
        if case.find("failure") is not None or case.find("error") is not None:
            tested.failed.append(test)
    return tested


def _status(phase: Phase) -> str:
    if phase.code is None:
        return "running"
    return "ok" if phase.code == 0 else f"FAILED ({phase.code})"


def summary(run: Run, tested: Tested) -> str:
    lines = ["", "=" * 78, f"make test: {run.now():.0f} s in all (wall); where it went:"]
    lines.append(f"  {'phase':<28}{'from':>7}{'wall':>8}{'cpu':>8}  status")
    for p in run.phases:
        name = p.name + (" (bg)" if p.background else "")
        lines.append(
            f"  {name:<28}{p.started:>6.0f}s{p.wall_s:>7.0f}s{p.cpu_s:>7.0f}s  {_status(p)}"
            + (f"  {p.note}" if p.note else "")
        )
    slowest = sorted(tested.times, reverse=True)[:SLOWEST]
    if slowest:
        lines.append(f"  slowest {len(slowest)} tests (setup + call + teardown):")
        lines += [f"    {seconds:6.1f} s  {test}" for seconds, test in slowest]
    if tested.failed:
        lines.append(f"  failed tests ({len(tested.failed)}):")
        lines += [f"    {test}" for test in tested.failed[:SLOWEST]]
    failed = [p for p in run.phases if p.code != 0]
    for p in failed:
        if p.log is not None:
            tail = p.log.read_text(errors="replace").splitlines()[-15:]
            lines += [f"  --- {p.name}: last lines of {p.log}", *(f"    {t}" for t in tail)]
    lines.append("=" * 78)
    return "\n".join(lines)


def _note_build(phase: Phase) -> None:
    """'built' or 'cached': the build commands print 'building ...' only when they build."""
    if phase.log is not None and phase.code == 0:
        text = phase.log.read_text(errors="replace")
        phase.note = "built" if "building " in text else "cache hit"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", default="make", help="the make to run the phases with")
    parser.add_argument("--pytest", required=True, help="the venv's pytest")
    parser.add_argument("--kafka-port", required=True, help="COMBEE_TEST_KAFKA_PORT")
    parser.add_argument(
        "--kafka-controller-port", required=True, help="COMBEE_TEST_KAFKA_CONTROLLER_PORT"
    )
    parser.add_argument("--log-dir", type=Path, default=Path(".state/make-test"))
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    make = [args.make, "--no-print-directory"]
    run = Run()
    if run.run("install", [*make, "install"]).code != 0:
        print(summary(run, Tested()))
        return 1
    try:
        return _phases(run, make, args)
    finally:
        run.stop_sessions()


def _phases(run: Run, make: list[str], args: argparse.Namespace) -> int:
    logs: Path = args.log_dir
    # The builds at a low priority: the tests, which wait on timeouts, keep the CPU they need
    # and the builds take what is left; the Collector's lower still (nice 19 against 10: about
    # an eighth of what llama-server's build leaves), see the module's docstring. The broker
    # (a JVM that serves the tests) at normal priority (it runs in a session of its own anyway).
    llm, otelcol = (
        run.start(f"build {target}", [*make, target], log=logs / f"{target}.log",
                  low_priority=True, nice=nice)
        for target, nice in (("llm-prepare", 10), ("otelcol-prepare", 19))
    )  # fmt: skip
    broker = run.start("broker start", [*make, "broker-test"], log=logs / "broker-test.log")
    for target in ("lint", "typecheck"):
        run.run(target, [*make, target])
    broker.wait()
    env = {
        **os.environ,
        "COMBEE_TEST_KAFKA_PORT": args.kafka_port,
        "COMBEE_TEST_KAFKA_CONTROLLER_PORT": args.kafka_controller_port,
    }

    def pytest(selection: str, xml: Path) -> list[str]:
        xml.unlink(missing_ok=True)
        return [args.pytest, "-q", "-m", selection, f"--junitxml={xml}"]

    real_model: list[Phase] = []

    def start_real_model() -> None:
        _note_build(llm.wait())
        # Its own temporary folder and no shared cache: two pytest sessions at once.
        command = [
            *pytest("build and not kafka", logs / "pytest-llm.xml"),
            f"--basetemp={logs / 'pytest-llm-tmp'}",
            "-p",
            "no:cacheprovider",
        ]
        log = logs / "pytest-llm.log"
        real_model.append(run.start("pytest (real model)", command, log=log, env=env,
                                    low_priority=True))  # fmt: skip

    starter = threading.Thread(target=start_real_model, daemon=True)
    starter.start()
    reports: list[tuple[Phase, Path]] = []
    xml = logs / "pytest-1.xml"
    reports.append((run.run("pytest (no builds)", pytest("not build", xml), env=env), xml))
    waited = run.now()
    _note_build(otelcol.wait())
    run.phases.append(Phase("wait for collector", waited, wall_s=run.now() - waited, code=0))
    xml = logs / "pytest-2.xml"
    reports.append((run.run("pytest (collector)", pytest("build and kafka", xml), env=env), xml))
    waited = run.now()
    starter.join()
    reports += [(phase.wait(), logs / "pytest-llm.xml") for phase in real_model]
    run.phases.append(Phase("wait for real model", waited, wall_s=run.now() - waited, code=0))
    tested = Tested(counts="")
    for phase, xml in reports:
        found = read_report(xml)
        phase.note = found.counts
        tested.times += found.times
        tested.failed += found.failed
        if phase.code == 5:  # pytest: no test selected
            phase.code = 0
    print(summary(run, tested), flush=True)
    return 0 if all(p.code == 0 for p in run.phases) else 1


if __name__ == "__main__":
    sys.exit(main())
