"""llama.cpp's native ``llama-server``, built once from the sources vendored in the
``llama-cpp-python`` sdist on PyPI (no network beyond the package registry, no prebuilt binary).

``llama-server`` (not the Python server of llama-cpp-python) because it has parallel slots with
continuous batching, so the engine's concurrent reflector and curator calls share the CPU
instead of queueing one by one.

The binary is kept in the user-level build cache (combee_stream.buildcache), keyed by the
stamp (the sdist's version and the cmake flags), so every clone and state folder of the machine
shares one build; the sdist is kept beside it (``llama-server/sdist/``), and the sources are
unpacked and compiled in a scratch folder removed afterwards. A build left in a state folder by
an earlier version (``STATE/bin/llama-server`` with a matching ``.stamp``) is adopted, not
rebuilt.

The build is portable (no ``-march=native``): AVX2, FMA and F16C, which every x86-64 server of
the last decade has, so a cached binary keeps working if the cache moves to another CPU.
About 3–5 minutes on 2 cores; progress is shown.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Final

from combee_stream.buildcache import cache_root, cached, cached_build
from combee_stream.errors import UserError

SDIST: Final = "llama-cpp-python==0.3.36"
CMAKE_FLAGS: Final = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
)
STAMP: Final = f"{SDIST}\n{' '.join(CMAKE_FLAGS)}\n"
CACHE_NAME: Final = "llama-server"
BINARY: Final = "llama-server"
_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")

Say = Callable[[str], None]


def server_binary() -> Path | None:
    """The cached build of this STAMP, or None."""
    return cached(CACHE_NAME, STAMP, BINARY)


def is_built() -> bool:
    return server_binary() is not None


def ensure_llama_server(state_dir: Path, say: Say) -> Path:
    """The built ``llama-server`` (idempotent: built once per machine and stamp; a build
    running elsewhere is waited for)."""
    found = server_binary()
    if found is not None:
        return found
    legacy = state_dir / "bin"
    if (legacy / BINARY).is_file() and _read(legacy / ".stamp") == STAMP:
        return cached_build(
            CACHE_NAME, STAMP, BINARY, lambda into: shutil.copy2(legacy / BINARY, into / BINARY)
        )
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise UserError(f"building llama-server needs {tool} (a C++ toolchain and cmake)")
    return cached_build(CACHE_NAME, STAMP, BINARY, lambda into: _build(into, say))


def _build(into: Path, say: Say) -> None:
    say(f"building llama.cpp's llama-server from the {SDIST} sdist (about 3-5 min, once)")
    with tempfile.TemporaryDirectory(prefix="llama-build-", dir=into) as scratch:
        work = Path(scratch)
        source = _unpacked_sdist(work, cache_root() / CACHE_NAME / "sdist", say)
        build = work / "build"
        _run(
            ["cmake", "-S", str(source / "vendor" / "llama.cpp"), "-B", str(build), *CMAKE_FLAGS],
            "cmake configure",
        )
        jobs = str(max(1, os.cpu_count() or 1))
        command = ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs]
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process:
            assert process.stdout is not None
            tail: list[str] = []
            shown = -1
            for line in process.stdout:
                tail = [*tail[-40:], line.rstrip()]
                found = _PROGRESS.match(line)
                if found and int(found.group(1)) >= shown + 10:
                    shown = int(found.group(1))
                    say(f"  llama-server build {shown}%")
        if process.returncode != 0:
            raise UserError("building llama-server failed:\n" + "\n".join(tail))
        shutil.copy2(build / "bin" / "llama-server", into / BINARY)
    say(f"llama-server ready: {into.name} in {cache_root() / CACHE_NAME}")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _unpacked_sdist(work: Path, sdists: Path, say: Say) -> Path:
    project, version = SDIST.split("==")
    sdists.mkdir(parents=True, exist_ok=True)
    archive_path = _fetch_sdist(project, version, sdists, say)
    with tarfile.open(archive_path) as archive:
        archive.extractall(work, filter="data")
    unpacked = work / f"{project.replace('-', '_')}-{version}"
    if not (unpacked / "vendor" / "llama.cpp").is_dir():
        raise UserError(f"{archive_path.name} has no vendor/llama.cpp")
    return unpacked


def _fetch_sdist(project: str, version: str, into: Path, say: Say) -> Path:
    """The sdist file itself, found through the index's JSON simple API (PEP 691), its sha256
    checked. (Not ``pip download``: that builds the package's whole build environment from
    source just to read its metadata.) The index is pip's (``PIP_INDEX_URL``) or PyPI."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(
        f"{index}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    wanted = f"{project.replace('-', '_')}-{version}.tar.gz"
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            files = json.load(reply).get("files", [])
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the {project} files from {index}: {exc}") from None
    entry = next((f for f in files if f.get("filename") == wanted), None)
    if entry is None:
        raise UserError(f"{index} has no {wanted}")
    target = into / wanted
    expected = entry["hashes"]["sha256"]
    if target.is_file() and _sha256(target) == expected:
        return target
    say(f"fetching {wanted} ({entry.get('size', 0) / 1e6:.0f} MB)")
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(entry["url"], timeout=600) as reply, partial.open("wb") as out:
            while block := reply.read(1 << 20):
                digest.update(block)
                out.write(block)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise UserError(f"cannot download {entry['url']}: {exc}") from None
    if digest.hexdigest() != expected:
        partial.unlink()
        raise UserError(f"{wanted}: sha256 {digest.hexdigest()}, expected {expected}")
    partial.replace(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        raise UserError(f"{what} failed (exit {done.returncode}):\n{output[-3000:]}")


__all__ = ["CMAKE_FLAGS", "SDIST", "ensure_llama_server", "is_built", "server_binary"]
