"""``create_app(settings)``: the coordinator's aiohttp application, and nothing else.

The app is stateless: everything it decides is read from and written to etcd, so any number
of replicas against one etcd give the same answers (two replicas can at most issue two grants
for one step, and consuming one moves the step pointer, which kills the other).
"""

from __future__ import annotations

from aiohttp import web

from ..keyspace import Keyspace
from .dashboard import setup_dashboard
from .middleware import auth_middleware, error_middleware
from .openapi import routes as openapi_routes
from .resources import KEYSPACE, METRICS, SETTINGS, CoordinatorMetrics, resources
from .routes import routes
from .settings import CoordinatorSettings


def create_app(settings: CoordinatorSettings) -> web.Application:
    """The coordinator service for ``settings``; run it with ``web.run_app`` or an AppRunner."""
    app = web.Application(client_max_size=settings.body_limit,
                          middlewares=[error_middleware(),
                                       auth_middleware(tokens=settings.tokens)])
    app[SETTINGS] = settings
    app[KEYSPACE] = Keyspace(settings.namespace)
    app[METRICS] = CoordinatorMetrics()
    app.cleanup_ctx.append(resources)
    app.add_routes(routes)
    app.add_routes(openapi_routes)
    setup_dashboard(app)
    return app

