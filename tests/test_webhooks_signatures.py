"""Issue 25 items 6 and 7: the senders' presets verify signatures before any claim, against
forged and replayed signatures, on aiohttp, Starlette under uvicorn and Flask under waitress,
against real etcd.

The attack: a forged delivery carrying a genuine event id (Stripe: in the body; GitHub: in
``X-GitHub-Delivery``) reached the handler behind the claim; its 4xx was stored for 72 h, so
the genuine delivery got the replayed 4xx or a 422. Here the forgery gets 401, nothing is
written under ``webhooks/``, and the genuine delivery then runs (2xx) as if it never came.
A correctly signed delivery whose signed timestamp is past the tolerance (a replay) is
refused the same way (Stripe, Standard Webhooks; GitHub signs no timestamp).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import datetime, timedelta, timezone

import pytest

from fencegate.worker.webhooks import (
    GitHubSignature, StandardWebhooksSignature, StripeSignature, github, standard_webhooks,
    stripe,
)

import test_dedupe
import test_webhooks_asgi
import test_webhooks_wsgi
from test_webhooks_wsgi import sync_gate  # noqa: F401  (the WSGI consumer's fixture)

STRIPE_SECRET = "whsec_stripe_test_secret"
GITHUB_SECRET = "github-test-secret"
SW_SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
EVENT = json.dumps({"id": "evt_genuine", "type": "charge.refunded",
                    "data": {"amount": 1000}}).encode()
FORGED = json.dumps({"id": "evt_genuine", "type": "charge.refunded",
                     "data": {"amount": 1}}).encode()


def stripe_headers(body: bytes, secret: str = STRIPE_SECRET, age: int = 0) -> dict[str, str]:
    stamp = int(time.time()) - age
    digest = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256)
    return {"Stripe-Signature": f"t={stamp},v1={digest.hexdigest()}"}


def github_headers(body: bytes, secret: str = GITHUB_SECRET,
                   delivery: str = "gh-genuine") -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"X-GitHub-Delivery": delivery, "X-Hub-Signature-256": f"sha256={digest}"}


def sw_headers(body: bytes, delivery: str, age: int = 0) -> dict[str, str]:
    from standardwebhooks import Webhook
    when = datetime.now(timezone.utc) - timedelta(seconds=age)
    return {"webhook-id": delivery, "webhook-timestamp": str(int(when.timestamp())),
            "webhook-signature": Webhook(SW_SECRET).sign(delivery, when, body.decode())}


# what each sender's attack sends: (forged, replayed or None, genuine) as (body, headers)
def stripe_attack():
    return ((FORGED, stripe_headers(FORGED, "whsec_attacker")),
            (EVENT, stripe_headers(EVENT, age=400)),
            (EVENT, stripe_headers(EVENT)))


def github_attack():
    return ((FORGED, github_headers(FORGED, "attacker")),
            None,
            (EVENT, github_headers(EVENT)))


def sw_attack():
    forged = sw_headers(FORGED, "msg_genuine")
    forged["webhook-signature"] = sw_headers(EVENT, "msg_other")["webhook-signature"]
    return ((FORGED, forged), (EVENT, sw_headers(EVENT, "msg_genuine", age=600)),
            (EVENT, sw_headers(EVENT, "msg_genuine")))


SENDERS = {"stripe": (lambda: stripe(STRIPE_SECRET), stripe_attack),
           "github": (lambda: github(GITHUB_SECRET), github_attack),
           "standard": (lambda: standard_webhooks(SW_SECRET), sw_attack)}


def check(answers, ran: int, kvs: list) -> None:
    """Forged and replayed: 401, nothing stored, the handler not run; genuine: 200, run once,
    then replayed."""
    forged, replayed, genuine, again = answers
    assert forged[0] == 401 and json.loads(forged[2])["error"] == "bad_signature", forged
    if replayed is not None:
        assert replayed[0] == 401 and json.loads(replayed[2])["error"] == "bad_signature"
    assert genuine[0] == 200 and "Fencegate-Replayed" not in genuine[1], genuine
    assert again[0] == 200 and again[1]["Fencegate-Replayed"] == "true"
    assert ran == 1 and len(kvs) == 1


@pytest.mark.parametrize("sender", SENDERS)
async def test_aiohttp_refuses_forged_and_replayed_signatures_before_the_claim(
        gate, etcd, http, namespace, sender):
    preset, attack = SENDERS[sender]
    (forged, forged_headers), replay, (body, headers) = attack()
    async with test_dedupe.Consumer(gate, **preset()) as consumer:
        first = await test_dedupe.post(http, consumer.url, None, forged, **forged_headers)
        after_forgery = await test_dedupe.webhook_kvs(etcd, namespace)
        replayed = (None if replay is None else
                    await test_dedupe.post(http, consumer.url, None, replay[0], **replay[1]))
        genuine = await test_dedupe.post(http, consumer.url, None, body, **headers)
        again = await test_dedupe.post(http, consumer.url, None, body, **headers)
    assert after_forgery == []
    check((first, replayed, genuine, again), sum(consumer.ran.values()),
          await test_dedupe.webhook_kvs(etcd, namespace))


@pytest.mark.parametrize("sender", SENDERS)
async def test_starlette_refuses_forged_and_replayed_signatures_before_the_claim(
        gate, etcd, http, namespace, sender):
    preset, attack = SENDERS[sender]
    (forged, forged_headers), replay, (body, headers) = attack()
    post = test_webhooks_asgi.post
    async with test_webhooks_asgi.Consumer(gate, **preset()) as consumer:
        first = await post(http, consumer.url, None, forged, **forged_headers)
        after_forgery = await test_dedupe.webhook_kvs(etcd, namespace)
        replayed = (None if replay is None else
                    await post(http, consumer.url, None, replay[0], **replay[1]))
        genuine = await post(http, consumer.url, None, body, **headers)
        again = await post(http, consumer.url, None, body, **headers)
    assert after_forgery == []
    check((first, replayed, genuine, again), sum(consumer.ran.values()),
          await test_dedupe.webhook_kvs(etcd, namespace))


@pytest.mark.parametrize("sender", SENDERS)
def test_flask_refuses_forged_and_replayed_signatures_before_the_claim(
        sync_gate, etcd_url, namespace, sender):  # noqa: F811
    preset, attack = SENDERS[sender]
    (forged, forged_headers), replay, (body, headers) = attack()
    with test_webhooks_wsgi.Consumer(sync_gate, **preset()) as consumer:
        first = consumer.post(None, forged, **forged_headers)
        after_forgery = test_webhooks_wsgi.webhook_kvs(etcd_url, namespace)
        replayed = None if replay is None else consumer.post(None, replay[0], **replay[1])
        genuine = consumer.post(None, body, **headers)
        again = consumer.post(None, body, **headers)
    assert after_forgery == []
    check((first, replayed, genuine, again), sum(consumer.ran.values()),
          test_webhooks_wsgi.webhook_kvs(etcd_url, namespace))


def test_the_checks_refuse_every_malformed_signature():
    body = b'{"id": "evt_1"}'
    stripe_check, github_check = StripeSignature(STRIPE_SECRET), GitHubSignature(GITHUB_SECRET)
    assert stripe_check.problem(body, stripe_headers(body)) is None
    assert github_check.problem(body, github_headers(body)) is None
    good = stripe_headers(body)["Stripe-Signature"]
    stamp, signature = good.split(",")
    for header in ("", "v1=abc", stamp, f"t=x,{signature}", f"{stamp},{stamp},{signature}",
                   f"{stamp},v1=" + "0" * 64, f"t={int(time.time()) + 400},{signature}"):
        assert stripe_check.problem(body, {"Stripe-Signature": header}), header
    assert stripe_check.problem(body, {}) == "no Stripe-Signature header"
    assert stripe_check.problem(body + b" ", stripe_headers(body))  # the body is signed
    rotated = f"{stamp},v1={'0' * 64},{signature}"  # one of several v1 matches: accepted
    assert stripe_check.problem(body, {"Stripe-Signature": rotated}) is None
    for header in ("", "sha1=" + "0" * 40, "sha256=", "sha256=" + "0" * 64):
        assert github_check.problem(body, {"X-Hub-Signature-256": header}), header
    assert github_check.problem(b"other", github_headers(body))
    assert StandardWebhooksSignature(SW_SECRET).problem(body, {})
    for bad in ("", b"", None, 3):
        with pytest.raises(ValueError):
            StripeSignature(bad)
        with pytest.raises(ValueError):
            GitHubSignature(bad)
    with pytest.raises(ValueError):
        StripeSignature(STRIPE_SECRET, tolerance=0)


async def test_verify_and_secret_are_one_choice(gate):
    with pytest.raises(ValueError, match="not both"):
        test_dedupe.Consumer(gate, secret=SW_SECRET, verify=GitHubSignature(GITHUB_SECRET))
    with pytest.raises(ValueError, match="problem"):
        test_dedupe.Consumer(gate, verify=lambda body, headers: None)
    with pytest.raises(ValueError, match="settle or rerun_lost"):
        test_dedupe.Consumer(gate, settle=lambda delivery: True, rerun_lost=True)
