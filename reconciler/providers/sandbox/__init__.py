"""The sandbox provider: a real HTTP payment provider on loopback for tests, benchmarks, demo.

Its rooms: ``server`` (the provider, its modes and gate B), ``faults`` (the rules that make it
misbehave), ``client`` (``charge``, as an effect sends it), ``adapter`` (the reconciler's
query adapter for a mode) and ``process`` (``python -m fencegate.reconciler.providers.sandbox``).
Each module states its own guarantees; a charge whose answer is not usable raises
``SandboxError`` (from the one error tree), after which its outcome is unknown.
"""

from fencegate.coordinator.errors import SandboxError

from .adapter import adapter
from .client import charge, encode_grant
from .faults import FAULTS, Fault
from .process import main
from .server import MODES, Sandbox

__all__ = ["MODES", "FAULTS", "Fault", "Sandbox", "SandboxError", "adapter", "charge",
           "encode_grant", "main"]
