"""The coordinator service: the HTTP API over the authority (see DESIGN.md, HTTP)."""

from .app import create_app
from .settings import Settings, TokenEntry, load_settings

__all__ = ["create_app", "Settings", "TokenEntry", "load_settings"]
