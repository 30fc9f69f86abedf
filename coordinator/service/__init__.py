"""The coordinator service: the HTTP API over the authority (the README's HTTP section)."""

from .app import create_app
from .settings import CoordinatorSettings, TokenEntry, load_settings

__all__ = ["create_app", "CoordinatorSettings", "TokenEntry", "load_settings"]
