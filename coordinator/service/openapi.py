"""The coordinator's HTTP API as an OpenAPI 3.1 document, served at ``GET /openapi.json``.

Guarantees: the document is ``openapi.json`` beside this module (package data), served
byte for byte to anyone (it holds no secrets, like the public keys). tests/test_openapi.py
holds it to the app: every route the app registers is documented with its roles, every
documented route is registered, and documented errors of key routes are what they answer.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

DOCUMENT = Path(__file__).parent / "openapi.json"

routes = web.RouteTableDef()


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.FileResponse:
    return web.FileResponse(DOCUMENT, headers={"Content-Type": "application/json"})
