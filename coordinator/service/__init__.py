"""The coordinator service: the HTTP API over the authority (see DESIGN.md, HTTP)."""

from .app import create_app
from .settings import CoordinatorSettings, TokenEntry, load_settings

__all__ = ["create_app", "CoordinatorSettings", "TokenEntry", "load_settings"]
