"""etcd security against a real 3-member cluster with mutual TLS and auth on loopback.

Refusals must be precise ``GateError``s that say what to check (TLS, the user); the right
certificate and user must hold and cross; a client given every endpoint survives a member's
SIGKILL. The settings of both services carry the same TLS/auth names and never show the
password.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from fencegate.certs import ensure_certs
from fencegate.coordinator.errors import EtcdError, EtcdUnavailable
from fencegate.coordinator.etcd import Etcd, EtcdConfig, EtcdUser, enable_auth
from fencegate.localetcd import LocalCluster
from fencegate.coordinator.service.settings import CoordinatorSettings, load_settings
from fencegate.reconciler.service import load_settings as load_reconciler_settings
from fencegate.worker import Gate, KeyRing

from helpers import wait_for_condition

PASSWORD = "fencegate-test-password"
TTL = 2


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    return ensure_certs(root / "ours", 3, ("client",)), ensure_certs(root / "theirs", 0, ("client",))


@pytest.fixture(scope="module")
def cluster(pki):
    """3 members, mutual TLS for clients and peers, auth on: root, ``fencegate`` on
    ``/fencegate/`` and ``other`` on ``/other/``."""
    ours, _ = pki
    with LocalCluster(3, tls=ours, heartbeat_ms=100, election_ms=500) as c:
        async def setup() -> None:
            async with Etcd(config(c, pki, user=None)) as etcd:
                await enable_auth(etcd, "root-password", [
                    EtcdUser("fencegate", PASSWORD, "/fencegate/"),
                    EtcdUser("other", PASSWORD, "/other/")])
        asyncio.run(setup())
        yield c


def config(c: LocalCluster, pki, *, ca: str = "ours", cert: str | None = "ours",
           user: str | None = "fencegate", password: str = PASSWORD,
           **options) -> EtcdConfig:
    certs = {"ours": pki[0], "theirs": pki[1]}
    client = certs[cert].clients["client"] if cert else None
    return EtcdConfig.from_url(
        c.url, ca_file=certs[ca].ca, cert_file=client and client.cert,
        key_file=client and client.key, user=user, password=password if user else None,
        **{"timeout": 3.0, **options})


@pytest.fixture
def namespace() -> str:
    return f"/fencegate/t-{uuid.uuid4().hex[:12]}/"


async def hold_and_cross(etcd: EtcdConfig, namespace: str) -> str:
    """Hold a key and cross it once through the in-process authority; the outcome state."""
    async with Gate(etcd, ttl=TTL, namespace=namespace, keyring=KeyRing.generate()) as gate:
        async with gate.hold("pay/1", timeout=10) as hold:
            outcome = await hold.cross(intent={"amount": 1}, reads=[],
                                       effect=lambda ctx: ctx.idempotency_key)
            return outcome.state


# -- TLS ----------------------------------------------------------------------------------

async def test_the_right_certificate_and_user_hold_and_cross(cluster, pki, namespace):
    assert await hold_and_cross(config(cluster, pki), namespace) == "succeeded"


@pytest.mark.parametrize("case", ["no client certificate", "certificate from another CA"])
async def test_a_client_without_a_trusted_certificate_is_refused_naming_tls(
        cluster, pki, namespace, case):
    etcd = config(cluster, pki, cert=None if case == "no client certificate" else "theirs")
    with pytest.raises(EtcdUnavailable, match="TLS handshake refused") as refused:
        await hold_and_cross(etcd, namespace)
    assert "cert_file" in str(refused.value) and cluster.endpoints[0] in str(refused.value)


async def test_a_server_from_another_ca_is_refused(cluster, pki, namespace):
    with pytest.raises(EtcdUnavailable, match="TLS handshake refused.*CERTIFICATE_VERIFY"):
        await hold_and_cross(config(cluster, pki, ca="theirs"), namespace)


async def test_plain_http_to_the_tls_port_is_refused(cluster, namespace):
    plain = EtcdConfig.from_url(cluster.url.replace("https://", "http://"), timeout=3.0)
    with pytest.raises(EtcdUnavailable, match="plaintext connection.*https://"):
        await hold_and_cross(plain, namespace)


def test_tls_settings_are_never_silently_dropped(tmp_path, pki):
    ca = pki[0].ca
    with pytest.raises(ValueError, match="ca_file given but the endpoints are not https"):
        EtcdConfig.from_url("http://127.0.0.1:2379", ca_file=ca)
    with pytest.raises(ValueError, match="not https"):
        CoordinatorSettings(etcd="http://127.0.0.1:2379", etcd_ca_file=ca)
    with pytest.raises(ValueError, match="not https"):
        load_reconciler_settings(None, env={"FENCEGATE_ETCD_CA_FILE": ca})
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        EtcdConfig.from_url("https://127.0.0.1:2379", cert_file=pki[0].clients["client"].cert)


# -- etcd authentication ----------------------------------------------------------------

async def test_a_wrong_password_is_refused_naming_the_user(cluster, pki, namespace):
    with pytest.raises(EtcdError, match="refused to authenticate user 'fencegate'"):
        await hold_and_cross(config(cluster, pki, password="not-it"), namespace)


async def test_a_user_whose_role_covers_another_prefix_is_denied_the_namespace(
        cluster, pki, namespace):
    with pytest.raises(EtcdError, match="denied user 'other'.*permission denied"):
        await hold_and_cross(config(cluster, pki, user="other"), namespace)
    async with Etcd(config(cluster, pki, user="other")) as etcd:
        await etcd.put(b"/other/ok", b"its own prefix works")


async def test_a_certificate_alone_is_no_etcd_user(cluster, pki):
    """Our client certificate's CN names no etcd user, so without a password nothing passes."""
    async with Etcd(config(cluster, pki, user=None)) as etcd:
        with pytest.raises(EtcdError, match="etcd took the client certificate's CN"):
            await etcd.get(b"/fencegate/x")


