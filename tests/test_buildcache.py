"""The user-level build cache: where it is, what counts as a hit, one build at a time, and
nothing half-built left behind."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from combee_stream.buildcache import cache_root, cached, cached_build, entry_dir


def test_the_cache_root_is_the_env_var_else_xdg_else_home(tmp_path: Path) -> None:
    home = Path.home()
    assert cache_root({"COMBEE_CACHE_DIR": str(tmp_path / "c")}) == tmp_path / "c"
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "combee-stream"
    assert cache_root({}) == (home / ".cache" / "combee-stream").resolve()


def _writer(content: str, calls: list[str]) -> Callable[[Path], None]:
    def build(into: Path) -> None:
        calls.append(content)
        (into / "tool").write_text(content)

    return build


def test_a_miss_builds_once_and_a_hit_is_the_same_stamp_only(tmp_path: Path) -> None:
    calls: list[str] = []
    first = cached_build("tool", "v1 -O2\n", "tool", _writer("one", calls), root=tmp_path)
    again = cached_build("tool", "v1 -O2\n", "tool", _writer("two", calls), root=tmp_path)
    assert first == again and first.read_text() == "one" and calls == ["one"]
    assert cached("tool", "v1 -O2\n", "tool", root=tmp_path) == first
    # Another stamp (other flags) is another entry, built; the first one stays.
    other = cached_build("tool", "v1 -O3\n", "tool", _writer("three", calls), root=tmp_path)
    assert other != first and other.read_text() == "three" and first.read_text() == "one"


def test_an_entry_whose_stamp_does_not_match_is_rebuilt(tmp_path: Path) -> None:
    calls: list[str] = []
    built = cached_build("tool", "v1\n", "tool", _writer("one", calls), root=tmp_path)
    (built.parent / ".stamp").write_text("v0\n")  # damaged, or another stamp's hash collision
    assert cached("tool", "v1\n", "tool", root=tmp_path) is None
    rebuilt = cached_build("tool", "v1\n", "tool", _writer("two", calls), root=tmp_path)
    assert rebuilt.read_text() == "two" and calls == ["one", "two"]


def test_a_failed_build_leaves_nothing_that_passes_for_one(tmp_path: Path) -> None:
    def broken(into: Path) -> None:
        (into / "tool").write_text("half")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cached_build("tool", "v1\n", "tool", broken, root=tmp_path)
    assert cached("tool", "v1\n", "tool", root=tmp_path) is None
    assert not entry_dir("tool", "v1\n", tmp_path).exists()
    with pytest.raises(FileNotFoundError):  # a build that writes no output is a failure too
        cached_build("tool", "v1\n", "tool", lambda into: None, root=tmp_path)
    assert cached("tool", "v1\n", "tool", root=tmp_path) is None


def test_a_second_builder_waits_for_the_first_and_takes_its_build(tmp_path: Path) -> None:
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow(into: Path) -> None:
        started.set()
        assert release.wait(30)
        _writer("first", calls)(into)

    results: dict[str, Path] = {}
    first = threading.Thread(
        target=lambda: results.update(a=cached_build("tool", "v1\n", "tool", slow, root=tmp_path))
    )
    first.start()
    assert started.wait(30)
    second = threading.Thread(
        target=lambda: results.update(
            b=cached_build("tool", "v1\n", "tool", _writer("second", calls), root=tmp_path)
        )
    )
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second builder did not wait for the first"
    release.set()
    first.join(30)
    second.join(30)
    assert calls == ["first"] and results["a"] == results["b"]
