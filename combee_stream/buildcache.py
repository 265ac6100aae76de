"""Source builds kept outside any clone, in a user-level cache keyed by their build stamps.

The developer tools build two programs from source: llama.cpp's ``llama-server`` (the local
model, minutes of C++) and the tests' OpenTelemetry Collector (minutes of Go). Kept in a clone's
``.state``, every fresh clone, worktree and CI run paid for them again; kept here, they are
built once per machine and per stamp. Layout of the root (``COMBEE_CACHE_DIR``, else
``${XDG_CACHE_HOME:-~/.cache}/combee-stream``):

    NAME/KEY/           one build: its files and ``.stamp``; KEY is the stamp's sha256 prefix
    NAME/KEY/.stamp     the whole stamp (sources and flags); an entry counts only when it matches
    NAME/.lock          held while a build of NAME runs, so a second builder (a test fixture,
                        another clone) waits for it and then finds the entry instead of
                        building it again

An entry appears whole (built under ``NAME/KEY.partial``, renamed when done), so an interrupted
build leaves nothing that passes for one. Entries of older stamps stay until the root is
deleted (``rm -rf`` it to reclaim the space; nothing else refers to it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

ENV_VAR = "COMBEE_CACHE_DIR"


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """``COMBEE_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/combee-stream``."""
    env = os.environ if env is None else env
    if env.get(ENV_VAR):
        return Path(env[ENV_VAR]).expanduser().resolve()
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser().resolve() / "combee-stream"


def entry_dir(name: str, stamp: str, root: Path | None = None) -> Path:
    """Where the build of ``stamp`` lives (whether or not it exists yet)."""
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    return (root or cache_root()) / name / key


def cached(name: str, stamp: str, output: str, root: Path | None = None) -> Path | None:
    """The built ``output`` of ``stamp``, or None: a hit is an entry whose ``.stamp`` is this
    stamp and whose output file exists."""
    entry = entry_dir(name, stamp, root)
    try:
        matches = (entry / ".stamp").read_text() == stamp
    except OSError:
        return None
    found = entry / output
    return found if matches and found.is_file() else None


def wait_for_build(name: str, root: Path | None = None) -> None:
    """Return once no build of ``name`` runs (at once when none does)."""
    with _locked((root or cache_root()) / name / ".lock"):
        pass


def cached_build(
    name: str,
    stamp: str,
    output: str,
    build: Callable[[Path], object],
    root: Path | None = None,
) -> Path:
    """The built ``output`` of ``stamp``: from the cache, or made by ``build(into)``, which
    writes ``into / output`` (``into`` is an empty directory). One build of ``name`` at a
    time: a second caller waits for the first and takes its result."""
    found = cached(name, stamp, output, root)
    if found is not None:
        return found
    entry = entry_dir(name, stamp, root)
    with _locked(entry.parent / ".lock"):
        found = cached(name, stamp, output, root)
        if found is not None:
            return found
        partial = entry.with_name(entry.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            build(partial)
            if not (partial / output).is_file():
                raise FileNotFoundError(f"the build of {name} left no {output}")
            (partial / ".stamp").write_text(stamp)
            shutil.rmtree(entry, ignore_errors=True)  # a damaged entry of the same stamp
            partial.rename(entry)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return entry / output


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


__all__ = ["ENV_VAR", "cache_root", "cached", "cached_build", "entry_dir", "wait_for_build"]