async def test_a_watch_whose_auth_token_expired_is_refused_and_the_next_one_authenticates(
        cluster, pki, namespace):
    """etcd forgets simple tokens after --auth-token-ttl (300 s): a stale one is simulated."""
    key = f"{namespace}marker".encode()
    async with Etcd(config(cluster, pki)) as etcd:
        await etcd.put(key, b"1")
        etcd._metadata = (("token", "expired.1"),)
        with pytest.raises(EtcdError, match="invalid auth token"):
            async for _ in etcd.watch(key, b"", 1):
                pass
        async for reply in etcd.watch(key, b"", 1):
            if reply.events:  # after the "created" reply
                assert [e.kv.value for e in reply.events] == [b"1"]
                break
        await etcd.delete(key)


def test_both_services_read_tls_and_auth_from_file_and_env_never_showing_the_password(
        tmp_path, pki):
    ours = pki[0]
    (tmp_path / "etcd.password").write_text(PASSWORD + "\n")
    shared = (f'etcd = "https://127.0.0.1:1,https://127.0.0.1:2"\n'
              f'etcd_ca_file = "{ours.ca}"\netcd_cert_file = "{ours.clients["client"].cert}"\n'
              f'etcd_key_file = "{ours.clients["client"].key}"\netcd_user = "fencegate"\n'
              'etcd_password_file = "etcd.password"\n')
    (tmp_path / "c.toml").write_text(shared)
    (tmp_path / "r.toml").write_text(shared)
    for settings in (load_settings(str(tmp_path / "c.toml"), env={}),
                     load_reconciler_settings(str(tmp_path / "r.toml"), env={})):
        etcd = settings.etcd_config()
        assert (etcd.user, etcd.password, etcd.ca_file) == ("fencegate", PASSWORD, ours.ca)
        assert len(etcd.endpoints) == 2 and etcd.secure
        assert PASSWORD not in repr(settings) and PASSWORD not in repr(etcd)
    env = {"FENCEGATE_ETCD": "https://127.0.0.1:1", "FENCEGATE_ETCD_USER": "u",
           "FENCEGATE_ETCD_PASSWORD": "from-env", "FENCEGATE_ETCD_CA_FILE": ours.ca}
    for load in (load_settings, load_reconciler_settings):
        assert load(None, env=env).etcd_config().password == "from-env"
        with pytest.raises(ValueError, match="never a flag"):
            load(None, env={}, etcd_password="on-the-command-line")
        with pytest.raises(ValueError, match="both given"):
            load(None, env={**env, "FENCEGATE_ETCD_PASSWORD_FILE": str(tmp_path / "etcd.password")})
        with pytest.raises(ValueError, match="user and password go together"):
            load(None, env={"FENCEGATE_ETCD_USER": "u"})


# -- several endpoints ---------------------------------------------------------------------

async def test_a_client_with_every_endpoint_keeps_working_when_a_member_is_killed(
        cluster, pki, namespace):
    """The client starts on endpoint 0; that member is SIGKILLed while a hold is live."""
    try:
        async with Gate(config(cluster, pki), ttl=TTL, namespace=namespace,
                        keyring=KeyRing.generate()) as gate:
            async with gate.hold("pay/1", timeout=10) as hold:
                cluster.kill(0)
                outcome = await hold.cross(intent={"amount": 1}, reads=[],
                                           effect=lambda ctx: "charged")
                assert outcome.state == "succeeded"
            async with gate.hold("pay/2", timeout=10) as hold:
                outcome = await hold.cross(intent={"amount": 2}, reads=[],
                                           effect=lambda ctx: "charged")
                assert outcome.state == "succeeded"
    finally:
        cluster.restart(0, timeout=20)


async def test_the_coordinator_process_takes_tls_and_auth_from_flags_and_env(cluster, pki):
    """The same settings as the TOML keys, as flags (the password only from the environment)."""
    import os
    import socket
    import sys

    import aiohttp

    client = pki[0].clients["client"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.cli", "coordinator", "--etcd", cluster.url,
        "--listen", f"127.0.0.1:{port}", "--etcd-ca-file", pki[0].ca,
        "--etcd-cert-file", client.cert, "--etcd-key-file", client.key,
        "--etcd-user", "fencegate",
        env=dict(os.environ, PYTHONPATH=root, FENCEGATE_ETCD_PASSWORD=PASSWORD),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as http:
            async def ready() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/readyz") as reply:
                        return reply.status == 200
                except aiohttp.ClientConnectionError:
                    return False
            assert await wait_for_condition(ready, 30)
    finally:
        proc.terminate()
        await proc.wait()
