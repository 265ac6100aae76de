"""The committable position is the low watermark of unfinished offsets."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from combee_stream.kafka.offsets import PartitionOffsets


def test_commit_stops_at_the_oldest_unfinished_offset() -> None:
    offsets = PartitionOffsets()
    assert offsets.committable() is None  # nothing read yet: nothing to commit
    for o in (10, 11, 12, 14):  # 13 is a gap (a transaction marker, say)
        offsets.read(o)
    offsets.done(11)
    offsets.done(14)
    assert offsets.committable() == 10
    offsets.done(10)
    assert offsets.committable() == 12
    offsets.done(12)
    assert offsets.committable() == 15  # nothing pending: one past the highest read
    assert offsets.pending == 0


@given(st.lists(st.integers(0, 200), unique=True, min_size=1), st.randoms())
def test_never_commits_past_a_pending_offset(read: list[int], rng: random.Random) -> None:
    read.sort()
    offsets = PartitionOffsets()
    for o in read:
        offsets.read(o)
    done = rng.sample(read, rng.randint(0, len(read)))
    for o in done:
        offsets.done(o)
    pending = set(read) - set(done)
    at = offsets.committable()
    assert all(o >= at for o in pending)
    assert at == (min(pending) if pending else read[-1] + 1)
