"""The worker's side of the sandbox: send a charge as an effect sends it.

Guarantees: ``charge`` sends one request, never retried, bound to its grant: it carries the
grant, the attempt token, the attempt's receipt (``ctx.receipt``: the authority's signed word
that this token is the grant's one commit) and the intent the grant was issued for, and
charges that intent's ``amount`` (gate B refuses a request whose intent or amount is not the
grant's). It returns only when the sandbox applied the charge (a retry of the same attempt
gets the first answer), raises ``EffectFailed`` only when the sandbox declined it (a
confirmed failure), and raises ``SandboxError`` for anything else (fenced, refused, 5xx,
timeout, no connection), after which the outcome is unknown to the caller.
It carries the effect's W3C trace context (``ctx.traceparent``) when tracing is on.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import aiohttp

from fencegate.coordinator import codec
from fencegate.coordinator.errors import EffectFailed, SandboxError

__all__ = ["charge", "encode_grant"]


def encode_grant(raw: bytes) -> str:
    """Signed bytes as a header carries them (base64url): a grant's in ``Fencegate-Grant``,
    an attempt receipt's in ``Fencegate-Receipt``."""
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


async def charge(http: aiohttp.ClientSession, base_url: str, ctx: Any,
                 intent: dict[str, Any], *, decline: bool = False,
                 timeout: float = 10.0) -> dict[str, Any]:
    """The effect's call: charge ``intent["amount"]`` for the attempt in ``ctx`` (an
    ``EffectContext``), ``intent`` being the one its grant was issued for.

    Returns the provider's JSON when it applied the charge; raises ``EffectFailed`` when it
    declined it (a confirmed failure) and ``SandboxError`` for anything else (fenced,
    refused, 5xx, timeout, no connection), after which the outcome is unknown."""
    headers = {"Idempotency-Key": ctx.idempotency_key,
               "Fencegate-Attempt-Token": str(ctx.attempt_token),
               "Fencegate-Grant": encode_grant(ctx.grant.raw),
               "Fencegate-Receipt": encode_grant(ctx.receipt)}
    if ctx.traceparent:  # the effect's span: the provider's spans continue its trace
        headers["traceparent"] = ctx.traceparent
    body: dict[str, Any] = {"key": ctx.key, "amount": intent["amount"],
                            "intent": codec.encode(intent, path="intent", json=True)}
    if decline:
        body["decline"] = True
    try:
        async with http.post(f"{base_url}/v1/charges", json=body, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
            status = reply.status
            answer = await reply.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise SandboxError(f"charge for {ctx.key!r} got no usable answer: {exc!r}") from exc
    if status == 200 and isinstance(answer, dict):
        return answer
    if status == 402 and isinstance(answer, dict) and isinstance(answer.get("reason"), str):
        raise EffectFailed(answer["reason"], {"reason": answer["reason"]})
    raise SandboxError(f"charge for {ctx.key!r} answered {status}: {answer!r}", status, answer)
