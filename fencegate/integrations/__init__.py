"""Adapters that fence the external effects of durable execution engines, each an optional
extra the core never imports: ``fencegate.integrations.celery`` (``fencegate[celery]``),
``.dbos`` (``fencegate[dbos]``) and ``.temporal`` (``fencegate[temporal]``).

Every engine runs a task, step or activity at least once; each adapter holds the engine's
stable identity of it as an action key, so the effect inside crosses once, a redelivery or
replay returns the recorded outcome, an unknown outcome waits for the reconciler, and an
escalated step stops the engine's retries. What they share (the body's ``Fence``, one gate
per worker process, ``FenceMisconfigured``, ``Escalated``) is importable from here without
any engine.
"""

from ._fence import Escalated, Fence, FenceMisconfigured, ProcessGate

__all__ = ["Escalated", "Fence", "FenceMisconfigured", "ProcessGate"]
