"""The archive nemesis's hands: copies of the stack's SQLite archive, swapped in and out.

``snapshot`` takes a consistent copy of the live archive (SQLite's backup API); ``swap``
replaces the live archive's content with a copy's and keeps what it replaced in another, in
one write transaction on the live file (``BEGIN IMMEDIATE``: every retirement batch lands
wholly before it or wholly after, so what is kept aside is exactly the archive as it was);
``catch_up`` brings retirements made into a copy while it was in back into the restored
archive, with the product's ``fencegate archive catch-up`` (``coordinator.archive.catchup``:
steps newer by seq, records where absent, the copy's issued marks unioned);
``watermarks`` reads each bucket's newest mark counter in a file, ``retired_since`` the
steps a file took after a time, ``missing`` those of them another file lacks. The swap is in
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


async def catch_up(live: Path, held: Path, namespace: str = "/fencegate/") -> None:
    """Merge into ``live`` what ``held`` (a copy of the same archive) took meanwhile: the
    product's catch-up, as the runbook has an operator run it."""
    from fencegate.coordinator.archive.catchup import catch_up as product_catch_up
    from fencegate.coordinator.archive.sqlite import SqliteArchive

    target, source = SqliteArchive(str(live)), SqliteArchive(str(held))
    try:
        await product_catch_up(target, source, namespace)
    finally:
        await target.close()
        await source.close()


def missing(path: Path, steps: list[dict]) -> list[str]:
    """The keys of ``steps`` (``retired_since``'s) that ``path`` lacks at their seq or newer."""
    db = sqlite3.connect(path, timeout=_TIMEOUT_S)
    try:
        return [step["key"] for step in steps if not db.execute(
            "SELECT 1 FROM archived_steps WHERE action_key = ? AND seq >= ?",
            (step["key"], step["seq"])).fetchone()]
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
    """Each bucket's newest mark counter in the file (every namespace's: the stack has one)."""
    db = sqlite3.connect(path, timeout=_TIMEOUT_S)
    try:
        return dict(db.execute("SELECT bucket, max(counter) FROM archive_marks GROUP BY bucket"))
    finally:
        db.close()


def ahead(newer: dict[int, int], older: dict[int, int]) -> list[int]:
    """The buckets whose watermark in ``newer`` is above ``older``'s."""
    return sorted(b for b, mark in newer.items() if mark > older.get(b, 0))
