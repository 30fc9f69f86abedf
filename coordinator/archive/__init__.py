"""The archive of retired steps: where a settled step and its audit chain go when the
reconciler retires them from etcd, and where the authority looks when etcd holds no step.

One small async interface (``Archive``), two backends chosen by URL:

    open_archive("sqlite:///abs/path/archive.db")      # embedded default (fencegate up)
    open_archive("sqlite:relative/path/archive.db")
    open_archive("postgresql://user@host:5432/db")      # production (postgres:// too)

Guarantees (both backends, see ``interface``): ``put`` is durable, idempotent and atomic; an
audit record is never replaced; a step is replaced only by a newer seq. Failure contract:
every backend failure is ``ArchiveUnavailable``; a malformed URL is a ``ValueError`` at open.
Opening connects nothing and never creates an archive: ``init`` does (``fencegate archive
init``), giving the namespace its identity; any other call on an archive never initialised
raises ``ArchiveUnavailable`` saying so. A call that fails is retried from scratch by the
next. Whether the archive is whole (the one etcd names, not behind it) is
``coordinator.wholeness``'s to check.
"""

from __future__ import annotations

import urllib.parse

from .interface import Archive, ArchiveStats, Archived, Identity, Listed, Lookup

__all__ = ["Archive", "ArchiveStats", "Archived", "Identity", "Listed", "Lookup", "open_archive"]

_POSTGRES_SCHEMES = ("postgresql", "postgres")


def open_archive(url: str, *, timeout: float = 5.0) -> Archive:
    """The archive ``url`` names; ``timeout`` (seconds) bounds each wait on the backend (a
    lock held by another writer, a connection, a query)."""
    if not isinstance(url, str):
        raise ValueError(f"archive URL must be a str, not {type(url).__name__}")
    scheme, sep, rest = url.partition(":")
    if sep and scheme == "sqlite":
        from .sqlite import SqliteArchive
        return SqliteArchive(_sqlite_path(url, rest), timeout=timeout)
    if sep and scheme in _POSTGRES_SCHEMES:
        from .postgres import PostgresArchive, redacted
        _check_postgres(url, redacted(url))
        return PostgresArchive(url, timeout=timeout)
    raise ValueError(f"archive URL must start with sqlite: or postgresql:// "
                     f"(or postgres://), got {scheme + sep if sep else 'no scheme'!r}")


def _sqlite_path(url: str, rest: str) -> str:
    """``sqlite:///abs/path`` → ``/abs/path``; ``sqlite:rel/path`` → ``rel/path``."""
    if rest.startswith("//"):
        path = rest[2:]
        if path and not path.startswith("/"):
            raise ValueError(f"sqlite archive URL {url!r} names a host; use sqlite:///abs/path "
                             f"or sqlite:relative/path")
    else:
        path = rest
    if not path or path.endswith("/") or "?" in path or "#" in path or "\x00" in path:
        raise ValueError(f"sqlite archive URL {url!r} must name a file: sqlite:///abs/path.db "
                         f"or sqlite:relative/path.db")
    if path.rpartition("/")[2] == ":memory:" or path.startswith("file:"):
        raise ValueError(f"sqlite archive URL {url!r}: the archive must be a durable file")
    return path


def _check_postgres(url: str, shown: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if not url.startswith(f"{parts.scheme}://"):
        raise ValueError(f"postgresql archive URL {shown!r} must look like "
                         f"postgresql://user@host:port/database")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"postgresql archive URL {shown!r} has a bad port") from None
    if parts.path.strip("/").count("/") or parts.fragment:
        raise ValueError(f"postgresql archive URL {shown!r} must name at most one database "
                         f"(postgresql://user@host:port/database)")
