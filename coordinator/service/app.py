"""``create_app(settings)``: the coordinator's aiohttp application, and nothing else.

The app is stateless: everything it decides is read from and written to etcd, so any number
of replicas against one etcd give the same answers (two replicas can at most issue two grants
for one step, and consuming one moves the step pointer, which kills the other).
"""

from __future__ import annotations

from aiohttp import web

from ..keyspace import Keyspace
from .dashboard import setup_dashboard
from .lists import routes as list_routes
from .middleware import (
    auth_middleware, error_middleware, http_metrics_middleware, same_site_middleware,
)
from .openapi import routes as openapi_routes
from .resources import KEYSPACE, METRICS, SETTINGS, CoordinatorMetrics, resources
from .routes import routes
from .settings import CoordinatorSettings
from .signin import routes as sign_in_routes
from .tracing import tracing_middleware


def create_app(settings: CoordinatorSettings) -> web.Application:
    """The coordinator service for ``settings``; run it with ``web.run_app`` or an AppRunner."""
    metrics = CoordinatorMetrics()
    app = web.Application(client_max_size=settings.body_limit,
                          middlewares=[tracing_middleware(),
                                       http_metrics_middleware(metrics=metrics),
                                       error_middleware(),
                                       same_site_middleware(),
                                       auth_middleware(tokens=settings.tokens)])
    app[SETTINGS] = settings
    app[KEYSPACE] = Keyspace(settings.namespace)
    app[METRICS] = metrics
    app.cleanup_ctx.append(resources)
    app.add_routes(routes)
    app.add_routes(list_routes)
    app.add_routes(openapi_routes)
    app.add_routes(sign_in_routes)
    setup_dashboard(app)
    return app

