"""The history checker can fail: each check is shown a hand-made history that violates it.

These tests need no database; they are marked ``faults`` so that ``pytest -m faults`` proves
the checker before it judges any scenario.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from tests.faults.history import (
    AuditRow,
    FinalRow,
    Ident,
    Kind,
    Op,
    OpRecord,
    Status,
    Violation,
    check_history,
    parse_lines,
    record_to_json,
    start_to_json,
)

pytestmark = [pytest.mark.faults]

T0 = datetime(2030, 1, 1, tzinfo=UTC)
A: Ident = ("acme", "agent-1", "b1")
B: Ident = ("acme", "agent-1", "b2")
L1, L2, L3 = "lease-1", "lease-2", "lease-3"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


_n = itertools.count(1)


def op(kind: Op, status: Status, start: float, end: float | None, *, epoch: int | None = None,
       lease: str | None = None, expires: float | None = None, identity: Ident = A,
       corr: str | None = None, key: str | None = None, reason: str | None = None,
       grant: str | None = None, conn: str = "c1", optional: bool = False,
       args: dict[str, object] | None = None) -> OpRecord:
    n = next(_n)
    return OpRecord(
        process="p", n=n, op=kind, identity=identity, connector_id=conn,
        correlation_id=corr if corr is not None else f"corr-{n}", status=status,
        start=at(start), end=None if end is None else at(end), reason=reason, epoch=epoch,
        lease_id=lease, expires_at=None if expires is None else at(expires), grant_id=grant,
        audit_key=key, audit_optional=optional, args=args or {})


_seq = itertools.count(1)


def row_for(record: OpRecord, *, outcome: str | None = None, epoch: int | None = None,
            reason: str | None = None, when: float = 0.0) -> AuditRow:
    """The audit row the library should write for ``record`` (fields overridable)."""
    success = {Op.ACQUIRE: "acquired", Op.TAKEOVER: "taken_over", Op.HEARTBEAT: "renewed",
               Op.RELEASE: "released", Op.ISSUE_GRANT: "grant_issued"}
    if outcome is None:
        outcome = "denied" if record.status is Status.DENIED else success[record.op]
    return AuditRow(
        seq=next(_seq), event_id=f"ev-{record.n}", event=record.op.value, outcome=outcome,
        reason=reason if reason is not None else record.reason, identity=record.identity,
        connector_id=record.connector_id, epoch=epoch if epoch is not None else record.epoch,
        correlation_id=record.key, recorded_at=at(when))


def kinds(violations: Sequence[Violation]) -> set[Kind]:
    return {v.kind for v in violations}


def good_history() -> tuple[list[OpRecord], list[AuditRow]]:
    """c1 acquires, renews, gets a grant and uses it; c2 takes over after expiry; c1's next
    validation is refused; a validation overlapping the takeover was still accepted."""
    acquire = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=5)
    beat = op(Op.HEARTBEAT, Status.OK, 1, 1.1, epoch=1, lease=L1, expires=7)
    issue = op(Op.ISSUE_GRANT, Status.OK, 2, 2.1, epoch=1, lease=L1, expires=7, grant="g1")
    ok_validate = op(Op.VALIDATE, Status.OK, 3, 3.1, epoch=1, lease=L1, grant="g1",
                     key=issue.correlation_id)
    takeover = op(Op.TAKEOVER, Status.OK, 6.5, 7, epoch=2, lease=L2, expires=20, conn="c2")
    # Overlaps the takeover: may have read the row just before it committed.
    racing = op(Op.VALIDATE, Status.OK, 6.9, 7.2, epoch=1, lease=L1, grant="g1",
                key=issue.correlation_id)
    stale = op(Op.VALIDATE, Status.DENIED, 8, 8.1, epoch=1, reason="stale_epoch",
               key=issue.correlation_id)
    refused = op(Op.ACQUIRE, Status.DENIED, 9, 9.1, reason="lease_held", conn="c3")
    failed = op(Op.HEARTBEAT, Status.ERROR, 10, 10.1, epoch=1, conn="c1")
    in_doubt = op(Op.HEARTBEAT, Status.UNKNOWN, 11, None, epoch=2, conn="c2",
                  args={"lease_id": L2})
    records = [acquire, beat, issue, ok_validate, takeover, racing, stale, refused, failed,
               in_doubt]
    rows = [row_for(r) for r in (acquire, beat, issue, takeover, stale, refused)]
    rows.append(row_for(in_doubt, outcome="renewed", epoch=2))  # it did commit
    return records, rows


def test_a_correct_history_passes() -> None:
    records, rows = good_history()
    assert check_history(records, rows, final_rows=[FinalRow(A, L2, 2)]) == []


def test_an_in_doubt_operation_may_also_not_have_committed() -> None:
    records, rows = good_history()
    assert check_history(records, rows[:-1]) == []


def test_stale_validation_after_takeover_is_caught() -> None:
    # A preempting takeover: the old lease and grant have not expired, only the epoch
    # fences them.
    acquire = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=100)
    issue = op(Op.ISSUE_GRANT, Status.OK, 1, 1.1, epoch=1, lease=L1, expires=30, grant="g1")
    take = op(Op.TAKEOVER, Status.OK, 2, 2.1, epoch=2, lease=L2, expires=100, conn="c2")
    late = op(Op.VALIDATE, Status.OK, 3, 3.1, epoch=1, lease=L1, grant="g1",
              key=issue.correlation_id)
    rows = [row_for(acquire), row_for(issue), row_for(take)]
    assert check_history([acquire, issue, take], rows) == []
    found = check_history([acquire, issue, take, late], rows)
    assert kinds(found) == {Kind.STALE_ACCEPTED}
    assert "epoch 2" in found[0].detail


def test_stale_heartbeat_and_grant_after_takeover_are_caught() -> None:
    records, rows = good_history()
    beat = op(Op.HEARTBEAT, Status.OK, 7.2, 7.3, epoch=1, lease=L1, expires=30)
    issue = op(Op.ISSUE_GRANT, Status.OK, 7.4, 7.5, epoch=1, lease=L1, expires=8, grant="g9")
    found = check_history([*records, beat, issue], [*rows, row_for(beat), row_for(issue)])
    assert [v.kind for v in found].count(Kind.STALE_ACCEPTED) >= 2


def test_two_valid_leases_without_a_recorded_takeover_are_caught() -> None:
    # The takeover's own result was lost (unknown), but a validation of epoch 2 was seen;
    # epoch 1 accepted after that means both were valid at once.
    first = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=100)
    lost = op(Op.TAKEOVER, Status.UNKNOWN, 1, None, conn="c2")
    newer = op(Op.VALIDATE, Status.OK, 2, 2.1, epoch=2, lease=L2, conn="c2", key="gx")
    older = op(Op.VALIDATE, Status.OK, 3, 3.1, epoch=1, lease=L1, key="gy")
    found = check_history([first, lost, newer, older], [], audited=False)
    assert kinds(found) == {Kind.TWO_VALID_LEASES}


def test_two_winners_of_one_epoch_are_caught_in_history_and_audit() -> None:
    first = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=1)
    win_a = op(Op.TAKEOVER, Status.OK, 2, 2.2, epoch=2, lease=L2, expires=9, conn="c2")
    win_b = op(Op.TAKEOVER, Status.OK, 2, 2.3, epoch=2, lease=L3, expires=9, conn="c3")
    rows = [row_for(first), row_for(win_a), row_for(win_b)]
    found = check_history([first, win_a, win_b], rows)
    assert Kind.EPOCH_WINNERS in kinds(found)
    assert sum(v.kind is Kind.EPOCH_WINNERS for v in found) == 3  # ids, winners, audit


def test_epoch_gap_and_regression_in_the_audit_log_are_caught() -> None:
    first = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=1)
    jump = op(Op.TAKEOVER, Status.OK, 2, 2.1, epoch=3, lease=L2, expires=9, conn="c2")
    back = op(Op.TAKEOVER, Status.OK, 3, 3.1, epoch=2, lease=L3, expires=9, conn="c3")
    rows = [row_for(first), row_for(jump), row_for(back)]
    found = kinds(check_history([first, jump, back], rows))
    assert {Kind.EPOCH_GAP, Kind.EPOCH_NOT_INCREASING} <= found


def test_second_acquisition_is_caught() -> None:
    first = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=1)
    again = op(Op.ACQUIRE, Status.OK, 2, 2.1, epoch=1, lease=L2, expires=9, conn="c2")
    found = kinds(check_history([first, again], [row_for(first), row_for(again)]))
    assert Kind.EPOCH_WINNERS in found


def test_renewal_audited_at_an_old_epoch_is_caught() -> None:
    first = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=1)
    take = op(Op.TAKEOVER, Status.OK, 2, 2.1, epoch=2, lease=L2, expires=9, conn="c2")
    # The history lost the renewal's answer; the audit log still shows it at epoch 1.
    beat = op(Op.HEARTBEAT, Status.UNKNOWN, 3, None, conn="c1", args={"lease_id": L1})
    rows = [row_for(first), row_for(take), row_for(beat, outcome="renewed", epoch=1)]
    assert kinds(check_history([first, take, beat], rows)) == {Kind.STALE_ACCEPTED}


def test_grant_issue_audited_after_a_takeover_at_the_previous_epoch_is_fine() -> None:
    first = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=1)
    issue = op(Op.ISSUE_GRANT, Status.OK, 0.5, 2.5, epoch=1, lease=L1, expires=1, grant="g")
    take = op(Op.TAKEOVER, Status.OK, 2, 2.1, epoch=2, lease=L2, expires=9, conn="c2")
    rows = [row_for(first), row_for(take), row_for(issue)]  # log order: takeover first
    assert check_history([first, issue, take], rows) == []
    future = row_for(issue, epoch=3)
    assert Kind.STALE_ACCEPTED in kinds(check_history([first, issue, take],
                                                      [rows[0], rows[1], future]))


def test_missing_duplicate_and_orphan_audit_rows_are_caught() -> None:
    records, rows = good_history()
    beat = records[1]
    without = [r for r in rows if r.correlation_id != beat.correlation_id]
    assert kinds(check_history(records, without)) == {Kind.AUDIT_MISSING}
    original = next(r for r in rows if r.correlation_id == beat.correlation_id)
    doubled = [*rows, replace(row_for(beat), seq=original.seq)]
    assert kinds(check_history(records, doubled)) == {Kind.AUDIT_DUPLICATE}
    stray = AuditRow(9999, "ev-x", "takeover", "denied", "epoch_mismatch", A, "c9", 1,
                     "nobody", at(1))
    assert kinds(check_history(records, [*rows, stray])) == {Kind.AUDIT_ORPHAN}


def test_a_failed_call_that_left_a_row_is_caught() -> None:
    records, rows = good_history()
    failed = records[8]
    assert failed.status is Status.ERROR
    left = replace(row_for(failed, outcome="renewed"), seq=rows[1].seq)  # before the takeover
    found = check_history(records, [*rows, left])
    assert kinds(found) == {Kind.AUDIT_DUPLICATE}  # a row for an op that changed nothing


def test_an_in_doubt_operation_may_not_have_two_rows() -> None:
    records, rows = good_history()
    in_doubt = records[-1]
    found = check_history(records, [*rows, row_for(in_doubt, outcome="renewed", epoch=2)])
    assert kinds(found) == {Kind.AUDIT_DUPLICATE}


def test_denial_with_wrong_reason_is_caught() -> None:
    records, rows = good_history()
    refused = records[7]
    swapped = [row_for(refused, reason="lease_missing") if r.correlation_id == refused.key
               else r for r in rows]
    assert kinds(check_history(records, swapped)) == {Kind.AUDIT_MISSING, Kind.AUDIT_DUPLICATE}


def test_denied_validation_whose_audit_was_reported_lost_may_lack_a_row() -> None:
    records, rows = good_history()
    stale = records[6]
    lost = replace(stale, audit_optional=True)
    without = [r for r in rows if r.event != "grant_validate"]
    assert check_history([*records[:6], lost, *records[7:]], without) == []
    assert kinds(check_history(records, without)) == {Kind.AUDIT_MISSING}


def test_accepted_after_expiry_release_or_grant_expiry_is_caught() -> None:
    acquire = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=5)
    late_beat = op(Op.HEARTBEAT, Status.OK, 5.5, 5.6, epoch=1, lease=L1, expires=10)
    assert kinds(check_history([acquire, late_beat], [], audited=False)) == {
        Kind.EXPIRED_ACCEPTED}

    release = op(Op.RELEASE, Status.OK, 1, 1.1, epoch=1, lease=L1)
    after = op(Op.ISSUE_GRANT, Status.OK, 2, 2.1, epoch=1, lease=L1, expires=5, grant="g")
    assert kinds(check_history([acquire, release, after], [], audited=False)) == {
        Kind.RELEASED_ACCEPTED}

    issue = op(Op.ISSUE_GRANT, Status.OK, 1, 1.1, epoch=1, lease=L1, expires=2, grant="g2")
    use = op(Op.VALIDATE, Status.OK, 3, 3.1, epoch=1, lease=L1, grant="g2", key="k")
    assert kinds(check_history([acquire, issue, use], [], audited=False)) == {
        Kind.GRANT_EXPIRED_ACCEPTED}


def test_renewal_in_flight_suspends_the_expiry_judgement() -> None:
    acquire = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=5)
    renewing = op(Op.HEARTBEAT, Status.UNKNOWN, 4.9, None, epoch=1, args={"lease_id": L1})
    use = op(Op.VALIDATE, Status.OK, 5.5, 5.6, epoch=1, lease=L1, key="k")
    assert check_history([acquire, renewing, use], [], audited=False) == []


def test_final_row_disagreeing_with_history_is_caught() -> None:
    records, rows = good_history()
    found = check_history(records, rows, final_rows=[FinalRow(A, L3, 2)])
    assert kinds(found) == {Kind.FINAL_STATE}
    found = check_history(records, rows, final_rows=[FinalRow(A, L2, 3)])
    assert kinds(found) == {Kind.FINAL_STATE}
    found = check_history(records, rows, final_rows=[])
    assert kinds(found) == {Kind.FINAL_STATE}


def test_initial_epoch_lets_a_run_start_above_one() -> None:
    take = op(Op.TAKEOVER, Status.OK, 0, 0.1, epoch=8, lease=L2, expires=9, identity=B)
    assert check_history([take], [row_for(take)], initial_epochs={B: 7}) == []
    assert kinds(check_history([take], [row_for(take)])) == {Kind.EPOCH_GAP}


def test_malformed_records_are_reported() -> None:
    backwards = op(Op.ACQUIRE, Status.OK, 2, 1, epoch=1, lease=L1, expires=5)
    assert Kind.MALFORMED in kinds(check_history([backwards], [], audited=False))


def test_records_round_trip_and_unfinished_calls_become_unknown() -> None:
    records, _ = good_history()
    lines = [record_to_json(r) for r in records]
    dying = op(Op.TAKEOVER, Status.OK, 20, 21, epoch=3, conn="c9", args={"expected_epoch": 2})
    lines.append(start_to_json(dying.process, dying.n, dying.op, dying.identity,
                               dying.connector_id, dying.correlation_id, dying.start, None,
                               dying.args))
    lines.append('{"kind": "op", "torn')  # the process was killed mid-write
    parsed = parse_lines(lines)
    assert [r for r in parsed if r.n != dying.n] == sorted(records,
                                                            key=lambda r: (r.start, r.n))
    (unfinished,) = [r for r in parsed if r.n == dying.n]
    assert unfinished.status is Status.UNKNOWN and unfinished.end is None
    assert unfinished.args == {"expected_epoch": 2}


def seen_expired_history(renewed: bool) -> tuple[list[OpRecord], list[AuditRow]]:
    """A renewal judged by a clock read before its lock wait: c1's heartbeat is sent at
    0.6 s and waits for the row lock; at 2.1 s another gateway's grant issue on the same
    lease is refused ``lease_expired``; the heartbeat then commits (``renewed=True``, the
    planted violation) or is refused."""
    acquire = op(Op.ACQUIRE, Status.OK, 0, 0.1, epoch=1, lease=L1, expires=2)
    observer = op(Op.ISSUE_GRANT, Status.DENIED, 2.1, 2.2, epoch=1, reason="lease_expired",
                  conn="c1")
    rows = [row_for(acquire), row_for(observer, when=2.1)]  # seq in this order
    if renewed:
        beat = op(Op.HEARTBEAT, Status.OK, 0.6, 3.0, epoch=1, lease=L1, expires=60.6)
        # Stamped with the clock it read before the wait, as the old statement did.
        rows.append(row_for(beat, when=0.6))
    else:
        beat = op(Op.HEARTBEAT, Status.DENIED, 0.6, 3.0, epoch=1, reason="lease_expired")
        rows.append(row_for(beat, when=2.9))
    return [acquire, observer, beat], rows


def test_renewal_committed_after_the_lease_was_seen_expired_is_caught() -> None:
    records, rows = seen_expired_history(renewed=True)
    violations = check_history(records, rows)
    # Only the new rule sees it: the renewal started while the lease was still active.
    assert kinds(violations) == {Kind.RENEWED_AFTER_SEEN_EXPIRED}, violations
    assert "saw it expired" in str(violations[0])


def test_renewal_refused_after_the_lease_was_seen_expired_passes() -> None:
    records, rows = seen_expired_history(renewed=False)
    assert check_history(records, rows) == []


def test_renewal_of_a_newer_epoch_after_an_old_one_was_seen_expired_passes() -> None:
    records, rows = seen_expired_history(renewed=False)
    takeover = op(Op.TAKEOVER, Status.OK, 3.1, 3.2, epoch=2, lease=L2, expires=9, conn="c2")
    beat = op(Op.HEARTBEAT, Status.OK, 4, 4.1, epoch=2, lease=L2, expires=10, conn="c2")
    records += [takeover, beat]
    rows += [row_for(takeover, when=3.1), row_for(beat, when=4)]
    assert check_history(records, rows) == []
