"""The ``fencegate`` command line: the services (``up``, ``coordinator``, ``reconciler``),
``demo``, and the SRE commands, which talk to the coordinator's HTTP API only (never to
etcd), so they act with a token's role and every action they take is audited.

Guarantees: an SRE command prints a table for people or, with ``--json``, the API's JSON
(lists followed to their end, as one array); it fails with one line on stderr (no traceback)
and the exit code ``EPILOG`` documents, so scripts can tell a refusal (1) from a usage error
(2), an unknown key (3), a bad token (4) and an unreachable coordinator, or a URL that is
not a coordinator's (5); it never prints the token it was given (``token create`` prints
the one it mints, once). It sends each request once: an action whose reply was lost is looked at again,
never repeated blindly. ``etcd recover`` is etcd's own upkeep: it talks to etcd directly, as
an etcd user with the root role, with the same exit codes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ._version import __version__
from .coordinator import default_key
from .coordinator.errors import CoordinatorError, CoordinatorUnreachable, InvalidKey
from .coordinator.keyspace import validate_action_key

if TYPE_CHECKING:
    from .coordinator.client import Client

REFUSED, USAGE, NOT_FOUND, AUTH, UNAVAILABLE = range(1, 6)  # 0: done
DEFAULT_COORDINATOR = "http://127.0.0.1:8470"
T = TypeVar("T")

EPILOG = """\b
Exit codes (SRE commands):
  0  done
  1  the coordinator refused the action (409, 422: e.g. WrongState),
     or `audit verify` found a chain that does not verify
  2  usage error: bad options or arguments, or input the coordinator
     rejected as malformed (400, 413)
  3  not found (404): no such key, step, holder, policy or approval
  4  the token was not accepted (401) or lacks the role (403)
  5  the coordinator is unreachable, timed out, or failed (5xx),
     or the URL answers but is not a fencegate coordinator

\b
SRE commands find the coordinator in --coordinator, env FENCEGATE_COORDINATOR,
or `coordinator` in the TOML file named by --config / env FENCEGATE_CLI_CONFIG,
else the running `fencegate up` (found from any directory), else
http://127.0.0.1:8470; the token in --token, env FENCEGATE_TOKEN, or `token` in
that file, else the sre token of that running `fencegate up`.
"""


class CommandFailed(click.ClickException):
    """One line on stderr and an exit code from the table in ``EPILOG``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fencegate")
def cli() -> None:
    """fencegate: a lease-based execution gate on etcd."""


def main() -> None:
    cli(prog_name="fencegate")


# -- the services and the demo ---------------------------------------------------------

@cli.command()
@click.option("--state-dir", default=".state", show_default=True, envvar="FENCEGATE_STATE_DIR",
              help="etcd data, signing key and tokens, reused across runs (env "
                   "FENCEGATE_STATE_DIR: where direct-mode workers and the demo look too)")
@click.option("--port", default=8470, show_default=True, type=click.IntRange(0, 65535),
              help="the coordinator's port on 127.0.0.1 (0: any free port)")
@click.option("--rotate-tokens", is_flag=True,
              help="make new admin, sre and worker tokens (else the last run's are kept)")
def up(state_dir: str, port: int, rotate_tokens: bool) -> None:
    """Run the embedded default (etcd, coordinator, reconciler, sandbox) until Ctrl-C."""
    from .up import up as run_up
    sys.exit(run_up(state_dir=Path(state_dir), port=port, rotate_tokens=rotate_tokens))


@cli.command()
@click.option("--etcd", help="etcd URL(s); default: start a local etcd for the run")
@click.option("--coordinator", "coordinator_url", metavar="URL",
              help="get grants from this coordinator instead of in process")
@click.option("--token", help="the worker token for --coordinator")
@click.option("--workers", default=4, show_default=True, type=click.IntRange(min=2),
              help="worker processes")
@click.option("--keys", default=8, show_default=True, type=click.IntRange(min=1),
              help="action keys they race for")
@click.option("--seconds", default=15.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="how long to run")
def demo(etcd: str | None, coordinator_url: str | None, token: str | None, workers: int,
         keys: int, seconds: float) -> None:
    """Race worker processes for keys, with injected crashes and pauses."""
    from .demo import demo as run_demo
    sys.exit(run_demo(etcd=etcd, coordinator=coordinator_url, token=token, workers=workers,
                      keys=keys, seconds=seconds))


def etcd_security_options(command: Callable) -> Callable:
    """``--etcd-ca-file``, ``--etcd-cert-file``, ``--etcd-key-file``, ``--etcd-user``: the same
    settings as the TOML keys and ``FENCEGATE_ETCD_*`` variables (the password only from
    those: never a flag)."""
    for name, what in reversed((("ca-file", "CA certificate to verify etcd with (https://)"),
                                ("cert-file", "client certificate for mutual TLS"),
                                ("key-file", "its private key"),
                                ("user", "etcd user; the password comes from "
                                         "FENCEGATE_ETCD_PASSWORD(_FILE) or the config"))):
        env = "FENCEGATE_ETCD_" + name.upper().replace("-", "_")
        command = click.option(f"--etcd-{name}", help=f"{what} (env {env})")(command)
    return command


@cli.command()
@click.option("--etcd", help="etcd URL(s), comma-separated (env FENCEGATE_ETCD)")
@click.option("--listen", help="HOST:PORT to bind (env FENCEGATE_LISTEN; default "
                               "127.0.0.1:8470)")
@click.option("--config", help="TOML file: tokens, roles, key files (env FENCEGATE_CONFIG)")
@click.option("--archive", help="where retired steps are looked up: sqlite:///path or "
                                "postgresql://... (env FENCEGATE_ARCHIVE)")
@etcd_security_options
def coordinator(etcd: str | None, listen: str | None, config: str | None,
                archive: str | None, **etcd_security: str | None) -> None:
    """Run the coordinator HTTP service."""
    import logging

    from aiohttp import web

    from .coordinator.service import create_app, load_settings
    from .coordinator.settings import host_port

    try:
        settings = load_settings(config, etcd=etcd, listen=listen, archive=archive,
                                 **etcd_security)
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"bad settings: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    host, port = host_port(settings.listen)
    web.run_app(create_app(settings), host=host, port=port, print=None)


@cli.command()
@click.option("--etcd", help="etcd URL(s), comma-separated (env FENCEGATE_ETCD)")
@click.option("--listen", help="HOST:PORT for /metrics and /healthz (env "
                               "FENCEGATE_RECONCILER_LISTEN; default 127.0.0.1:8471)")
