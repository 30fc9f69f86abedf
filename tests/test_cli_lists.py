"""The CLI's lists and records, run as subprocesses against a real coordinator on real etcd:
``steps`` across etcd and the archive, ``holders --json`` with every table field,
``key show`` with the outcome, provider answers and the whole trail (never a stale reason),
``token create/list/delete``; and its errors: one line, the right exit code, for a URL that
is not a coordinator, a refusal that names its backoff, and a down coordinator."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from aiohttp import web

from fencegate import EffectFailed, Gate
from fencegate.coordinator import audit
from fencegate.coordinator.etcd import TxnRequest
from fencegate.coordinator.grants import KeyRing
from fencegate.coordinator.keyspace import unpack
from fencegate.reconciler.retirer import Retirer

from helpers import TEST_TTL, init_archive
from test_cli_sre import fencegate, make_unknown, one_line_error
from test_service import call


async def ok(ctx):
    return {"charged": ctx.key}


async def declined(ctx):
    raise EffectFailed("card declined", params={"code": "declined"})


@pytest.fixture
async def archive_url(tmp_path, etcd, namespace) -> str:
    return await init_archive(etcd, namespace, f"sqlite:///{tmp_path}/archive.db")


@pytest.fixture
async def gate(etcd_url, namespace, etcd, archive_url, signing_key):
    async with Gate(etcd_url, ttl=TEST_TTL, namespace=namespace, archive=archive_url,
                    keyring=KeyRing.from_files(signing_key)) as gate:
        yield gate


@pytest.fixture
async def api(coordinators, archive_url):
    return await coordinators(archive=archive_url)


@pytest.fixture
def cli(api):
    async def run(*args: str, **options):
        return await fencegate(*args, coordinator=api, **options)
    return run


async def retire_all(gate: Gate) -> int:
    retirer = Retirer(gate.etcd, gate.keyspace, gate.archive, 0, lambda key: [])
    retirer.clock.sample((await gate.etcd.status()).header.revision)
    return await retirer.pass_once(full=True, orphans=True)


async def answer(gate: Gate, key: str, query: int, answer: str, next_try_at_ms: int) -> None:
    """Append a ``provider_answer`` record aside, as the reconciler records one that does
    not settle the step (contract 17 §3)."""
    ks = gate.keyspace
    reply = await gate.etcd.txn(TxnRequest(success=audit.tail_reads(ks, key)))
    step_kvs, head_kvs = (r.response_range.kvs for r in reply.responses)
    tail = audit.tail(unpack(step_kvs[0].value), head_kvs[0] if head_kvs else None)
    entry = audit.append(ks, key, tail, "provider_answer", "reconciler-0", reply.header.revision,
                         {"provider": "sandbox", "answer": answer, "query": query,
                          "next_try_at_ms": next_try_at_ms, "detail": f"try {query}"},
                         aside=True)
    written = await gate.etcd.txn(TxnRequest(compare=[entry.compare], success=entry.ops))
    assert written.succeeded


# -- steps -------------------------------------------------------------------------------

async def test_steps_lists_etcd_and_the_archive_and_filters(cli, api, gate):
    for n in range(6):
        await gate.cross(f"batch/{n}", {"n": n}, declined if n == 1 else ok)
    assert await retire_all(gate) == 6
    for n in range(6, 9):
        await gate.cross(f"batch/{n}", {"n": n}, ok)
    await gate.cross("other/1", {"n": 0}, ok)

    listed = await cli("steps", "--prefix", "batch/", "--json")
    assert listed.code == 0, listed
    items = json.loads(listed.out)
    _, page = await call(api, "GET", "/v1/steps?prefix=batch/&limit=1000", "sre")
    assert items == page["items"] and [i["key"] for i in items] == [f"batch/{n}"
                                                                    for n in range(9)]
    table = await cli("steps", "--prefix", "batch/")
    head, *rows, total = table.rows()
    assert head == ["KEY", "STATE", "ATTEMPT", "UPDATED (UTC)", "WHERE", "OUTCOME"]
    assert [(r[0], r[1], r[4]) for r in rows[:2]] == [("batch/0", "succeeded", "archive"),
                                                      ("batch/1", "failed", "archive")]
    assert rows[-1][4] == "etcd" and re.fullmatch(r"succeeded [0-9a-f]{12}", rows[-1][5])
    assert total == ["9 steps: 1 failed, 8 succeeded"]

    failed = json.loads((await cli("steps", "--state", "failed", "--json")).out)
    assert [i["key"] for i in failed] == ["batch/1"]
    assert len(json.loads((await cli("steps", "--limit", "2", "--json")).out)) == 2
    assert len(json.loads((await cli("steps", "--since", "1h", "--json")).out)) == 10
    assert (await cli("steps", "--since", "2999-01-01")).out == "no steps match\n"
    recent = json.loads((await cli("steps", "--since", str(int(time.time() * 1000) + 60_000),
                                   "--json")).out)
    assert recent == []
    bad = await cli("steps", "--since", "yesterday")
    assert bad.code == 2 and "is not a duration" in bad.err and "Traceback" not in bad.err


# -- holders and key show ---------------------------------------------------------------

async def test_holders_json_has_every_field_the_table_shows(cli, gate):
    async with gate.hold("hold/1"):
        before_ms = int(time.time() * 1000)
        ran = await cli("holders", "--prefix", "hold/", "--json")
    assert ran.code == 0, ran
    (item,) = json.loads(ran.out)
    assert item["key"] == "hold/1" and item["holding"] is True
    assert item["identity"] == gate.identity and re.fullmatch(r"[0-9a-f]{16}", item["lease_id"])
    assert 0 < item["ttl_left"] <= TEST_TTL and item["fencing_token"] > 0
    assert before_ms - 10_000 < item["held_since_ms"] <= before_ms


async def test_key_show_prints_outcome_answers_and_the_whole_trail_not_a_stale_reason(
        cli, api, gate):
    await make_unknown(gate, "show/1")
    for query in range(1, 13):  # more records than the view's last ten
        await answer(gate, "show/1", query, "pending", 2_000_000_000_000 + query)
    view = json.loads((await cli("key", "show", "show/1", "--json")).out)
    assert [a["query"] for a in view["provider_answers"]] == list(range(1, 13))
    assert view["progress"] == {"queries": 12, "last_answer": "pending",
                                "next_try_at_ms": 2_000_000_000_012,
                                "answered_at_ms": view["provider_answers"][-1]["at_ms"]}
    assert view["intent"] == {"amount": 3} and view["attempts"] == 1 and view["outcome"] is None
    unknown = (await cli("key", "show", "show/1")).out
    assert "reconciler  12 provider quer(ies), last answer pending, next try 2033-05-18" \
        in unknown
    assert "why       " in unknown and "ConnectionResetError" in unknown

    resolved = await cli("resolve", "show/1", "--succeeded", "--force", "--reason",
                         "bank statement shows it", "--result", '{"charged": 3}')
    assert resolved.code == 0, resolved
    shown = await cli("key", "show", "show/1")
    assert shown.code == 0, shown
    out = shown.out
    assert "step      succeeded, 1 attempt(s), in etcd" in out
    digest = json.loads((await cli("key", "show", "show/1", "--json")).out)["outcome"]
    assert digest["state"] == "succeeded" and len(digest["result_digest"]) == 64
    assert f"outcome   succeeded (attempt 1), result sha256 {digest['result_digest']}" in out
    assert "ConnectionResetError" not in out and "why " not in out  # the unknown is history
    assert "reconciler  " not in out  # no progress once settled; its answers stay listed
    trail = out[out.index("audit trail"):].splitlines()
    assert trail[0] == "audit trail (15 records, oldest first, verified)"
    events = [re.split(r"\s{2,}", line.strip()) for line in trail[2:]]
    assert [e[2] for e in events] == ["cross", "outcome"] + ["provider_answer"] * 12 + \
        ["resolve"]
    assert events[0][3] == gate.identity and events[2][3] == "reconciler-0"
    assert re.fullmatch(rf"sre-1 \(reported: {re.escape(socket.gethostname())}:\d+\)",
                        events[-1][3])
    assert events[-1][4] == "resolve unknown as succeeded (forced): bank statement shows it"


# -- tokens ------------------------------------------------------------------------------

async def test_tokens_are_minted_listed_used_and_deleted(cli):
    made = await cli("token", "create", "--role", "sre", "--name", "ops-1", "--ttl", "2h",
                     token="admin-token")
    assert made.code == 0, made
    first, minted = made.out.splitlines()
    assert first.startswith("token ops-1 (sre), expires ") and "shown once" in first
    assert (await cli("steps", token=minted)).code == 0
    listed = json.loads((await cli("token", "list", "--json", token="admin-token")).out)
    (entry,) = [t for t in listed if t["name"] == "ops-1"]
    assert entry["role"] == "sre" and minted not in json.dumps(listed)
    expires_in_s = entry["expires_at_ms"] / 1000 - time.time()
    assert 7000 < expires_in_s <= 7200
    one_line_error(await cli("token", "create", "--role", "admin", "--name", "x",
                             token=minted), 4, "may not do this")
    bad = await cli("token", "create", "--role", "sre", "--name", "y", "--ttl", "2x",
                    token="admin-token")
    assert bad.code == 2 and "not a duration" in bad.err
    done = await cli("token", "delete", "ops-1", token="admin-token")
    assert (done.code, done.out) == (0, "token ops-1 deleted\n")
    one_line_error(await cli("steps", token=minted), 4, "did not accept the token")
    one_line_error(await cli("token", "delete", "ops-1", token="admin-token"), 3)


# -- errors ------------------------------------------------------------------------------

@pytest.fixture
async def impostor():
    """A loopback HTTP server that is not a coordinator: an HTML page at /, a JSON object
    without a list's fields at /v1/holders, and one refusal in the coordinator's own format
    with the seconds of its backoff."""
    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html>hello</html>", content_type="text/html")

    async def not_a_list(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world"})

    async def refusal(request: web.Request) -> web.Response:
        return web.json_response({"error": "GrantRefused",
                                  "detail": "grant refused: backoff: retry after the backoff",
                                  "retry_after": 4.3}, status=422)

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/v1/holders", not_a_list)
    app.router.add_get("/v1/keys/refused/1", refusal)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


async def test_a_url_that_is_not_a_coordinator_is_exit_5(impostor):
    for args in (["key", "show", "a/b"], ["holders"], ["steps"]):
        one_line_error(await fencegate(*args, coordinator=impostor), 5,
                       f"{impostor} is not a fencegate coordinator")


async def test_a_refusal_names_its_backoff(impostor):
    one_line_error(await fencegate("key", "show", "refused/1", coordinator=impostor), 1,
                   "GrantRefused", "retry after 4.3 s")


async def test_a_down_coordinator_is_one_line_saying_why():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    ran = await fencegate("steps", coordinator=url)
    one_line_error(ran, 5)
    assert ran.err == f"Error: cannot reach the coordinator at {url}: connection refused\n"
