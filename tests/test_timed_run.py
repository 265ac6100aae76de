"""``make test``'s driver (tests/timed_run.py): what its summary reads from pytest's report."""

from __future__ import annotations

from pathlib import Path

from timed_run import read_report

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4" time="9.0">
<testcase classname="tests.test_a" name="test_fast" time="0.5" />
<testcase classname="tests.test_a" name="test_slow[x]" time="7.25" />
<testcase classname="tests.test_b" name="test_broken" time="1.0"><failure message="no" /></testcase>
<testcase classname="tests.test_b" name="test_skipped" time="0.0"><skipped message="s" /></testcase>
</testsuite></testsuites>
"""


def test_the_summary_reads_counts_times_and_failures_from_pytests_report(tmp_path: Path) -> None:
    report = tmp_path / "pytest.xml"
    report.write_text(JUNIT)
    tested = read_report(report)
    assert tested.counts == "2 passed, 1 failed, 1 skipped"
    assert max(tested.times) == (7.25, "tests/test_a.py::test_slow[x]")
    assert tested.failed == ["tests/test_b.py::test_broken"]
    assert read_report(tmp_path / "missing.xml").counts == "no report"