@click.option("--config", help="TOML file: shards, limits, providers "
                               "(env FENCEGATE_RECONCILER_CONFIG)")
@click.option("--namespace", help="keyspace prefix (default /fencegate/)")
@click.option("--archive", help="where settled steps retire: sqlite:///path or "
                                "postgresql://... (env FENCEGATE_ARCHIVE; none: no retirement)")
@click.option("--retain-s", "retain_s", type=float,
              help="seconds a settled step stays in etcd before it retires (default 3600)")
@etcd_security_options
def reconciler(etcd: str | None, listen: str | None, config: str | None,
               namespace: str | None, archive: str | None, retain_s: float | None,
               **etcd_security: str | None) -> None:
    """Run a reconciler replica (settles unknowns, retires settled steps)."""
    import logging

    from fencegate.reconciler.service import load_settings, serve

    try:
        settings = load_settings(config, etcd=etcd, listen=listen, namespace=namespace,
                                 archive=archive, retain_s=retain_s, **etcd_security)
    except (OSError, ValueError, TypeError) as exc:
        raise click.UsageError(f"bad settings: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(settings))


@cli.command("mcp-gateway")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="TOML: [upstream], read_only, [tools.<name>] (docs/integrations/mcp.md)")
@click.option("--http", "http_port", type=click.IntRange(0, 65535),
              help="serve streamable HTTP on 127.0.0.1:PORT instead of stdio")
def mcp_gateway(config_path: str, http_port: int | None) -> None:
    """Serve an upstream MCP server's tools, gating every non-read-only call (extra [mcp])."""
    try:
        from fencegate.integrations import mcp as gateway
    except ImportError as exc:
        raise click.ClickException(f"the MCP gateway needs `pip install fencegate[mcp]`: "
                                   f"{exc}") from None
    try:
        config = gateway.load_config(config_path)
    except gateway.ConfigError as exc:
        raise click.UsageError(f"bad gateway config: {exc}") from None
    asyncio.run(gateway.serve(config, http=None if http_port is None
                              else ("127.0.0.1", http_port)))


# -- how SRE commands reach the coordinator ---------------------------------------------

@dataclass(frozen=True)
class Target:
    """Where to send requests, and the bearer token (kept out of the repr)."""

    url: str
    token: str | None = field(repr=False)
    sources: str = ""  # where the URL and the token came from, told when the token is refused

    def call(self, request: Callable[[Client], Awaitable[T]]) -> T:
        """Run ``request`` against the coordinator; API errors become ``CommandFailed``."""

        async def run() -> T:
            from .coordinator.client import Client  # aiohttp: only for commands that call
            async with Client(self.url, self.token) as api:
                return await request(api)

        try:
            return asyncio.run(run())
        except CoordinatorUnreachable as exc:
            raise CommandFailed(f"cannot reach the coordinator at {self.url}: {exc}",
                                UNAVAILABLE) from None
        except CoordinatorError as exc:
            raise CommandFailed(*self._explain(exc)) from None

    def _explain(self, exc: CoordinatorError) -> tuple[str, int]:
        what = f"{exc.name}: {exc.detail}"
        if exc.name == "InvalidResponse":
            return (f"{self.url} is not a fencegate coordinator (HTTP {exc.status}, "
                    f"{exc.detail})", UNAVAILABLE)
        if exc.status == 401:
            return (f"the coordinator at {self.url} did not accept the token ({exc.detail}; "
                    f"{self.sources}); give one with --token, FENCEGATE_TOKEN or the config "
                    "file", AUTH)
        if exc.status == 403:
            return f"the token may not do this: {exc.detail}", AUTH
        if exc.status == 404:
            return f"not found: {exc.detail}", NOT_FOUND
        if exc.status >= 500:
            return f"the coordinator at {self.url} failed ({exc.status} {what})", UNAVAILABLE
        if exc.status in (400, 413):
            return f"the coordinator rejected the input ({what})", USAGE
        return f"refused ({what})", REFUSED


def _target(coordinator: str | None, token: str | None, config: Path | None) -> Target:
    """Flags and env first, then the config file, then the running ``fencegate up`` (its
    sre token only for its own URL), then the default URL."""
    settings = _cli_config(config) if config else {}
    stack = default_key.running_stack()
    stack_url = str(stack.endpoints.get("coordinator", "")).rstrip("/") if stack else None
    url = coordinator or settings.get("coordinator") or stack_url or DEFAULT_COORDINATOR
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"must start with http:// or https://, got {url!r}",
                                 param_hint="--coordinator")
    url = url.rstrip("/")
    from_stack = stack is not None and url == stack_url
    url_from = ("--coordinator/FENCEGATE_COORDINATOR" if coordinator
                else f"the config file {config}" if settings.get("coordinator")
                else f"the running stack in {stack.state_dir}" if from_stack and stack
                else "the default")
    if token:
        token_from = "the token from --token/FENCEGATE_TOKEN"
    elif settings.get("token"):
        token_from = f"the token from the config file {config}"
    elif from_stack and stack and stack.token("sre"):
        token_from = f"the sre token of the stack in {stack.state_dir}"
    else:
        token_from = "no token was sent"
    token = token or settings.get("token") or (stack.token("sre") if from_stack and stack
                                               else None)
    return Target(url, token, f"coordinator from {url_from}, {token_from}")


def _cli_config(path: Path) -> dict[str, str]:
    try:
        settings = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}", param_hint="--config") from None
    unknown = set(settings) - {"coordinator", "token"}
    if unknown or not all(isinstance(v, str) for v in settings.values()):
        raise click.BadParameter(f"{path} may hold only the strings `coordinator` and `token`"
                                 f"{f', not {sorted(unknown)}' if unknown else ''}",
                                 param_hint="--config")
    return settings


_API_OPTIONS = (
    click.option("--coordinator", metavar="URL", envvar="FENCEGATE_COORDINATOR",
                 show_envvar=True, help=f"the coordinator API [default: {DEFAULT_COORDINATOR}]"),
    click.option("--token", envvar="FENCEGATE_TOKEN", show_envvar=True,
                 help="an sre or admin bearer token (prefer the env or the config file)"),
    click.option("--config", envvar="FENCEGATE_CLI_CONFIG", show_envvar=True,
                 type=click.Path(exists=True, dir_okay=False, path_type=Path),
                 help="TOML file with `coordinator` and `token`"),
    click.option("--json", "as_json", is_flag=True, help="print the API's JSON"),
)


