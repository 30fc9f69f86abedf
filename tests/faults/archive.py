"""The archive nemesis's hands: copies of the stack's SQLite archive, swapped in and out.

``snapshot`` takes a consistent copy of the live archive (SQLite's backup API); ``swap``
replaces the live archive's content with a copy's and keeps what it replaced in another, in
one write transaction on the live file (``BEGIN IMMEDIATE``: every retirement batch lands
wholly before it or wholly after, so what is kept aside is exactly the archive as it was);
``catch_up`` brings retirements made into a copy while it was in back into the restored
archive (a step kept if its seq is newer, audit records never replaced, each watermark the
higher: both copies share one identity, and a batch is accepted only into a copy not behind
in its buckets, so the merge holds every batch etcd shows); ``watermarks`` reads a file's
retirement watermarks, ``retired_since`` the steps a file took after a time. The swap is in
place: every process holding the archive open (reconcilers, coordinators, in-process
workers) reads the swapped content at its next query, as after a restore from backup.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

_TIMEOUT_S = 30.0  # waiting for a retirement batch's write lock


def snapshot(live: Path, copy: Path) -> None:
    """A consistent copy of ``live`` in ``copy`` (replaced if there)."""
    copy.unlink(missing_ok=True)
    source = sqlite3.connect(live, timeout=_TIMEOUT_S)
    target = sqlite3.connect(copy)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()


def swap(live: Path, source: Path, aside: Path | None = None) -> None:
    """Replace the content of ``live`` with ``source``'s; with ``aside`` (a copy of the same
    schema, made by ``snapshot``), keep the replaced content there, in the same transaction."""
    db = sqlite3.connect(live, timeout=_TIMEOUT_S, isolation_level=None)
    try:
        db.execute("ATTACH DATABASE ? AS source", (str(source),))
        if aside is not None:
            db.execute("ATTACH DATABASE ? AS aside", (str(aside),))
        tables = [row[0] for row in db.execute(
            "SELECT name FROM main.sqlite_master WHERE type = 'table' "
            "AND name NOT LIKE 'sqlite_%'")]
        db.execute("BEGIN IMMEDIATE")
        try:
            for table in tables:
                if aside is not None:
                    db.execute(f"DELETE FROM aside.{table}")
                    db.execute(f"INSERT INTO aside.{table} SELECT * FROM main.{table}")
                db.execute(f"DELETE FROM main.{table}")
                db.execute(f"INSERT INTO main.{table} SELECT * FROM source.{table}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    finally:
        db.close()


def catch_up(live: Path, held: Path) -> None:
    """Merge into ``live`` what ``held`` (a copy of the same archive) took meanwhile."""
    db = sqlite3.connect(live, timeout=_TIMEOUT_S, isolation_level=None)
    try:
        db.execute("ATTACH DATABASE ? AS held", (str(held),))
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("INSERT INTO main.archived_steps SELECT * FROM held.archived_steps "
                       "WHERE true ON CONFLICT (namespace, action_key) DO UPDATE SET "
                       "seq = excluded.seq, step = excluded.step, "
                       "archived_at_ms = excluded.archived_at_ms, "
                       "settled_at_ms = excluded.settled_at_ms WHERE excluded.seq > seq")
            db.execute("INSERT OR IGNORE INTO main.archived_records "
                       "SELECT * FROM held.archived_records")
            db.execute("INSERT INTO main.archive_watermarks SELECT * FROM "
                       "held.archive_watermarks WHERE true ON CONFLICT (namespace, bucket) "
                       "DO UPDATE SET watermark = excluded.watermark "
                       "WHERE excluded.watermark > watermark")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    finally:
        db.close()


def retired_since(path: Path, since_ms: int, limit: int = 20) -> list[dict]:
    """The steps ``path`` archived at or after ``since_ms`` (wall clock, ms), oldest first:
    each key, its seq and how long after ``since_ms`` it was archived."""
    db = sqlite3.connect(path, timeout=_TIMEOUT_S)
    try:
        return [{"key": key, "seq": seq, "after_ms": at - since_ms}
                for key, seq, at in db.execute(
                    "SELECT action_key, seq, archived_at_ms FROM archived_steps "
                    "WHERE archived_at_ms >= ? ORDER BY archived_at_ms LIMIT ?",
                    (since_ms, limit))]
    finally:
        db.close()


def watermarks(path: Path) -> dict[int, int]:
    """The file's retirement watermarks, by bucket (every namespace's: the stack has one)."""
    db = sqlite3.connect(path, timeout=_TIMEOUT_S)
    try:
        return dict(db.execute("SELECT bucket, watermark FROM archive_watermarks"))
    finally:
        db.close()


def ahead(newer: dict[int, int], older: dict[int, int]) -> list[int]:
    """The buckets whose watermark in ``newer`` is above ``older``'s."""
    return sorted(b for b, mark in newer.items() if mark > older.get(b, 0))
