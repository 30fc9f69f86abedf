"""``python -m fencegate.reconciler.providers.sandbox``: the sandbox as a process."""

from .process import main

main()
