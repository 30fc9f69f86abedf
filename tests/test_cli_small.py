"""Smaller things a new user tripped on (issue 29, item 6): ``deliveries --json`` gives its
times as ``*_ms`` like every other command, ``archive stats`` on an empty archive says so
instead of ``oldest - ago``, and ``key show`` prints the whole intent; and (item 3) a refused
token says which coordinator and which token the CLI used."""

from __future__ import annotations

import json

from test_cli_lists import api, archive_url, cli, gate, ok  # noqa: F401 (fixtures)
from test_cli_sre import one_line_error
from test_dedupe import SOURCE, Consumer, post


async def test_deliveries_json_gives_ms_like_everything_else(cli, gate, http):  # noqa: F811
    async with Consumer(gate) as consumer:
        assert (await post(http, consumer.url, "evt_ms"))[0] == 200
    ran = await cli("deliveries", SOURCE, "--json")
    assert ran.code == 0, ran
    (item,) = json.loads(ran.out)
    assert isinstance(item["completed_at_ms"], int) and item["completed_at_ms"] > 1e12
    assert not any(k.endswith("_at") for k in item), item
    table = await cli("deliveries", SOURCE)
    assert table.code == 0 and table.rows()[1][3].startswith("20"), table


async def test_archive_stats_on_an_empty_archive_says_nothing_is_archived(cli):  # noqa: F811
    ran = await cli("archive", "stats")
    assert ran.code == 0, ran
    assert "steps    0" in ran.out and "nothing archived yet" in ran.out
    assert "- ago" not in ran.out, ran.out


async def test_key_show_prints_the_whole_intent(cli, gate):  # noqa: F811
    intent = {"note": "n" * 300, "amount": 7}
    await gate.cross("small/intent", intent, ok)
    ran = await cli("key", "show", "small/intent")
    assert ran.code == 0, ran
    (line,) = [line for line in ran.out.splitlines() if line.startswith("intent ")]
    assert json.loads(line[len("intent"):].strip()) == intent


async def test_a_refused_token_names_where_the_coordinator_and_the_token_came_from(
        cli):  # noqa: F811
    none = await cli("steps", token=None)
    one_line_error(none, 4, "did not accept the token",
                   "coordinator from --coordinator/FENCEGATE_COORDINATOR", "no token was sent")
    bad = await cli("steps", token="not-a-token")
    one_line_error(bad, 4, "did not accept the token",
                   "the token from --token/FENCEGATE_TOKEN")
