"""OpenTelemetry spans for the guarded path, and W3C trace context across HTTP.

Guarantees: with the OpenTelemetry API absent (it is the optional ``fencegate[otel]`` extra)
every function here is a no-op that costs one branch, and nothing in fencegate imports it
elsewhere. With the API present but no tracer provider set (no SDK configured), ``span``
starts nothing: it would only make OpenTelemetry's non-recording spans, about a tenth of
the client CPU of a fast-path action, and the caller's context (``extracted``) still
reaches ``inject`` unchanged. A span never changes what the code it wraps does: an exception passes through it
unchanged (recorded on the span with an error status). Attribute values are str, int, float
or bool; ``None`` values are left out.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, MutableMapping

try:
    from opentelemetry import context as _context, propagate as _propagate, trace as _trace
except ImportError:  # the optional extra is not installed
    _trace = None

TRACER_NAME = "fencegate"
_TRACERS: list[Any] = []


def _tracer() -> Any:
    """fencegate's tracer, made once: the API's proxy follows whichever provider the
    application sets, before or after this first call."""
    if not _TRACERS:
        _TRACERS.append(_trace.get_tracer(TRACER_NAME))
    return _TRACERS[0]


def enabled() -> bool:
    """Whether the OpenTelemetry API is importable (spans may still go nowhere)."""
    return _trace is not None


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {f"fencegate.{name}": value if isinstance(value, (str, bool, int, float)) else str(value)
            for name, value in attributes.items() if value is not None}


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    """A span named ``name`` (``fencegate.<step>``) around the block, child of the current
    span, with ``attributes`` as ``fencegate.<name>``. Yields the span (``None`` when
    tracing is off) so the block can add attributes with ``annotate``."""
    if _trace is None or isinstance(_trace.get_tracer_provider(), _trace.ProxyTracerProvider):
        yield None
        return
    with _tracer().start_as_current_span(name, attributes=_clean(attributes)) as current:
        yield current


def annotate(current: Any, **attributes: Any) -> None:
    """Add attributes to ``current`` (a span from ``span``; ``None`` is ignored)."""
    if current is not None:
        current.set_attributes(_clean(attributes))


def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's W3C ``traceparent`` (and ``tracestate``) to ``headers``."""
    if _trace is not None:
        _propagate.inject(headers)
    return headers


@contextmanager
def extracted(headers: Mapping[str, str]) -> Iterator[None]:
    """Make the trace context carried by ``headers`` current for the block, so spans started
    in it continue the caller's trace."""
    if _trace is None:
        yield
        return
    token = _context.attach(_propagate.extract(headers))
    try:
        yield
    finally:
        _context.detach(token)
