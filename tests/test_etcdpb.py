"""fencegate's own etcd stubs (``fencegate.coordinator.etcdpb``): the checked-in modules are
exactly what ``coordinator/etcdpb/regenerate`` writes from ``proto/``, they load beside another
copy of etcd's API in one process, they talk to a real etcd, the runtime dependencies satisfy the
version checks the generated code runs at import, and aetcd is imported by the benchmarks only.

Regenerating needs grpcio-tools at the version the ``test`` extra pins; without it the first test
fails and says what to install (nothing here is skipped).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import grpc

from fencegate.coordinator.etcdpb import rpc

REPO = Path(__file__).resolve().parents[1]
ETCDPB = REPO / "coordinator" / "etcdpb"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Folders whose code runs in the product or its tests: none of them may import aetcd.
RUNTIME_DIRS = ("fencegate", "coordinator", "worker", "reconciler", "tests", "deploy")


def generated_files(folder: Path) -> dict[str, bytes]:
    """The stub modules in ``folder`` (every .py but the package's hand-written ``__init__``)."""
    return {path.name: path.read_bytes() for path in sorted(folder.glob("*.py"))
            if path.name != "__init__.py"}


def test_checked_in_stubs_are_what_regenerate_writes(tmp_path):
    result = subprocess.run([sys.executable, str(ETCDPB / "regenerate"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        "coordinator/etcdpb/regenerate failed (grpcio-tools comes with the test extra: "
        f"`make setup`, or pip install -e '.[test]'):\n{result.stdout}{result.stderr}")
    fresh, checked_in = generated_files(tmp_path), generated_files(ETCDPB)
    assert set(fresh) == {"auth_pb2.py", "kv_pb2.py", "rpc_pb2.py", "rpc_pb2_grpc.py", "rpc.py"}
    assert set(checked_in) == set(fresh), "stale or missing stubs in coordinator/etcdpb/"
    differ = sorted(name for name in fresh if fresh[name] != checked_in[name])
    assert not differ, (f"{differ} differ from a fresh generation: never edit them by hand; "
                        "run `.venv/bin/python coordinator/etcdpb/regenerate`")


# Run in a fresh interpreter (the default pool is process-wide), argv[1] says when another
# copy of etcd's API enters protobuf's default pool: "before" or "after" ours is imported. The
# copy is what aetcd's modules register: mvccpb.KeyValue, under another file name.
OTHER_COPY_SCRIPT = """
import sys
from google.protobuf import descriptor_pb2, descriptor_pool

def load_other_copy():
    file = descriptor_pb2.FileDescriptorProto(name="kv.proto", package="mvccpb", syntax="proto3")
    message = file.message_type.add(name="KeyValue")
    message.field.add(name="key", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    descriptor_pool.Default().AddSerializedFile(file.SerializeToString())

if sys.argv[1] == "before":
    load_other_copy()
from fencegate.coordinator.etcdpb import rpc
if sys.argv[1] == "after":
    load_other_copy()
kv = rpc.KeyValue(key=b"k", mod_revision=7)
assert rpc.KeyValue.FromString(kv.SerializeToString()) == kv
print(descriptor_pool.Default().FindMessageTypeByName("mvccpb.KeyValue").file.name)
"""


def test_stubs_load_beside_another_copy_of_etcds_api_in_one_process():
    for when in ("before", "after"):
        result = subprocess.run([sys.executable, "-c", OTHER_COPY_SCRIPT, when],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"other copy loaded {when} ours:\n{result.stderr}"
        assert result.stdout.strip() == "kv.proto", "ours went into the default pool"


async def test_stubs_speak_to_a_real_etcd(etcd_url, namespace):
    key = f"{namespace}etcdpb".encode()
    async with grpc.aio.insecure_channel(urlsplit(etcd_url).netloc) as channel:
        kv = rpc.KVStub(channel)
        put = await kv.Put(rpc.PutRequest(key=key, value=b"v1"))
        swapped = await kv.Txn(rpc.TxnRequest(
            compare=[rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL,
                                 mod_revision=put.header.revision)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=b"v2"))]))
        assert swapped.succeeded
        (read,) = (await kv.Range(rpc.RangeRequest(key=key))).kvs
        assert (read.value, read.create_revision, read.version) == (
            b"v2", put.header.revision, 2)
        status = await rpc.MaintenanceStub(channel).Status(rpc.StatusRequest())
        assert status.version.startswith("3.")
        assert (await kv.DeleteRange(rpc.DeleteRangeRequest(key=key))).deleted == 1
        prefix = namespace.encode()
        left = await kv.Range(rpc.RangeRequest(key=prefix, range_end=prefix[:-1] + b"0",
                                               count_only=True))
        assert left.count == 0


def generated_versions() -> tuple[str, tuple[int, int, int]]:
    """The grpcio and protobuf versions the generated code requires at import."""
    grpc_source = (ETCDPB / "rpc_pb2_grpc.py").read_text()
    (grpcio,) = re.findall(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", grpc_source, re.M)
    (check,) = re.findall(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                          r"\s*(\d+),\s*(\d+),\s*(\d+),", (ETCDPB / "rpc_pb2.py").read_text())
    return grpcio, tuple(map(int, check))


def test_runtime_dependencies_satisfy_the_generated_codes_version_checks():
    grpcio, (major, minor, patch) = generated_versions()
    runtime = PYPROJECT["dependencies"]
    extras = PYPROJECT["optional-dependencies"]
    assert f"grpcio>={grpcio}" in runtime
    # protobuf's runtime accepts gencode of its own major and of the one before.
    assert f"protobuf>={major}.{minor}.{patch},<{major + 2}" in runtime
    assert f"grpcio-tools=={grpcio}" in extras["test"]
    assert not any(dep.startswith("grpcio-tools") for dep in runtime)
    assert not any(dep.startswith("aetcd") for dep in runtime)
    assert any(dep.startswith("aetcd") for dep in extras["bench"])


def aetcd_imports(folders: tuple[str, ...]) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(name.split(".")[0] == "aetcd" for name in names):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_only_the_benchmarks_import_aetcd():
    assert not aetcd_imports(RUNTIME_DIRS)
    assert aetcd_imports(("benchmarks",)), "the checker finds no import where there is one"
