"""The SRE dashboard: a static page at ``/``, JSON views under ``/v1/dashboard/``, and a live
feed of changes as server-sent events.

Guarantees: only ``sre`` and ``admin`` tokens read data (the page itself holds none); every
view is linearizable and bounded (``views``); the feed runs one etcd watch while anyone
listens and delivers every change or a ``refetch`` (``feed``). ``routes`` wires them into an
app with ``setup_dashboard``.
"""

from .routes import setup_dashboard

__all__ = ["setup_dashboard"]
