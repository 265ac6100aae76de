"""llama.cpp's native ``llama-server``, built once from the sources vendored in the
``llama-cpp-python`` sdist on PyPI (no network beyond the package registry, no prebuilt binary).

``llama-server`` (not the Python server of llama-cpp-python) because it has parallel slots with
continuous batching, so the engine's concurrent reflector and curator calls share the CPU
instead of queueing one by one. Layout of ``STATE`` (``local_llm.state_dir``):

    src/llama_cpp_python-VERSION/   the unpacked sdist (vendor/llama.cpp is what is built)
    build/                          cmake's build tree
    bin/llama-server                the binary; bin/.stamp names the sources and flags

The build is portable (no ``-march=native``): AVX2, FMA and F16C, which every x86-64 server of
the last decade has, so a cached binary keeps working if the state folder moves to another CPU.
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
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Final

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
_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")

Say = Callable[[str], None]


def server_binary(state_dir: Path) -> Path:
    return state_dir / "bin" / "llama-server"


def is_built(state_dir: Path) -> bool:
    stamp = state_dir / "bin" / ".stamp"
    return server_binary(state_dir).is_file() and stamp.is_file() and stamp.read_text() == STAMP


def ensure_llama_server(state_dir: Path, say: Say) -> Path:
    """The built ``llama-server`` (idempotent: built once per state folder)."""
    binary = server_binary(state_dir)
    if is_built(state_dir):
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise UserError(f"building llama-server needs {tool} (a C++ toolchain and cmake)")
    say(f"building llama.cpp's llama-server from the {SDIST} sdist (about 3-5 min, once)")
    source = _unpacked_sdist(state_dir, say)
    build = state_dir / "build"
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
    built = build / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, binary)
    (binary.parent / ".stamp").write_text(STAMP)
    say(f"llama-server ready: {binary}")
    return binary


def _unpacked_sdist(state_dir: Path, say: Say) -> Path:
    src = state_dir / "src"
    project, version = SDIST.split("==")
    unpacked = src / f"{project.replace('-', '_')}-{version}"
    if (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return unpacked
    src.mkdir(parents=True, exist_ok=True)
    archive_path = _fetch_sdist(project, version, src, say)
    with tarfile.open(archive_path) as archive:
        archive.extractall(src, filter="data")
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
