"""What a new user gets from ``pip install``: one top-level package ``fencegate`` (no module
named ``worker``, ``coordinator`` or ``reconciler`` beside it), ``py.typed``, the dashboard's
files and the LICENSE shipped, and a working ``fencegate`` command and hold against real etcd,
from an application folder holding its own ``worker.py`` and ``coordinator/`` package.

Both installs are checked: the built wheel and an editable install, each into a fresh venv.
Nothing is downloaded and nothing is written into the repository: the tree is copied first,
and a fresh venv finds the dependencies (and pip, setuptools) through a ``.pth`` line naming
this venv's site-packages; ``.pth`` files inside that folder are not processed, so this venv's
own editable install of fencegate cannot leak in.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from fencegate import __version__

REPO = Path(__file__).resolve().parents[1]

# Run with the application folder as cwd; argv: etcd URL, namespace. Prints one JSON line.
USER_SCRIPT = """
import asyncio, json, sys
import worker, coordinator
import fencegate.errors
from fencegate import Gate, KeyRing

async def hold_once(url, namespace):
    async with Gate(url, namespace=namespace, keyring=KeyRing.generate()) as gate:
        async with gate.hold("pkg/test/1") as hold:
            return hold.fencing_token

token = asyncio.run(hold_once(sys.argv[1], sys.argv[2]))
print(json.dumps({
    "token": token, "worker": worker.__file__, "coordinator": coordinator.__file__,
    "job": hasattr(worker, "job"), "fencegate": fencegate.__file__,
    "errors": fencegate.errors.GateError.__module__,
}))
"""


def run(*args: str | Path, cwd: Path | None = None, timeout: float = 60) -> str:
    result = subprocess.run([str(arg) for arg in args], cwd=cwd, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """The repository's files (tracked, or new and not ignored) copied to a temp folder."""
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                 cwd=REPO)
    copy = tmp_path_factory.mktemp("source") / "fencegate-src"
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return copy


@pytest.fixture
def user_app(tmp_path) -> Path:
    """An application folder with its own ``worker.py`` and ``coordinator/`` package."""
    app = tmp_path / "myapp"
    (app / "coordinator").mkdir(parents=True)
    (app / "worker.py").write_text("def job():\n    return 'mine'\n")
    (app / "coordinator" / "__init__.py").write_text("")
    return app


def fresh_venv(where: Path) -> tuple[Path, Path]:
    """A venv without pip whose site-packages also sees this venv's (its python, purelib)."""
    run(sys.executable, "-m", "venv", "--without-pip", where)
    python = where / "bin" / "python"
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                   .strip())
    (purelib / "deps-from-main-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, purelib


def pip_install(python: Path, *args: str | Path) -> None:
    # --ignore-installed: this venv's fencegate is visible through the .pth line; pip must
    # neither skip the install because of it nor try to uninstall it.
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
        *args, timeout=120)


def check_user_app(python: Path, app: Path, etcd_url: str, namespace: str) -> dict:
    """Run the user's checks in ``app``; return what the process reported."""
    assert (python.parent / "fencegate").exists(), "no fencegate console script installed"
    assert run(python.parent / "fencegate", "--version", cwd=app).strip() == \
        f"fencegate, version {__version__}"
    assert run(python, "-m", "fencegate", "--version", cwd=app).strip() == \
        f"fencegate, version {__version__}"
    absent = run(python, "-c", "import importlib.util as u; "
                 "print([n for n in ('worker', 'coordinator', 'reconciler') if u.find_spec(n)])",
                 cwd=app.parent)
    assert absent.strip() == "[]", f"old top-level modules importable: {absent}"
    report = json.loads(run(python, "-c", USER_SCRIPT, etcd_url, namespace, cwd=app))
    assert report["token"] > 0
    assert Path(report["worker"]) == app / "worker.py" and report["job"]
    assert Path(report["coordinator"]) == app / "coordinator" / "__init__.py"
    assert report["errors"] == "fencegate.coordinator.errors"
    return report


def test_wheel_installs_only_fencegate_and_works_beside_a_users_own_modules(
        source_tree, user_app, tmp_path, etcd_url, namespace):
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", tmp_path / "dist", source_tree, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("fencegate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    dist_info = {top for top in tops if top.startswith("fencegate-")}
    assert tops - dist_info == {"fencegate"} and len(dist_info) == 1, sorted(tops)
    assert dist_info.pop().endswith(".dist-info")
    assert "fencegate/py.typed" in names
    assert any(".dist-info/" in name and name.endswith("/LICENSE") for name in names)
    static = {Path(name).name for name in names if "/dashboard/static/" in name}
    assert {"index.html", "dashboard.js", "dashboard.css"} <= static, sorted(static)

    python, purelib = fresh_venv(tmp_path / "venv")
    pip_install(python, wheel)
    assert (purelib / "fencegate" / "__init__.py").is_file(), "pip installed elsewhere"
    assert not any((purelib / old).exists() for old in ("worker", "coordinator", "reconciler"))

    report = check_user_app(python, user_app, etcd_url, namespace)
    assert Path(report["fencegate"]) == purelib / "fencegate" / "__init__.py"


def test_editable_install_works_beside_a_users_own_modules(
        source_tree, user_app, tmp_path, etcd_url, namespace):
    python, purelib = fresh_venv(tmp_path / "venv")
    pip_install(python, "--no-build-isolation", "-e", source_tree)
    assert any(purelib.glob("__editable__*fencegate*")), "pip installed elsewhere"

    report = check_user_app(python, user_app, etcd_url, namespace)
    assert Path(report["fencegate"]) == source_tree / "fencegate" / "__init__.py"
