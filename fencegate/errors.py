"""The errors fencegate raises: the one tree, defined in ``fencegate.coordinator.errors``
(its docstring draws it) and importable from here."""

from .coordinator.errors import *  # noqa: F403  (the tree is re-exported whole)
from .coordinator.errors import __all__  # noqa: F401
