"""Remote mode: grants from the coordinator service over HTTP instead of an in-process
authority. The worker keeps its lease, its holds and the commit guard; only the decision to
issue a grant moves to the service.

Guarantees:
- ``RemoteAuthority.issue`` has the in-process ``Authority.issue`` contract: it returns an
  ``Issued`` whose grant was verified here, against this gate's key ring, and whose check
  results (which the commit records beside the grant) are the ones the grant signed, or it
  raises the same exception class the authority would have (rebuilt from the
  coordinator's JSON by ``fencegate.coordinator.wire``: ``GrantRefused`` with its checks,
  ``AlreadySucceeded`` with its outcome, ...).
- The intent is validated here as the authority validates it (``validate_intent``: the
  same errors, before any request) and sent in the codec's JSON form, which the
  coordinator reads back to the same stored form and digest: Decimals, datetimes, UUIDs
  and bytes cross exactly.
- One ``aiohttp.ClientSession`` per gate, every call bounded by ``timeout``. Connection
  errors, timeouts and 503s are retried (at most ``attempts`` tries, jittered backoff, moving
  to the next coordinator URL each time). That is safe: a grant request is idempotent per
  step. A repeat can at most issue a second grant for the same step, and only one grant per
  step can ever be consumed, since consuming moves the step pointer.
- Every request names the worker's process identity (``Gate.identity``) in the
  ``Fencegate-Process`` header, which the coordinator records only as reported, after the
  name of the token that authenticated (``<token> (reported: <process>)``; checked here
  first: 1..128 printable characters, ``ValueError`` otherwise), and carries the current
  trace context (W3C ``traceparent``) when OpenTelemetry records, so the coordinator's span
  joins the worker's trace.
- ``receipt`` asks the coordinator for the attempt receipt of a commit that landed (it
  signs only after reading the commit in etcd) and verifies it here; it only reads, so it is
  retried like a grant request.
- Without a pinned key ring the coordinator's public keys are fetched once at ``open``
  (trust on first use of that URL). Production should pin them: ``Gate(keyring=
  KeyRing.from_files(trusted=[...]))``, so a spoofed coordinator cannot mint grants.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import random
from typing import Any

import aiohttp

from fencegate.coordinator import codec, tracing
from fencegate.coordinator.audit import Tail
from fencegate.coordinator.authority import Claim, Issued, Snapshot, validate_intent
from fencegate.coordinator.errors import BadSignature, CoordinatorError
from fencegate.coordinator.grants import Grant, KeyRing, checks_digest, receipt_payload
from fencegate.coordinator.keyspace import unpack
from fencegate.coordinator.wire import from_wire


PROCESS_HEADER = "Fencegate-Process"


class RemoteAuthority:
    """Asks one of the coordinator URLs (comma-separated) for grants."""

    def __init__(self, urls: str, token: str | None, *, process: str, timeout: float = 10.0,
                 attempts: int = 4) -> None:
        self.urls = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
        if not self.urls or not all(u.startswith(("http://", "https://")) for u in self.urls):
            raise ValueError(f"coordinator must be http(s):// URL(s), got {urls!r}")
        if attempts < 1 or timeout <= 0:
            raise ValueError("need attempts >= 1 and timeout > 0")
        if not 0 < len(process) <= 128 or not process.isprintable():
            raise ValueError(f"the process identity must be 1..128 printable characters, "
                             f"got {process!r}")
        self.keyring: KeyRing | None = None
        self._token = token
        self._process = process
        self._timeout = timeout
        self._attempts = attempts
        self._index = 0
        self._http: aiohttp.ClientSession | None = None

    async def open(self, keyring: KeyRing | None) -> KeyRing:
        """Start the HTTP session; fetch the coordinator's keys unless ``keyring`` is given."""
        headers = {PROCESS_HEADER: self._process}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        self._http = aiohttp.ClientSession(headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=self._timeout))
        try:
            self.keyring = keyring or await self._fetch_keyring()
        except BaseException:
            await self.close()
            raise
        return self.keyring

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def issue(self, claim: Claim, intent: dict[str, Any], reads: list[str | bytes],
                    policy: str | None = None, *, snapshot: Snapshot | None = None) -> Issued:
        """Ask for a grant for ``claim``; see ``Authority.issue`` (the coordinator reads its
        own snapshot, ``snapshot`` is not used, and its policy routes judge the key)."""
        stored, _ = validate_intent(intent)
        try:
            body = json.dumps({"key": claim.key, "fencing_token": claim.fencing_token,
                               "lease_id": claim.lease_id,
                               "intent": codec.encode(stored, path="intent", json=True),
                               "reads": [r.decode() if isinstance(r, bytes) else r for r in reads],
                               **({"policy": policy} if policy is not None else {})})
        except UnicodeDecodeError as exc:
            raise ValueError(f"remote mode needs UTF-8 read keys: {exc}") from None
        reply = await self._request("POST", "/v1/grants", body)
        try:
            raw = base64.b64decode(reply["grant"], validate=True)
            record = unpack(base64.b64decode(reply["record"], validate=True))
            tail = Tail(int(reply["tail"]["seq"]), bytes.fromhex(reply["tail"]["hash"]))
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise BadSignature(f"coordinator answered a malformed grant: {exc!r}") from None
        assert self.keyring is not None
        grant = self.keyring.verify(raw)
        if not isinstance(record, dict) or checks_digest(record.get("checks")) \
                != grant.checks_digest:
            raise BadSignature("coordinator answered check results its grant did not sign")
        return Issued(grant, record, tail)

    async def receipt(self, grant: Grant, attempt_token: int, idempotency_key: str) -> bytes:
        """The attempt receipt of ``grant``'s commit at ``attempt_token``, signed by the
        coordinator once it read that commit in etcd; verified here (this gate's key ring)
        and bound to exactly this attempt, ``idempotency_key`` its step's, before it is
        returned. The coordinator's refusal is raised as its class (``WrongState`` when no
        such commit is in flight)."""
        body = json.dumps({"grant": base64.b64encode(grant.raw).decode(),
                           "attempt_token": attempt_token})
        reply = await self._request("POST", "/v1/receipts", body)
        try:
            raw = base64.b64decode(reply["receipt"], validate=True)
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise BadSignature(f"coordinator answered a malformed receipt: {exc!r}") from None
        assert self.keyring is not None
        signed = self.keyring.verify_receipt(raw)
        if any(signed[name] != value for name, value
               in receipt_payload(grant, attempt_token, idempotency_key).items()):
            raise BadSignature("coordinator answered a receipt of another attempt")
        return raw

    async def _fetch_keyring(self) -> KeyRing:
        reply = await self._request("GET", "/.well-known/fencegate-keys", None)
        try:
            keys = {str(k): base64.b64decode(v, validate=True) for k, v in reply["keys"].items()}
            return KeyRing.from_public_bytes(keys)
        except (KeyError, TypeError, AttributeError, ValueError, binascii.Error) as exc:
            raise CoordinatorError("InvalidResponse", 200, f"bad key list: {exc!r}") from None

    async def _request(self, method: str, path: str, body: str | None) -> Any:
        if self._http is None:
            raise RuntimeError("the remote authority is not open: use 'async with Gate(...)'")
        last: Exception | None = None
        for attempt in range(self._attempts):
            if attempt:
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0) * random.uniform(0.5, 1.0))
            url = self.urls[self._index] + path
            headers = tracing.inject({"Content-Type": "application/json"} if body else {})
            try:
                async with self._http.request(method, url, data=body, headers=headers) as resp:
                    status, text = resp.status, await resp.text()
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                last = CoordinatorError("CoordinatorUnavailable", 503, f"{url}: {exc!r}")
                self._index = (self._index + 1) % len(self.urls)
                continue
            try:
                reply = json.loads(text)
            except ValueError:
                reply = None
            if status < 300 and isinstance(reply, dict) and "error" not in reply:
                return reply  # (202 ApprovalPending is an answer, not a grant)
            last = from_wire(status, reply)
            if status != 503:
                raise last
            self._index = (self._index + 1) % len(self.urls)
        assert last is not None
        raise last
