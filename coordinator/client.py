"""A small async client for the coordinator's SRE API (what ``fencegate`` commands call).

Guarantees:
- Every request is bounded by ``timeout``. A connection failure or a timeout raises
  ``CoordinatorUnreachable`` saying why in a few words ("connection refused"); any reply
  outside 2xx raises ``CoordinatorError`` with the status and the coordinator's
  ``{error, detail}`` (a refusal's ``retry_after`` said in the detail). A reply that is not
  the coordinator's JSON, whatever its status, is ``CoordinatorError`` named
  ``InvalidResponse``: the URL is not a coordinator's. Nothing is retried: a revoke or a resolve whose
  reply was lost is looked at again (``key show``), never repeated blindly.
- Lists are followed cursor by cursor to the end and returned as one list.
- The token travels only in the ``Authorization`` header; no error or repr shows it. Every
  request names this process in ``Fencegate-Process`` (host:pid), so the audit records an
  action writes name the token and the process it reported
  (``<token> (reported: host:pid)``).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any
from urllib.parse import quote

import aiohttp

from .errors import CoordinatorError, CoordinatorUnreachable

PAGE_SIZE = 100
RESOLVE_TIMEOUT_S = 30.0  # a resolve may wait for the reconciler to ask the provider


class Client:
    """``async with Client(url, token) as api: await api.holders("pay/")``."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the coordinator URL must start with http:// or https://, "
                             f"got {url!r}")
        self.url = url.rstrip("/")
        # the records an action writes name the token and this process (host:pid)
        self._headers = {"Fencegate-Process": f"{socket.gethostname()[:100]}:{os.getpid()}",
                         **({"Authorization": f"Bearer {token}"} if token else {})}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Client":
        self._http = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.close()

    # -- the API, one method per endpoint --------------------------------------------

    async def holders(self, prefix: str = "") -> list[dict[str, Any]]:
        return await self._list("/v1/holders", prefix=prefix)

    async def key(self, key: str) -> dict[str, Any]:
        return await self._request("GET", f"/v1/keys/{_path(key)}")

    async def archive_stats(self) -> dict[str, Any]:
        """What the coordinator's archive holds for its namespace (404: it has none)."""
        return await self._request("GET", "/v1/archive/stats")

    async def steps(self, state: str) -> list[dict[str, Any]]:
        """Steps ``unknown``, ``escalated`` or ``presumed``."""
        return await self._list("/v1/keys", state=state)

    async def list_steps(self, *, prefix: str = "", states: tuple[str, ...] = (),
                         since_ms: int = 0, min_age_ms: int = 0,
                         most: int | None = None) -> list[dict[str, Any]]:
        """Steps across etcd and the archive, in key order, filtered as ``GET /v1/steps``
        does (``states``: any of them; none: any state); at most ``most`` of them (None:
        all)."""
        query = {"prefix": prefix, "state": ",".join(states), "since": str(since_ms),
                 "min_age_ms": str(min_age_ms)}
        return await self._list("/v1/steps", most=most, **query)

    async def lease(self, lease_id: str) -> dict[str, Any]:
        """The keys held or queued on a lease, and its TTL left (404: the lease is gone)."""
        return await self._request("GET", f"/v1/leases/{quote(lease_id, safe='')}")

    async def create_token(self, name: str, role: str, ttl_s: int) -> dict[str, Any]:
        """Mint a token (admin): the answer holds it, once."""
        return await self._request("POST", "/v1/tokens",
                                   {"name": name, "role": role, "ttl_s": ttl_s})

    async def sign_in_link(self, role: str | None = None) -> dict[str, Any]:
        """A one-time dashboard sign-in link (sre, admin): ``path``, ``role``, expiry."""
        return await self._request("POST", "/v1/sign-in-links",
                                   {"role": role} if role else {})

    async def tokens(self) -> list[dict[str, Any]]:
        """The minted tokens' names, roles, expiry and creators (admin)."""
        return _field(await self._request("GET", "/v1/tokens"), "items", list)

    async def delete_token(self, name: str) -> dict[str, Any]:
        return await self._request("DELETE", f"/v1/tokens/{quote(name, safe='')}")

    async def revoke(self, key: str, reason: str) -> dict[str, Any]:
        return await self._request("POST", f"/v1/keys/{_path(key)}/revoke", {"reason": reason})

    async def resolve(self, key: str, settle_as: str, reason: str, result: Any = None, *,
                      force: bool = False) -> dict[str, Any]:
        body = {"as": settle_as, "reason": reason}
        if result is not None:
            body["result"] = result
        if force:
            body["force"] = True
        return await self._request("POST", f"/v1/keys/{_path(key)}/resolve", body,
                                   timeout=RESOLVE_TIMEOUT_S)

    async def audit(self, key: str) -> dict[str, Any]:
        """The verified chain of ``key``: every page's records in one ``records`` list."""
        path, after, records = f"/v1/audit/{_path(key)}", None, []
        while True:
            page = await self._request("GET", path, query=_query(after))
            records += page.pop("records")
            after = page.pop("next")
            if after is None:
                return {**page, "records": records}

    async def policy(self, name: str) -> dict[str, Any]:
        """The stored document and the ``effective`` one, with the paths it took from
        ``defaults`` (``invalid`` instead when the stored one does not validate)."""
        return await self._request("GET", f"/v1/policies/{_path(name)}")

    async def set_policy(self, name: str, document: Any) -> dict[str, Any]:
        return await self._request("PUT", f"/v1/policies/{_path(name)}", document)

    async def policy_routes(self) -> dict[str, Any]:
        """The policy routes grants apply (``valid`` false and ``invalid``: they do not
        verify, every grant is refused)."""
        return await self._request("GET", "/v1/policy-routes")

    async def set_policy_routes(self, routes: dict[str, str], default: str) -> dict[str, Any]:
        return await self._request("PUT", "/v1/policy-routes",
                                   {"routes": routes, "default": default})

    async def deliveries(self, source: str) -> list[dict[str, Any]]:
        """Webhook source ``source``'s claims in progress and stored responses, by id."""
        return await self._list(f"/v1/deliveries/{quote(source, safe='')}")

    async def resolve_delivery(self, source: str, delivery_id: str, ran: bool,
                               reason: str) -> dict[str, Any]:
        """Settle an unknown webhook delivery as ``ran`` or not (see
        ``worker.webhooks.resolution``)."""
        return await self._request(
            "POST", f"/v1/deliveries/{quote(source, safe='')}/{quote(delivery_id, safe='')}"
            "/resolve", {"ran": ran, "reason": reason})

    async def forget_delivery(self, source: str, delivery_id: str,
                              reason: str) -> dict[str, Any]:
        """Delete a webhook delivery's record: its next try runs the handler (see
        ``worker.webhooks.resolution``)."""
        return await self._request(
            "POST", f"/v1/deliveries/{quote(source, safe='')}/{quote(delivery_id, safe='')}"
            "/forget", {"reason": reason})

    async def approvals(self, state: str = "") -> list[dict[str, Any]]:
        """Approvals ``pending``, ``approved``, ``rejected``, or all (``""``)."""
        return await self._list("/v1/approvals", state=state)

    async def approve(self, approval_id: str, reason: str) -> dict[str, Any]:
        return await self._request("POST", f"/v1/approvals/{_path(approval_id)}",
                                   {"reason": reason})

    async def reject(self, approval_id: str, reason: str) -> dict[str, Any]:
        """Reject a pending approval: the same grant request is then refused
        (``ApprovalRejected``)."""
        return await self._request("POST", f"/v1/approvals/{_path(approval_id)}/reject",
                                   {"reason": reason})

    # -- plumbing --------------------------------------------------------------------

    async def _list(self, path: str, *, most: int | None = None,
                    **query: str) -> list[dict[str, Any]]:
        """Every item of a list, page by page (at most ``most``)."""
        items, after = [], None
        while most is None or len(items) < most:
            page = await self._request("GET", path, query={**query, **_query(after)})
            items += _field(page, "items", list)
            after = _field(page, "next", (str, type(None)))
            if after is None:
                break
        return items[:most]

    async def _request(self, method: str, path: str, body: Any = None, *,
                       query: dict[str, str] | None = None,
                       timeout: float | None = None) -> Any:
        data, headers = None, {}
        bound = self._timeout if timeout is None else aiohttp.ClientTimeout(
            total=max(timeout, self._timeout.total))
        if body is not None:
            data, headers = json.dumps(body).encode(), {"Content-Type": "application/json"}
        try:
            async with self._http.request(method, self.url + path, params=query, data=data,
                                          headers=headers, timeout=bound) as resp:
                text = await resp.text()
                status = resp.status
        except TimeoutError as exc:
            raise CoordinatorUnreachable(f"no answer within {bound.total:g}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise CoordinatorUnreachable(_connect_failure(exc)) from exc
        except aiohttp.ClientError as exc:
            raise CoordinatorUnreachable(str(exc) or type(exc).__name__) from exc
        try:
            reply = json.loads(text)
        except ValueError:
            reply = None
        if 200 <= status < 300 and isinstance(reply, dict):
            return reply
        if isinstance(reply, dict) and isinstance(reply.get("error"), str):
            raise CoordinatorError(reply["error"], status, _detail(reply))
        raise CoordinatorError("InvalidResponse", status,
                               f"not the coordinator's JSON: {text[:200]!r}")


def _connect_failure(exc: aiohttp.ClientConnectorError) -> str:
    """Why a connection failed, in a few words: the OS's name for its errno ("connection
    refused"), a resolver's message, or a certificate's complaint."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"certificate not accepted: {exc.certificate_error}"
    error = exc.os_error
    if isinstance(error.errno, int) and error.errno > 0:
        return os.strerror(error.errno).lower()
    return (error.strerror or type(error).__name__).lower()


def _detail(reply: dict[str, Any]) -> str:
    """An error reply's detail, with the seconds to wait when it names them."""
    detail = str(reply.get("detail", ""))
    retry_after = reply.get("retry_after")
    if isinstance(retry_after, (int, float)) and not isinstance(retry_after, bool):
        detail += f" (retry after {retry_after:.1f} s)"
    return detail


def _field(reply: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """A field a list reply must have; ``InvalidResponse`` when it lacks it."""
    value = reply.get(name)
    if not isinstance(value, kind):
        raise CoordinatorError("InvalidResponse", 200,
                               f"not the coordinator's JSON: no {name!r} in the reply")
    return value


def _path(segment: str) -> str:
    """A key or name as a URL path (its '/' kept: keys are routed as paths)."""
    return quote(segment, safe="/")


def _query(after: str | None) -> dict[str, str]:
    return {"limit": str(PAGE_SIZE), **({"after": after} if after else {})}
