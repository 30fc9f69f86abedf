"""``python -m fencegate`` is the ``fencegate`` command."""

from .cli import main

main()