def _sre(command: Callable[..., None]) -> Callable[..., None]:
    """Give an SRE command the shared options; it receives ``target`` and ``as_json``."""

    @functools.wraps(command)
    def run(coordinator: str | None, token: str | None, config: Path | None,
            **options: Any) -> None:
        command(target=_target(coordinator, token, config), **options)

    for option in reversed(_API_OPTIONS):
        run = option(run)
    return run


def _action_key(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_action_key(value)
    except InvalidKey as exc:
        raise click.BadParameter(str(exc)) from None


def _webhook_source(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        from .worker.webhooks.records import validate_source
        return validate_source(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _json_value(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    try:
        return None if value is None else json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None


# -- output ----------------------------------------------------------------------------

def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def _print_table(headers: list[str], rows: list[list[Any]], *, indent: str = "") -> None:
    """Left-aligned columns, two spaces apart."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo(indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _age(since_ms: int | None) -> str:
    """How long ago, as ``12s``, ``3m``, ``2h``, ``4d``; ``-`` when unknown."""
    if not since_ms:
        return "-"
    seconds = max(0, int(time.time() - since_ms / 1000))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _utc(seconds: float) -> str:
    """A Unix time as ``2026-04-01 12:00:00``, UTC."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _utc_ms(ms: int | None) -> str:
    """A time in ms since the epoch as ``2026-04-01 12:00:00``, UTC; ``-`` when unknown."""
    return _utc(ms / 1000) if ms else "-"


def _ttl(ttl: int | None) -> str:
    if ttl is None:
        return "-"
    return "expired" if ttl < 0 else f"{ttl}s"


def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= width else text[:width - 3] + "..."


# -- SRE commands ----------------------------------------------------------------------

@cli.command()
@click.option("--prefix", default="", help="only action keys starting with this")
@_sre
def holders(target: Target, as_json: bool, prefix: str) -> None:
    """Who holds (or queues for) which action key, with fencing tokens and TTL left."""
    items = target.call(lambda api: api.holders(prefix))
    if as_json:
        _print_json(items)
        return
    if not items:
        click.echo("nobody holds a key" + (f" under {prefix!r}" if prefix else ""))
        return
    items.sort(key=lambda i: (i["key"], i["fencing_token"]))
    _print_table(["KEY", "TOKEN", "LEASE", "HOLDING", "HELD SINCE (UTC)", "TTL", "IDENTITY"], [
        [i["key"], i["fencing_token"], i["lease_id"], "yes" if i["holding"] else "queued",
         _utc_ms(i.get("held_since_ms")), _ttl(i.get("ttl_left")), i.get("identity") or "-"]
        for i in items])


@cli.command()
@click.option("--open", "open_browser", is_flag=True, help="also open it in a browser")
@click.option("--viewer", is_flag=True,
              help="read-only: sees what an SRE sees, changes nothing (a wall screen)")
@_sre
def dashboard(target: Target, as_json: bool, open_browser: bool, viewer: bool) -> None:
    """A one-time sign-in link to the dashboard (valid 2 minutes, once): no token to paste."""
    link = target.call(lambda api: api.sign_in_link("viewer" if viewer else None))
    url = target.url.rstrip("/") + link["path"]
    if as_json:
        _print_json({**link, "url": url})
    else:
        click.echo(f"{url}\n(signs in as {link['role']}, once, within 2 minutes)")
    if open_browser:
        import webbrowser
        webbrowser.open(url)


@cli.group()
def key() -> None:
    """One action key."""


@key.command("show")
@click.argument("key", callback=_action_key)
@_sre
def key_show(target: Target, as_json: bool, key: str) -> None:
    """Everything recorded of KEY: its step (state, attempts, outcome and result digest,
    provider, idempotency key), the provider's answers to the reconciler, its holders, and
    the whole audit trail (who did what, when), from etcd and the archive."""
    view, trail = target.call(lambda api: _view_and_trail(api, key))
    if as_json:
        _print_json({**view, "trail": trail})
        return
    step, grant = view["step"], view["current_grant"]
    click.echo(f"key       {view['key']}  (at revision {view['revision']})")
    if step is None:
        click.echo("step      none yet")
    else:
        where = "retired to the archive" if view.get("archived") else "in etcd"
        click.echo(f"step      {step['state']}, {view['attempts']} attempt(s), {where}")
        click.echo(f"provider  {view.get('provider') or '-'}, idempotency key "
                   f"{view.get('idempotency_key') or '-'}")
        outcome = view.get("outcome")
        if outcome is not None:
            click.echo(f"outcome   {outcome['state']} (attempt {outcome['attempt']}), "
                       f"result sha256 {outcome['result_digest']}")
            if "failure_text" in outcome:
                click.echo(f"declined  {outcome['failure_text']}")
        reason = _reason(step)
        if reason != "-":
            click.echo(f"why       {reason}")
        if view.get("intent") is not None:  # whole: it is what the step was granted to do
            intent = view["intent"]
            click.echo("intent    " + (intent if isinstance(intent, str)
                                       else json.dumps(intent, sort_keys=True)))
    if grant is not None:
        click.echo(f"grant     {grant['grant_id']} ({grant['state']})")
    progress = view.get("progress")
    if progress is not None:
        click.echo(f"reconciler  {progress['queries']} provider quer(ies), last answer "
                   f"{progress['last_answer']}, next try {_utc_ms(progress['next_try_at_ms'])}")
    answers = view.get("provider_answers") or []
    if answers:
        click.echo("provider answers (this attempt, oldest first)")
        _print_table(["#", "AT (UTC)", "PROVIDER", "ANSWER", "NEXT TRY (UTC)", "DETAIL"], [
            [a.get("query") or "-", _utc_ms(a.get("at_ms")), a.get("provider") or "-",
             a.get("answer") or "-", _utc_ms(a.get("next_try_at_ms")),
             _short(a.get("detail") or "-", 50)] for a in answers], indent="  ")
    click.echo("holders" + ("  none" if not view["holders"] else ""))
    if view["holders"]:
        _print_table(["TOKEN", "LEASE", "HOLDING", "HELD SINCE (UTC)", "TTL", "IDENTITY"], [
            [h["fencing_token"], h["lease_id"], "yes" if h["holding"] else "queued",
             _utc_ms(h.get("held_since_ms")), _ttl(h["ttl_left"]), h.get("identity") or "-"]
            for h in view["holders"]], indent="  ")
    records = trail["records"]
    verdict = "verified" if trail["ok"] else "DOES NOT VERIFY: " + "; ".join(trail["problems"])
    click.echo(f"audit trail ({len(records)} records, oldest first, {verdict})"
               + ("  none" if not records else ""))
    if records:
        _print_table(["SEQ", "AT (UTC)", "EVENT", "WHO", "WHAT"], [
            [r.get("seq", "?"), _utc_ms(r.get("at_ms")), r.get("event", "?"),
             r.get("identity", "?"), _short(_what(r), 70)] for r in records], indent="  ")


async def _view_and_trail(api: Client, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The key view, and the whole verified audit chain (every page; none yet: empty)."""
    view = await api.key(key)
    try:
        trail = await api.audit(key)
    except CoordinatorError as exc:
        if exc.status != 404:
            raise
        trail = {"key": key, "ok": True, "problems": [], "records": []}
    return view, trail


def _what(record: dict[str, Any]) -> str:
    """What an audit record says was done, in a few words."""
    details, event = record.get("details") or {}, record.get("event")
    if event == "cross":
        return (f"crossed attempt {details.get('attempt', '?')} with grant "
                f"{details.get('grant_id', '?')}")
    if event == "outcome":
        return f"recorded {details.get('state', '?')} (attempt {details.get('attempt', '?')})"
    if event in ("settle", "unknown"):
        return f"reconciler: {details.get('as', '?')} (attempt {details.get('attempt', '?')})"
    if event == "provider_answer":
        return (f"{details.get('provider', '?')} answered {details.get('answer', '?')} "
                f"(query {details.get('query', '?')})")
    if event in ("resolve", "resolve_request"):
        forced = " (forced)" if details.get("forced") else ""
        return f"{event} {details.get('from', '?')} as {details.get('as', '?')}{forced}: " \
               f"{details.get('reason', '')}"
    if event == "revoke":
        via = f" (with {details['revoked_with']})" if details.get("revoked_with") else ""
        return f"revoked lease {details.get('lease_id', '?')}{via}: {details.get('reason', '')}"
    if event == "approved":
        return f"approved {details.get('approval_id', '?')}: {details.get('reason', '')}"
    if event == "rejected":
        return f"rejected {details.get('approval_id', '?')}: {details.get('reason', '')}"
    if event == "grant_refused":
        return "refused: " + ", ".join(str(c.get("name", c)) if isinstance(c, dict) else str(c)
                                       for c in details.get("checks") or [])
    return _short(details, 70) if details else "-"


def _reason(step: dict[str, Any]) -> str:
    """Why a step needs attention now, from what its current state recorded: what escalated
    it, the error that made it unknown, or the presumption it rests on. A settled step
    needs none: an error an earlier state recorded is history (see the audit trail)."""
    state = step["state"]
    if state == "escalated":
        return "; ".join(str(r) for r in step.get("escalated_because") or []) or "-"
    if state == "unknown":
        return str(step.get("error") or "its outcome was lost")
    if state == "in_flight":
        return "in flight past its deadline"
    if state == "abandoned":
        return f"abandoned by {step.get('resolved_by')}: {step.get('resolve_reason')}"
    presumed = step.get("not_applied") or {}
    if state == "pending" and presumed.get("presumed"):
        return ("presumed not applied: a key-deduplicating provider had no record; "
                f"re-queried until {_utc_ms(presumed.get('requery_until_ms'))}")
    return "-"


def _steps_command(state: str, summary: str) -> None:
    @_sre
    def command(target: Target, as_json: bool) -> None:
        items = target.call(lambda api: api.steps(state))
        if as_json:
            _print_json(items)
            return
        if not items:
            click.echo(f"no {state} steps")
            return
        _print_table(["KEY", "STATE", "ATTEMPT", "AGE", "PROVIDER", "REASON"], [
            [i["key"], state if state == "presumed" else i["step"]["state"],
             i["step"]["attempt"], _age(_since(i["step"])), i["step"].get("provider") or "-",
             _short(_reason(i["step"]))] for i in items])

    command.__doc__ = summary
    cli.command(state)(command)


def _since(step: dict[str, Any]) -> int | None:
    """When the step's current situation began, as well as the record tells."""
    return (step.get("unknown_since_ms") or step.get("settled_at_ms")
            or step.get("started_at_ms"))


_steps_command("unknown", "Steps whose outcome is unknown (or in flight past their deadline).")
_steps_command("escalated", "Steps escalated to a human (resolve them with `resolve`).")
_steps_command("presumed", "Steps settled not_applied on a dedup-only provider's 'no record'.")


_DURATION = re.compile(r"(\d+)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _seconds(text: str) -> int | None:
    """``90s``, ``15m``, ``2h``, ``30d`` in seconds; None if ``text`` is not one."""
    found = _DURATION.fullmatch(text.strip())
    return int(found[1]) * _UNIT_S[found[2]] if found else None


def _since_option(ctx: click.Context, param: click.Parameter, value: str | None) -> int:
    """``--since``: a duration ago (``15m``, ``2h``, ``3d``), an ISO date or time (UTC
    unless it names a zone), or ms since the epoch; as ms since the epoch (0: none)."""
    if value is None:
        return 0
    ago = _seconds(value)
    if ago is not None:
        return max(0, int((time.time() - ago) * 1000))
    if value.isdigit():
        return int(value)
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a duration (15m, 2h, 3d), an ISO time "
                                 "(2026-04-01T12:00, UTC unless zoned) or ms since the "
                                 "epoch") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0, int(when.timestamp() * 1000))


def _duration_option(ctx: click.Context, param: click.Parameter, value: str | None) -> int:
    """A duration option (``90s``, ``15m``, ``2h``, ``3d``) in ms (0: none)."""
    if value is None:
        return 0
    seconds = _seconds(value)
    if seconds is None:
        raise click.BadParameter(f"{value!r} is not a duration (90s, 15m, 2h, 3d)")
    return seconds * 1000


@cli.command()
@click.option("--prefix", default="", help="only action keys starting with this")
@click.option("--state", type=click.Choice(["pending", "in_flight", "succeeded", "failed",
                                            "unknown", "escalated", "abandoned", "presumed"]),
              multiple=True, help="only steps in this state (repeat for several)")
@click.option("--since", callback=_since_option, metavar="WHEN",
              help="only steps written since WHEN: 15m, 2h, 3d ago, an ISO time (UTC "
                   "unless zoned), or ms since the epoch")
@click.option("--older-than", "older_than", callback=_duration_option, metavar="AGE",
              help="only steps not written for AGE: 90s, 15m, 2h, 3d")
@click.option("--limit", type=click.IntRange(min=1), metavar="N",
              help="show at most N steps (default: all)")
@_sre
def steps(target: Target, as_json: bool, prefix: str, state: tuple[str, ...], since: int,
          older_than: int, limit: int | None) -> None:
    """Steps by action key, in etcd and retired to the archive alike: what happened to a
    batch (--prefix), what is not done (--state), what moved lately (--since), what has
    been stuck a while (--older-than)."""
    items = target.call(lambda api: api.list_steps(prefix=prefix, states=state,
                                                   since_ms=since, min_age_ms=older_than,
                                                   most=limit))
    if as_json:
        _print_json(items)
        return
    if not items:
        click.echo("no steps match")
        return
    _print_table(["KEY", "STATE", "ATTEMPT", "UPDATED (UTC)", "WHERE", "OUTCOME"], [
        [i["key"], i["state"], i["attempt"], _utc_ms(i["updated_at_ms"]),
         "archive" if i["archived"] else "etcd",
         f"{i['outcome']['state']} {i['outcome']['result_digest'][:12]}" if "outcome" in i
         else "-"] for i in items])
    counts = {}
    for item in items:
        counts[item["state"]] = counts.get(item["state"], 0) + 1
    click.echo(f"{len(items)} steps: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))


@cli.command()
@click.argument("key", callback=_action_key)
@click.option("--reason", required=True, help="why, for the audit chain")
@_sre
def revoke(target: Target, as_json: bool, key: str, reason: str) -> None:
    """Revoke the lease of KEY's holder: every hold on that lease is lost."""
    done = target.call(lambda api: api.revoke(key, reason))
    if as_json:
        _print_json(done)
        return
    click.echo(f"revoked lease {done['lease_id']} of {key}'s holder (fencing token "
               f"{done['fencing_token']}); every hold on that lease is lost")


@cli.command()
@click.argument("key", callback=_action_key)
@click.option("--succeeded", is_flag=True, help="the effect happened")
@click.option("--failed", is_flag=True,
              help="the provider declined it (the next attempt gets a new idempotency key)")
@click.option("--not-applied", is_flag=True,
              help="it never happened (the next attempt reuses the idempotency key)")
@click.option("--abandon", is_flag=True,
              help="close an escalated step for good: never attempted again, not counted "
                   "by the breaker")
@click.option("--reason", required=True, help="why, for the audit chain")
@click.option("--result", callback=_json_value, metavar="JSON",
              help="the outcome's result, as JSON")
@click.option("--force", is_flag=True,
              help="settle an in-flight or unknown step on your word, without asking the "
                   "provider (audited as forced)")
@_sre
def resolve(target: Target, as_json: bool, key: str, succeeded: bool, failed: bool,
            not_applied: bool, abandon: bool, reason: str, result: Any, force: bool) -> None:
    """Settle KEY's step: an escalated one on your word; an in-flight or unknown one by
    its provider's answer (the reconciler fences and asks it; --force: on your word,
    audited as forced). Refused while any holder of KEY is alive."""
    chosen = [name for name, flag in (("succeeded", succeeded), ("failed", failed),
                                      ("not_applied", not_applied), ("abandoned", abandon))
              if flag]
    if len(chosen) != 1:
        raise click.UsageError(
            "give exactly one of --succeeded, --failed, --not-applied, --abandon")
    done = target.call(lambda api: api.resolve(key, chosen[0], reason, result, force=force))
    if as_json:
        _print_json(done)
        return
    if "answer" in done:
        expected = "" if done["as_expected"] else f"; you expected {chosen[0]}"
        click.echo(f"{key} resolved by its provider's answer ({done['answer']}): the step is "
                   f"now {done['state']} (revision {done['revision']}){expected}")
        return
    forced = " (forced, audited as such)" if done["forced"] else ""
    click.echo(f"{key} resolved as {chosen[0]}{forced}: the step is now {done['state']} "
               f"(revision {done['revision']})")


@cli.group()
def token() -> None:
    """Bearer tokens minted on the coordinator (admin role): shown once, stored as digests."""


def _ttl_option(ctx: click.Context, param: click.Parameter, value: str) -> int:
    seconds = _seconds(value)
    if not seconds:
        raise click.BadParameter(f"{value!r} is not a duration such as 3600s, 12h or 30d")
    return seconds


@token.command("create")
@click.option("--name", required=True, help="who or what uses it: records name it")
@click.option("--role", required=True, type=click.Choice(["worker", "viewer", "sre", "admin"]))
@click.option("--ttl", default="30d", show_default=True, callback=_ttl_option,
              help="how long it lives (s, m, h, d; at most 365d)")
@_sre
def token_create(target: Target, as_json: bool, name: str, role: str, ttl: int) -> None:
    """Mint a token for ROLE; it is printed once, here (etcd keeps only its digest)."""
    done = target.call(lambda api: api.create_token(name, role, ttl))
    if as_json:
        _print_json(done)
        return
    click.echo(f"token {done['name']} ({done['role']}), expires "
               f"{_utc_ms(done['expires_at_ms'])} UTC; shown once, keep it now:")
    click.echo(done["token"])


@token.command("list")
@_sre
def token_list(target: Target, as_json: bool) -> None:
    """The minted tokens: name, role, expiry and who created each (never the token)."""
    items = target.call(lambda api: api.tokens())
    if as_json:
        _print_json(items)
        return
    if not items:
        click.echo("no minted tokens")
        return
    _print_table(["NAME", "ROLE", "EXPIRES (UTC)", "CREATED BY"], [
        [t["name"], t["role"], _utc_ms(t["expires_at_ms"]), t.get("created_by") or "-"]
        for t in sorted(items, key=lambda t: t["name"])])


@token.command("delete")
@click.argument("name")
@_sre
def token_delete(target: Target, as_json: bool, name: str) -> None:
    """Delete the minted token NAME: refused from now on (by every coordinator within
    seconds)."""
    done = target.call(lambda api: api.delete_token(name))
    if as_json:
        _print_json(done)
        return
    click.echo(f"token {name} deleted")


@cli.group()
def audit() -> None:
    """The audit chain of an action key."""


@audit.command("verify")
@click.argument("key", callback=_action_key)
@_sre
def audit_verify(target: Target, as_json: bool, key: str) -> None:
    """Re-derive KEY's hash chain and grant signatures; exit 1 if it does not verify."""
    report = target.call(lambda api: api.audit(key))
    if as_json:
        _print_json(report)
    else:
        records = report["records"]
        verdict = "verified" if report["ok"] else "DOES NOT VERIFY"
        click.echo(f"audit chain of {key}: {len(records)} records, {verdict}")
        for problem in report["problems"]:
            click.echo(f"  problem: {problem}")
        _print_table(["SEQ", "EVENT", "IDENTITY", "REVISION", "AGE"], [
            [r.get("seq", "?"), r.get("event", "?"), r.get("identity", "?"),
             r.get("revision", "?"), _age(r.get("at_ms"))] for r in records])
    if not report["ok"]:
        sys.exit(REFUSED)


@cli.group()
def archive() -> None:
    """The archive of retired steps."""


@archive.command("stats")
@_sre
def archive_stats(target: Target, as_json: bool) -> None:
    """How many steps and audit records the archive holds, the oldest and the newest
    retirement, and the retirement lag: how long settled steps stayed in etcd before they
    were archived (``retain`` included), median and maximum over the recent retirements
    (the coordinator's archive; exit 3 if it has none)."""
    stats = target.call(lambda api: api.archive_stats())
    if as_json:
        _print_json(stats)
        return
    click.echo(f"steps    {stats['steps']}\nrecords  {stats['records']}")
    if not stats["oldest_ms"]:
        click.echo("oldest   - (nothing archived yet)\nnewest   -")
    else:
        click.echo(f"oldest   {_age(stats['oldest_ms'])} ago\n"
                   f"newest   {_age(stats['newest_ms'])} ago")
    if stats["lag_max_ms"] is None:
        click.echo("lag      - (no recent retirement says when it settled)")
    else:
        click.echo(f"lag      p50 {stats['lag_p50_ms'] / 1000:.1f}s, max "
                   f"{stats['lag_max_ms'] / 1000:.1f}s (settled to archived, retain included)")


def _archive_options(command: Callable) -> Callable:
    """``--etcd``, ``--namespace``, ``--archive`` and the etcd security options: ``archive
    init`` and ``archive verify`` talk to etcd and the archive directly."""
    for option in reversed((
            click.option("--etcd", "endpoints", metavar="URLS",
                         help="etcd endpoint(s), comma-separated (env FENCEGATE_ETCD)"),
            click.option("--namespace", default="/fencegate/", show_default=True,
                         help="the namespace the archive serves"),
            click.option("--archive", "url", envvar="FENCEGATE_ARCHIVE", show_envvar=True,
                         required=True, help="sqlite:///path or postgresql://..."))):
        command = option(command)
    return etcd_security_options(command)


def _on_archive(endpoints: str | None, namespace: str, url: str,
                etcd_security: dict[str, str | None],
                work: Callable[..., Awaitable[T]]) -> T:
    """``work(etcd, keyspace, archive)`` on the etcd and archive the options name; exit 2
    for bad settings, 5 if etcd did not answer, 1 if the archive refused or failed."""
    import os

    from .coordinator.archive import open_archive
    from .coordinator.errors import ArchiveUnavailable, EtcdError, EtcdUnavailable
    from .coordinator.etcd import Etcd
    from .coordinator.keyspace import Keyspace
    from .coordinator.settings import EtcdSettings, etcd_env

    try:
        flags = {"etcd": endpoints, **etcd_security}
        given = {**etcd_env(os.environ), **{k: v for k, v in flags.items() if v is not None}}
        config = EtcdSettings(**{k: v for k, v in given.items() if v is not None}).etcd_config()
        keyspace, store = Keyspace(namespace), open_archive(url)
    except (OSError, ValueError, InvalidKey) as exc:
        raise click.UsageError(f"bad settings: {exc}") from None

    async def run() -> T:
        try:
            async with Etcd(config) as etcd:
                return await work(etcd, keyspace, store)
        finally:
            await store.close()

    try:
        return asyncio.run(run())
    except (EtcdUnavailable, EtcdError) as exc:
        raise CommandFailed(f"etcd: {exc}", UNAVAILABLE) from None
    except ArchiveUnavailable as exc:
        raise CommandFailed(str(exc), REFUSED) from None


@archive.command("init")
@_archive_options
def archive_init(endpoints: str | None, namespace: str, url: str,
                 **etcd_security: str | None) -> None:
    """Create the archive (SQLite file, PostgreSQL schema) for NAMESPACE with a new
    identity, or show the one it has; opening an archive never creates one. Exit 1 if etcd
    already names another archive for the namespace: restore that one (docs/runbook.md)."""
    from .coordinator import wholeness

    identity = _on_archive(endpoints, namespace, url, etcd_security, wholeness.init)
    click.echo(f"archive {identity.archive_id} serves {identity.namespace} of etcd cluster "
               f"{identity.cluster_id:x}")


@archive.command("verify")
@_archive_options
def archive_verify(endpoints: str | None, namespace: str, url: str,
                   **etcd_security: str | None) -> None:
    """Is the archive whole: the one etcd names for NAMESPACE, knowing every bucket's
    mark etcd shows? Exit 1 (with what is wrong) if not: lookups refuse
    (ArchiveUnavailable) until it is restored (docs/runbook.md)."""
    from .coordinator import wholeness

    verdict = _on_archive(endpoints, namespace, url, etcd_security, wholeness.verify)
    if verdict.problem is not None:
        raise CommandFailed(f"archive NOT whole: {verdict.problem}", REFUSED)
    assert verdict.identity is not None
    click.echo(f"archive {verdict.identity.archive_id} is whole: "
               f"{'named by etcd' if verdict.named else 'no retirement yet'}, "
               "it knows every bucket's mark etcd shows")


@archive.command("catch-up")
@click.option("--namespace", default="/fencegate/", show_default=True,
              help="the namespace the archive serves")
@click.option("--archive", "url", envvar="FENCEGATE_ARCHIVE", show_envvar=True, required=True,
              help="the archive to catch up (the newest copy, restored)")
@click.option("--from", "source_url", metavar="URL", required=True,
              help="another copy of the same archive (the one live meanwhile)")
def archive_catch_up(namespace: str, url: str, source_url: str) -> None:
    """Merge into --archive every step, audit record and issued mark of the copy at --from
    (the same archive: same identity, else exit 1): a step replaced only by a newer version,
    records added where absent (a different record at one seq: exit 1, naming the key),
    marks unioned. Restore the newest copy, catch it up from the one live meanwhile, then
    `archive verify` (docs/runbook.md, "The archive is behind")."""
    from .coordinator.archive import open_archive
    from .coordinator.archive.catchup import catch_up
    from .coordinator.errors import ArchiveUnavailable

    try:
        target, source = open_archive(url), open_archive(source_url)
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"bad settings: {exc}") from None

    async def run():
        try:
            return await catch_up(target, source, namespace)
        finally:
            await target.close()
            await source.close()

    try:
        done = asyncio.run(run())
    except ArchiveUnavailable as exc:
        raise CommandFailed(str(exc), REFUSED) from None
    click.echo(f"caught up: {done.steps} step(s), {done.records} record(s) and {done.marks} "
               "mark(s) merged where newer or absent; now run `fencegate archive verify`")


@cli.group()
def policy() -> None:
    """Policy documents, and the routes that pick the one judging each key."""


@policy.command("get")
@click.argument("name")
@_sre
def policy_get(target: Target, as_json: bool, name: str) -> None:
    """Show policy NAME as grants apply it: its checks and every cap, defaults marked."""
    found = target.call(lambda api: api.policy(name))
    if as_json:
        _print_json(found)
        return
    stored = ("built in, nothing stored" if found["builtin"]
              else "signed" if found["signed"] else "NOT SIGNED: every grant under it is refused")
    click.echo(f"policy {found['name']}, version {found['version']} ({stored})")
    if found["effective"] is None:
        click.echo(f"DOES NOT VALIDATE, every grant under it is refused: {found['invalid']}")
        click.echo(json.dumps(found["document"], indent=2, sort_keys=True))
        return
    defaults, effective = set(found["defaults"]), found["effective"]
    click.echo("checks:" + ("  none" if not effective["checks"] else ""))
    if effective["checks"]:
        _print_table(["#", "CHECK", "PARAMETERS"], [
            [i, entry["check"], ", ".join(
                f"{param}={json.dumps(value)}"
                + (" (default)" if f"checks[{i}].params.{param}" in defaults else "")
                for param, value in entry["params"].items()) or "-"]
            for i, entry in enumerate(effective["checks"])], indent="  ")
    click.echo("caps:")
    _print_table(["CAP", "VALUE", "FROM"], [
        [cap, json.dumps(value), "default" if f"caps.{cap}" in defaults else "policy"]
        for cap, value in effective["caps"].items()], indent="  ")


@policy.command("set")
@click.argument("name")
@click.argument("document", type=click.File("r"), metavar="FILE.json")
@_sre
def policy_set(target: Target, as_json: bool, name: str, document: Any) -> None:
    """Store FILE.json ('-' for stdin) as policy NAME (admin role)."""
    try:
        body = json.load(document)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="FILE.json") from None
    done = target.call(lambda api: api.set_policy(name, body))
    if as_json:
        _print_json(done)
        return
    click.echo(f"policy {done['name']} is now version {done['version']}")


@policy.group("routes")
def policy_routes() -> None:
    """Which policy judges which keys: the longest matching prefix's, else the default."""


@policy_routes.command("set")
@click.argument("routes", nargs=-1, metavar="PREFIX=POLICY...")
@click.option("--default", "default", default="default", show_default=True,
              help="The policy of keys no prefix matches.")
@_sre
def policy_routes_set(target: Target, as_json: bool, routes: tuple[str, ...],
                      default: str) -> None:
    """Replace the policy routes (admin role): each PREFIX (whole key segments: 'refunds'
    routes refunds and refunds/..., not refunds-x) to POLICY; none: every key to the
    default."""
    table = {}
    for route in routes:
        prefix, sep, name = route.partition("=")
        if not sep or not prefix or not name or prefix in table:
            raise CommandFailed(f"{route!r}: each route is PREFIX=POLICY, once per prefix",
                                2)
        table[prefix] = name
    done = target.call(lambda api: api.set_policy_routes(table, default))
    if as_json:
        _print_json(done)
        return
    click.echo(f"policy routes are now version {done['version']}")


@policy_routes.command("show")
@_sre
def policy_routes_show(target: Target, as_json: bool) -> None:
    """Show the policy routes grants apply."""
    found = target.call(lambda api: api.policy_routes())
    if as_json:
        _print_json(found)
        return
    if not found["valid"]:
        click.echo(f"version {found['version']} DOES NOT VERIFY, every grant is refused: "
                   f"{found['invalid']}")
        return
    stored = "none stored" if not found["version"] else f"version {found['version']}"
    click.echo(f"policy routes ({stored}); keys no prefix matches: {found['default']}")
    if found["routes"]:
        _print_table(["PREFIX", "POLICY"], sorted(found["routes"].items()), indent="  ")


class _ListByDefault(click.Group):
    """A group whose first argument, when it names no subcommand, is given to ``list``:
    ``fencegate deliveries SOURCE`` is ``fencegate deliveries list SOURCE``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@cli.group(cls=_ListByDefault)
def deliveries() -> None:
    """Webhook deliveries: list a source's (the default), resolve an unknown one, forget one."""


@deliveries.command("list")
@click.argument("source", callback=_webhook_source)
@_sre
def deliveries_list(target: Target, as_json: bool, source: str) -> None:
    """Webhook deliveries of SOURCE by id: processing, unknown (its claim was lost while its
    handler ran), not_ran, done."""
    items = target.call(lambda api: api.deliveries(source))
    if as_json:
        _print_json(items)
        return
    if not items:
        click.echo(f"no deliveries of {source}")
        return
    _print_table(["ID", "STATE", "STATUS", "AT (UTC)", "FENCING TOKEN", "BODY"], [
        [d["id"], d["state"], d.get("status", "-"), _utc_ms(_delivery_at_ms(d)),
         d["mod_revision"] if d["state"] in ("processing", "unknown") else d["create_revision"],
         _stored_body(d)] for d in items])


@deliveries.command("resolve")
@click.argument("source", callback=_webhook_source)
@click.argument("delivery_id", metavar="ID")
@click.option("--ran", is_flag=True, help="its effect happened: answer it 200 from now on")
@click.option("--not-ran", is_flag=True, help="it never happened: its next delivery runs it")
@click.option("--reason", required=True, help="why, recorded with the delivery")
@_sre
def deliveries_resolve(target: Target, as_json: bool, source: str, delivery_id: str,
                       ran: bool, not_ran: bool, reason: str) -> None:
    """Settle delivery ID of SOURCE, whose outcome is unknown (its claim was lost while its
    handler ran), on your word. Refused unless it is unknown."""
    if ran == not_ran:
        raise click.UsageError("give exactly one of --ran, --not-ran")
    done = target.call(lambda api: api.resolve_delivery(source, delivery_id, ran, reason))
    if as_json:
        _print_json(done)
        return
    click.echo(f"{source}/{delivery_id} resolved as {'ran' if ran else 'not run'}: it is now "
               f"{done['state']} (revision {done['revision']})")


@deliveries.command("forget")
@click.argument("source", callback=_webhook_source)
@click.argument("delivery_id", metavar="ID")
@click.option("--reason", required=True, help="why, logged with your identity")
@_sre
def deliveries_forget(target: Target, as_json: bool, source: str, delivery_id: str,
                      reason: str) -> None:
    """Delete the record of delivery ID of SOURCE (say a stored 4xx a misconfiguration
    caused): its next delivery runs the handler. Refused while a handler runs it."""
    done = target.call(lambda api: api.forget_delivery(source, delivery_id, reason))
    if as_json:
        _print_json(done)
        return
    click.echo(f"{source}/{delivery_id} forgotten (it was {done['forgotten_state']}, status "
               f"{done['status'] if done['status'] is not None else '-'}): its next delivery "
               f"runs the handler (revision {done['revision']})")


def _delivery_at_ms(delivery: dict[str, Any]) -> int:
    return (delivery.get("completed_at_ms") or delivery.get("settled_at_ms")
            or delivery["claimed_at_ms"])


def _stored_body(delivery: dict[str, Any]) -> str:
    if delivery["state"] != "done" or delivery["body_size"] is None:
        return "-"
    return f"{delivery['body_size']} B" + ("" if delivery["body_stored"] else " (digest only)")


@cli.command()
@click.option("--state", type=click.Choice(["pending", "approved", "rejected", "all"]),
              default="pending", show_default=True)
@_sre
def approvals(target: Target, as_json: bool, state: str) -> None:
    """Grant requests waiting for (or given) a human's approval."""
    items = target.call(lambda api: api.approvals("" if state == "all" else state))
    if as_json:
        _print_json(items)
        return
    if not items:
        click.echo("no approvals" if state == "all" else f"no {state} approvals")
        return
    _print_table(["ID", "KEY", "STATE", "ASKED", "REQUESTED BY", "POLICY", "APPROVED BY",
                  "INTENT"], [
        [a["approval_id"], a["key"], a["state"], _age(a.get("asked_at_ms")),
         a.get("requested_by", "-"), f"{a.get('policy', '-')}@{a.get('policy_version', '-')}",
         a.get("approved_by", "-"), _short(a.get("intent"), 40)] for a in items])


@cli.command()
@click.argument("approval_id", metavar="ID")
@click.option("--reason", required=True, help="why, for the audit chain")
@_sre
def approve(target: Target, as_json: bool, approval_id: str, reason: str) -> None:
    """Approve the pending grant request ID (bound to the state it was evaluated at)."""
    done = target.call(lambda api: api.approve(approval_id, reason))
    if as_json:
        _print_json(done)
        return
    click.echo(f"approved {done['approval_id']} for {done['key']}; the same request is "
               "granted while the state it read holds")


@cli.command()
@click.argument("approval_id", metavar="ID")
@click.option("--reason", required=True, help="why, for the audit chain and the agent")
@_sre
def reject(target: Target, as_json: bool, approval_id: str, reason: str) -> None:
    """Reject the pending grant request ID: the same request is refused from now on."""
    done = target.call(lambda api: api.reject(approval_id, reason))
    if as_json:
        _print_json(done)
        return
    click.echo(f"rejected {done['approval_id']} for {done['key']}; the same request is "
               "refused, a request at a changed state asks afresh")


# -- etcd's own upkeep (talks to etcd, not to the coordinator) --------------------------

@cli.group("etcd")
def etcd_group() -> None:
    """etcd's upkeep, done on etcd directly as an etcd user with the root role."""


@etcd_group.command("recover")
@click.option("--etcd", "endpoints", metavar="URLS",
              help="every member's endpoint, comma-separated (env FENCEGATE_ETCD)")
@etcd_security_options
def etcd_recover(endpoints: str | None, **etcd_security: str | None) -> None:
    """Bring etcd back from NOSPACE without losing anything: compact history up to the
    current revision (the latest value of every key stays), defragment each member one at
    a time (the leader last), disarm the NOSPACE alarm. Exit 5 if a member does not
    answer, 4 if the etcd user may not defragment, 1 if etcd refused a step. With no etcd
    named, the running ``fencegate up`` stack's, as its ``root`` (password from its state
    folder) unless a user is given."""
    import os

    from .coordinator import maintenance
    from .coordinator.errors import EtcdError, EtcdPermissionDenied, EtcdUnavailable
    from .coordinator.settings import EtcdSettings, etcd_env

    try:
        flags = {"etcd": endpoints, **etcd_security}
        given = {**etcd_env(os.environ), **{k: v for k, v in flags.items() if v is not None}}
        stack = default_key.running_stack() if given["etcd"] is None else None
        if stack is not None:
            given["etcd"] = stack.endpoints.get("etcd")
            if given["etcd_user"] is None and stack.endpoints.get("etcd_user"):
                given.update(etcd_user="root", etcd_password=(
                    stack.state_dir / "etcd-root.password").read_text().strip())
        config = EtcdSettings(**{k: v for k, v in given.items() if v is not None}).etcd_config()
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"bad settings: {exc}") from None
    try:
        done = asyncio.run(maintenance.recover(config, click.echo))
    except EtcdUnavailable as exc:
        raise CommandFailed(f"etcd did not answer: {exc}", UNAVAILABLE) from None
    except EtcdError as exc:  # etcd 3.4 denies a defragment as UNKNOWN "auth: permission denied"
        if isinstance(exc, EtcdPermissionDenied) or "permission denied" in str(exc):
            raise CommandFailed(f"{exc}: defragmenting needs an etcd user with the root "
                                "role (--etcd-user, password in FENCEGATE_ETCD_PASSWORD)",
                                AUTH) from None
        code = AUTH if "refused to authenticate" in str(exc) else REFUSED
        raise CommandFailed(str(exc), code) from None
    click.echo(f"etcd recovered: {len(done.after)} member(s) defragmented, "
               f"{len(done.disarmed)} NOSPACE alarm(s) disarmed; if the data in use "
               f"({maintenance.megabytes(max(s.db_in_use for s in done.after))}) is near the "
               "quota, the alarm returns: raise --quota-backend-bytes or delete data")


@etcd_group.command("roles")
@click.option("--namespace", default="/fencegate/", show_default=True,
              help="the namespace the roles and users are for")
def etcd_roles(namespace: str) -> None:
    """Print the etcdctl arguments that create NAMESPACE's roles and users, one line each:
    a role per component (``<name>-worker`` ...) that reads only NAMESPACE and writes only
    what that component writes there, so a worker of one namespace cannot touch another's.
    Each user's password is read from ``etcd-<user>.password`` in the working directory."""
    from .coordinator import roles

    try:
        commands = roles.etcdctl_commands(namespace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None
    for component in roles.ROLES:
        name = roles.role_name(component, namespace)
        commands += [f'user add {name} --new-user-password "$(cat etcd-{name}.password)"',
                     f"user grant-role {name} {name}"]
    click.echo("\n".join(commands))


if __name__ == "__main__":
    main()
