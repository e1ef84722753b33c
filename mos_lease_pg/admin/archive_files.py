"""An audit archive on disk, without a database: the JSON-lines file of each archived
partition, the manifest that records each file's row count, seq range and SHA-256, writing
both durably (whole or not at all), and :func:`verify`, which checks a directory against its
manifest line by line. Apart from :mod:`mos_lease_pg.admin.archive`, which moves partitions
from the database into such a directory, because ``mos-lease audit verify`` and anyone
holding an archive need only this.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import attrs

from mos_lease.errors import MosLeaseError

MANIFEST: Final = "manifest.json"
FORMAT: Final = 1


class ArchiveError(MosLeaseError):
    """Archiving was refused or failed; no partition whose export did not verify was
    dropped."""

@attrs.frozen(slots=True)
class Digest:
    """What a partition's rows, as JSON lines, add up to."""

    rows: int
    sha256: str
    first_seq: int | None
    last_seq: int | None
    size: int = attrs.field(default=0, eq=False)  # bytes, for throughput figures only


@attrs.frozen(slots=True)
class Entry:
    """One archived partition in the manifest."""

    partition: str
    file: str
    low: str | None
    high: str
    digest: Digest

    def as_json(self) -> dict[str, Any]:
        return {"partition": self.partition, "file": self.file, "from": self.low,
                "to": self.high, "rows": self.digest.rows, "sha256": self.digest.sha256,
                "first_seq": self.digest.first_seq, "last_seq": self.digest.last_seq}

    @classmethod
    def of(cls, data: dict[str, Any]) -> Entry:
        return cls(data["partition"], data["file"], data["from"], data["to"],
                   Digest(data["rows"], data["sha256"], data["first_seq"], data["last_seq"]))


def _seq_of(line: bytes, number: int) -> int:
    """The seq of one archived line, or ValueError naming the line: a file is checked line
    by line, and any JSON value (a list, an object without seq) may be found there."""
    try:
        row = json.loads(line)
    except ValueError as bad:  # not JSON, or not UTF-8
        raise ValueError(f"line {number}: not JSON ({bad})") from None
    if not isinstance(row, dict):
        raise ValueError(f"line {number}: a JSON {type(row).__name__}, not an audit row")
    seq = row.get("seq")
    if type(seq) is not int:  # bool is an int subclass, and no seq
        raise ValueError(f"line {number}: no integer seq ({seq!r}), not an audit row")
    return seq


class Summing:
    """Running :class:`Digest` of lines fed one by one."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.rows = 0
        self.size = 0
        self.first: int | None = None
        self.last: int | None = None

    def add(self, line: bytes) -> None:
        """Count and hash ``line``, then raise ValueError if it is not an audit row in seq
        order (counted all the same, so a checker may go on to the next line)."""
        number = self.rows + 1
        self.hash.update(line + b"\n")
        self.rows += 1
        self.size += len(line) + 1
        seq = _seq_of(line, number)
        if self.last is not None and seq <= self.last:
            raise ValueError(f"line {number}: seq {seq!r} does not follow {self.last}")
        self.first = seq if self.first is None else self.first
        self.last = seq

    def digest(self) -> Digest:
        return Digest(self.rows, self.hash.hexdigest(), self.first, self.last, self.size)


def file_lines(path: Path) -> Iterator[bytes]:
    with path.open("rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                raise ValueError("the last line is cut short (no newline)")
            yield raw[:-1]


def digest_lines(lines: Iterable[bytes]) -> Digest:
    summing = Summing()
    for line in lines:
        summing.add(line)
    return summing.digest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, chunks: Iterable[bytes]) -> None:
    """Write ``path`` whole or not at all: a temporary file, fsynced, renamed over it."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    partial.replace(path)
    _fsync_dir(path.parent)


def read_manifest(directory: Path) -> dict[str, Entry]:
    """The entries of ``directory``'s manifest by partition (none if it has no manifest)."""
    path = directory / MANIFEST
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text("utf-8"))
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        return {e["partition"]: Entry.of(e) for e in data["partitions"]}
    except (ValueError, KeyError, TypeError) as bad:
        raise ArchiveError(f"{path} is not a mos-lease archive manifest: {bad}") from None


def write_manifest(directory: Path, entries: dict[str, Entry]) -> None:
    data = {"format": FORMAT, "hash": "sha256 of the file's bytes (each line ends with \\n)",
            "partitions": [entries[k].as_json() for k in sorted(entries)]}
    write_durably(directory / MANIFEST, [json.dumps(data, indent=2).encode() + b"\n"])


def scan(path: Path) -> tuple[Digest, list[str]]:
    """Every line of an archived file, checked on its own: the digest of all of them and
    each line that is cut short or not an audit row in seq order (by line number)."""
    summing = Summing()
    bad = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.endswith(b"\n"):
                bad.append(f"line {number}: cut short (no newline)")
            try:
                summing.add(raw.removesuffix(b"\n"))
            except ValueError as why:
                bad.append(str(why))
    return summing.digest(), bad


def verify(directory: Path) -> tuple[list[Entry], list[str]]:
    """Check every file of ``directory`` against its manifest: the entries checked and the
    problems found (a changed, cut, missing or extra line; a missing or unlisted file)."""
    problems = []
    if not (directory / MANIFEST).exists():
        return [], [f"{directory} has no {MANIFEST}"]
    entries = read_manifest(directory)
    for entry in entries.values():
        path = directory / entry.file
        if not path.exists():
            problems.append(f"{entry.file}: missing")
            continue
        found, bad_lines = scan(path)
        problems.extend(f"{entry.file}: {bad}" for bad in bad_lines)
        if found.rows != entry.digest.rows:
            problems.append(f"{entry.file}: {found.rows} lines, the manifest says "
                            f"{entry.digest.rows}")
        elif (found.first_seq, found.last_seq) != (entry.digest.first_seq,
                                                   entry.digest.last_seq):
            problems.append(f"{entry.file}: seq {found.first_seq}..{found.last_seq}, the "
                            f"manifest says {entry.digest.first_seq}..{entry.digest.last_seq}")
        if found.sha256 != entry.digest.sha256:
            problems.append(f"{entry.file}: SHA-256 {found.sha256} differs from the "
                            f"manifest's {entry.digest.sha256}")
    listed = {entry.file for entry in entries.values()}
    problems.extend(f"{path.name}: not in the manifest"
                    for path in sorted(directory.glob("*.jsonl")) if path.name not in listed)
    return list(entries.values()), problems
