"""Time-ordered ids (mos_lease.ids): what the PostgreSQL store's audit log relies on to place
an event id by its minting time (migration 0009)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from mos_lease.ids import LOW_BITS, minted_ms, uuid7, uuid7_of


def test_a_fresh_id_is_version_7_and_carries_the_wall_clocks_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    ids = [uuid7() for _ in range(1000)]
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == 1000
    for value in ids:
        assert value.version == 7
        assert value.variant == uuid.RFC_4122
        ms = minted_ms(value)
        assert ms is not None and before <= ms <= after


def test_ids_sort_by_their_millisecond() -> None:
    early = uuid7(1_700_000_000_000_000_000)
    late = uuid7(1_700_000_000_001_000_000)
    assert early < late
    assert minted_ms(early) == 1_700_000_000_000
    assert minted_ms(late) == 1_700_000_000_001


def test_a_reproducible_id_keeps_its_low_bits_and_its_millisecond() -> None:
    low = (1 << LOW_BITS) - 1
    value = uuid7_of(1_700_000_000_000, low)
    assert value == uuid7_of(1_700_000_000_000, low)
    assert value.version == 7 and value.variant == uuid.RFC_4122
    assert minted_ms(value) == 1_700_000_000_000
    distinct = {uuid7_of(5, n) for n in range(4096 + 3)}
    assert len(distinct) == 4096 + 3  # the bits below and above the variant both count
    assert uuid7_of(5, 1 << LOW_BITS) == uuid7_of(5, 0)  # only the low 74 bits are kept


@pytest.mark.parametrize("ms", [-1, 1 << 48])
def test_a_millisecond_outside_48_bits_is_refused(ms: int) -> None:
    with pytest.raises(ValueError, match="48 bits"):
        uuid7_of(ms, 0)


def test_another_version_has_no_minting_time() -> None:
    assert minted_ms(uuid.uuid4()) is None


def _random_part(value: uuid.UUID) -> int:
    return value.int & ((1 << 80) - 1)  # all but the millisecond


def test_ids_minted_in_a_row_share_no_random_bits() -> None:
    # The bits come from a pool of kernel randomness drawn 4 KiB at a time: consecutive
    # ids, across a refill, never repeat their random part.
    parts = [_random_part(uuid7()) for _ in range(2000)]
    assert len(set(parts)) == len(parts)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_mints_its_parents_next_ids() -> None:
    uuid7()  # the pool holds unused bytes when the process forks
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: mint, report, leave without running the parent's cleanup
        os.close(read)
        os.write(write, b"".join(_random_part(uuid7()).to_bytes(10, "big") for _ in range(5)))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    child = {int.from_bytes(data[i:i + 10], "big") for i in range(0, len(data), 10)}
    parent = {_random_part(uuid7()) for _ in range(5)}
    assert len(child) == 5
    assert not child & parent
