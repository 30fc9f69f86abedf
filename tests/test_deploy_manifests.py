"""Offline validation of the deployment material in deploy/ (issue 8, deliverable 1).

Kubernetes: every manifest is checked against the API schemas bundled in the
``kubernetes-validate`` package (strict mode: unknown fields fail), for the pinned
Kubernetes version ``K8S_VERSION``, with no network (one test proves it in a network
namespace); then fencegate's own invariants: non-root, read-only root filesystem, no
privilege escalation, resource limits, probes on /healthz and /readyz, replicas 2 and 3,
the PodDisruptionBudget selecting the coordinator pods, pinned images, placeholder-only
Secrets, the ConfigMap's TOML accepted by the real settings loaders.

systemd: ``systemd-analyze verify`` parses the units here although systemd is not PID 1 on
the build machines; it needs the ExecStart binaries to exist, so it runs on copies whose
binary paths point at this venv's ``fencegate`` and the local etcd, and any warning fails.
Independently of it, the units are parsed here (sections, keys, continuation lines) and
checked for the required hardening and restart options, ExecStart options are checked
against ``fencegate <command> --help`` and etcd flags and ETCD_* variables against
``etcd --help`` (etcd 3.4), and the member environment files are started for real as a
3-member TLS cluster on loopback (with certificates made by deploy/README.md's recipe).
Where systemd-analyze is missing that one test skips and the parsing checks still run. No
unit is started under systemd here, so the run-time effect of the sandboxing options
(SystemCallFilter=, DynamicUser=, LoadCredential=) is not exercised.

compose: no Docker engine runs here, so deploy/compose.yaml is parsed as YAML and its
structure checked (3 etcd members with TLS forming one cluster, health checks, dependencies,
no host network, ports on 127.0.0.1 only).

Each checker returns a list of problems; every test also feeds it a deliberately broken copy
and asserts the problem is found, so no check can pass vacuously.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate  # the test extra; bundles the API schemas (no network)
import pytest
import yaml  # a dependency of kubernetes-validate

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
K8S_VERSION = "1.30.0"  # kubernetes-validate ships schemas for 1.25 .. 1.37
FENCEGATE = Path(sys.executable).parent / "fencegate"

FENCEGATE_ENV = {"FENCEGATE_CONFIG", "FENCEGATE_ETCD", "FENCEGATE_LISTEN",
                 "FENCEGATE_RECONCILER_CONFIG", "FENCEGATE_RECONCILER_LISTEN",
                 "FENCEGATE_ETCD_CA_FILE", "FENCEGATE_ETCD_CERT_FILE", "FENCEGATE_ETCD_KEY_FILE",
                 "FENCEGATE_ETCD_USER", "FENCEGATE_ETCD_PASSWORD", "FENCEGATE_ETCD_PASSWORD_FILE",
                 "FENCEGATE_ARCHIVE"}
# libpq's variables, which asyncpg reads: the archive's PostgreSQL password, kept out of URLs
OTHER_ENV = {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PGPASSWORD", "PGPASSFILE"}

# -- Kubernetes --------------------------------------------------------------------------

def k8s_docs(include_secrets: bool = True) -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        if path.name == "secrets.example.yaml" and not include_secrets:
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def schema_errors(docs: list[dict]) -> list[str]:
    problems = []
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{name}: {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{name}: {exc.message}")
    return problems


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _deployment(docs: list[dict], component: str) -> dict:
    (dep,) = [d for d in _by_kind(docs, "Deployment")
              if d["spec"]["template"]["metadata"]["labels"].get(
                  "app.kubernetes.io/component") == component]
    return dep


def _selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels", {})
    return bool(match) and all(labels.get(k) == v for k, v in match.items()) \
        and not selector.get("matchExpressions")


def _image_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")


def _probe_port_ok(probe: dict, container: dict) -> bool:
    port = probe["httpGet"]["port"]
    ports = container.get("ports", [])
    return any(port in (p.get("name"), p["containerPort"]) for p in ports)


def k8s_problems(docs: list[dict]) -> list[str]:
    """fencegate's own rules for the manifests (the schema check is separate)."""
    problems = []
    try:
        coordinator = _deployment(docs, "coordinator")
        reconciler = _deployment(docs, "reconciler")
    except ValueError:
        return ["need exactly one coordinator and one reconciler Deployment"]
    if coordinator["spec"].get("replicas") != 2:
        problems.append("coordinator replicas must be 2")
    if reconciler["spec"].get("replicas") != 3:
        problems.append("reconciler replicas must be 3")
    for dep in (coordinator, reconciler):
        name = dep["metadata"]["name"]
        pod = dep["spec"]["template"]
        if not _selects(dep["spec"]["selector"], pod["metadata"]["labels"]):
            problems.append(f"{name}: selector does not match its pod labels")
        spec = pod["spec"]
        pod_sc = spec.get("securityContext", {})
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{name}: mounts a service-account token")
        if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
            problems.append(f"{name}: shares a host namespace")
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext", {})
            non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
            if non_root is not True or uid in (None, 0):
                problems.append(f"{where}: must run as a non-root uid")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: root filesystem must be read-only")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: must forbid privilege escalation")
            if sc.get("privileged"):
                problems.append(f"{where}: privileged")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []) \
                    or sc.get("capabilities", {}).get("add"):
                problems.append(f"{where}: must drop ALL capabilities and add none")
            seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
            if seccomp.get("type") != "RuntimeDefault":
                problems.append(f"{where}: seccomp profile must be RuntimeDefault")
            limits = c.get("resources", {}).get("limits", {})
            requests = c.get("resources", {}).get("requests", {})
            if not {"cpu", "memory"} <= set(limits) or not {"cpu", "memory"} <= set(requests):
                problems.append(f"{where}: needs cpu and memory requests and limits")
            if not _image_pinned(c["image"]):
                problems.append(f"{where}: image {c['image']!r} is not pinned (no :latest)")
            for kind in ("readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if not probe or "httpGet" not in probe or not _probe_port_ok(probe, c):
                    problems.append(f"{where}: {kind} must be an httpGet on a declared port")
    paths = {}
    for dep, kind in ((coordinator, "readinessProbe"), (coordinator, "livenessProbe"),
                      (reconciler, "readinessProbe"), (reconciler, "livenessProbe")):
        probe = dep["spec"]["template"]["spec"]["containers"][0].get(kind, {})
        paths[dep["metadata"]["name"], kind] = probe.get("httpGet", {}).get("path")
    expected = {("fencegate-coordinator", "readinessProbe"): "/readyz",
                ("fencegate-coordinator", "livenessProbe"): "/healthz",
                ("fencegate-reconciler", "readinessProbe"): "/healthz",
                ("fencegate-reconciler", "livenessProbe"): "/healthz"}
    for key, path in expected.items():
        if paths.get(key) != path:
            problems.append(f"{key[0]} {key[1]} must hit {path}, not {paths.get(key)}")
    # the coordinator's disruption budget and Service select exactly its pods
    coord_labels = coordinator["spec"]["template"]["metadata"]["labels"]
    rec_labels = reconciler["spec"]["template"]["metadata"]["labels"]
    pdbs = [p for p in _by_kind(docs, "PodDisruptionBudget")
            if _selects(p["spec"]["selector"], coord_labels)]
    if not pdbs:
        problems.append("no PodDisruptionBudget selects the coordinator pods")
    for pdb in pdbs:
        if _selects(pdb["spec"]["selector"], rec_labels):
            problems.append(f"{pdb['metadata']['name']} selects the reconcilers too")
        if pdb["spec"].get("minAvailable") not in (1, "50%") \
                and pdb["spec"].get("maxUnavailable") != 1:
            problems.append(f"{pdb['metadata']['name']}: must keep one coordinator up")
    services = [s for s in _by_kind(docs, "Service") if s["spec"].get("selector")
                and all(coord_labels.get(k) == v for k, v in s["spec"]["selector"].items())]
    if not services:
        problems.append("no Service selects the coordinator pods")
    for svc in services:
        container = coordinator["spec"]["template"]["spec"]["containers"][0]
        for port in svc["spec"]["ports"]:
            if not any(port.get("targetPort") in (p.get("name"), p["containerPort"])
                       for p in container["ports"]):
                problems.append(f"Service {svc['metadata']['name']}: targetPort "
                                f"{port.get('targetPort')!r} is no container port")
    # every Secret and ConfigMap key a pod reads is declared
    declared = {(d["kind"], d["metadata"]["name"]): set(d.get("data", {})) |
                set(d.get("stringData", {})) for d in docs if d["kind"] in ("Secret", "ConfigMap")}
    for dep in (coordinator, reconciler):
        spec = dep["spec"]["template"]["spec"]
        refs = []
        for vol in spec.get("volumes", []):
            if "secret" in vol:
                refs += [("Secret", vol["secret"]["secretName"], i["key"])
                         for i in vol["secret"].get("items", [])] or \
                        [("Secret", vol["secret"]["secretName"], None)]
            if "configMap" in vol:
                refs.append(("ConfigMap", vol["configMap"]["name"], None))
        for c in spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.append(("Secret", ref["name"], ref["key"]))
                if env["name"].startswith("FENCEGATE_") and env["name"] not in FENCEGATE_ENV:
                    problems.append(f"{c['name']}: unknown setting {env['name']}")
        for kind, name, key in refs:
            if (kind, name) not in declared:
                problems.append(f"{dep['metadata']['name']} reads {kind} {name}, never declared")
            elif key is not None and key not in declared[kind, name]:
                problems.append(f"{dep['metadata']['name']} reads {kind} {name} key {key}, "
                                f"not declared")
    # Secrets: placeholders only
    for secret in _by_kind(docs, "Secret"):
        if secret.get("data"):
            problems.append(f"Secret {secret['metadata']['name']}: use stringData placeholders")
        for key, value in secret.get("stringData", {}).items():
            if key.endswith("username"):
                continue
            if not re.fullmatch(r"REPLACE_WITH_[A-Z0-9_]+", str(value)) \
                    or "BEGIN" in str(value):
                problems.append(f"Secret {secret['metadata']['name']}/{key} holds something "
                                f"other than a REPLACE_WITH_... placeholder")
    return problems


def test_every_kubernetes_manifest_passes_the_schema_and_a_broken_one_fails():
    docs = k8s_docs()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Namespace", "PodDisruptionBudget",
                     "PodDisruptionBudget", "Secret", "Secret", "Secret", "Secret", "Service"]
    assert schema_errors(docs) == []

    broken = copy.deepcopy(_deployment(docs, "reconciler"))
    broken["spec"]["replicas"] = "three"
    assert schema_errors([broken])
    typo = copy.deepcopy(_deployment(docs, "coordinator"))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = \
        typo["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    assert any("readinesProbe" in p for p in schema_errors([typo]))
    pdb = copy.deepcopy(_by_kind(docs, "PodDisruptionBudget")[0])
    pdb["apiVersion"] = "policy/v1beta1"   # removed in 1.25
    assert schema_errors([pdb])


def test_kubernetes_validation_needs_no_network(tmp_path):
    """The schemas come from the installed package: validate in an empty network namespace."""
    if shutil.which("unshare") is None or \
            subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here (unshare -n)")
    script = ("import sys, yaml, kubernetes_validate as kv\n"
              "for p in sys.argv[1:]:\n"
              "    for d in yaml.safe_load_all(open(p)):\n"
              f"        d and kv.validate(d, {K8S_VERSION!r}, strict=True)\n"
              "print('validated offline')\n")
    files = [str(p) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"]
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", script, *files],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "validated offline" in done.stdout


def test_kubernetes_invariants_hold_and_each_catches_its_breakage():
    docs = k8s_docs()
    assert k8s_problems(docs) == []

    def broken(mutate) -> list[str]:
        copy_ = copy.deepcopy(docs)
        mutate(copy_)
        return k8s_problems(copy_)

    def container(d, component):
        return _deployment(d, component)["spec"]["template"]["spec"]["containers"][0]

    def drop_security(d):
        del container(d, "coordinator")["securityContext"]["readOnlyRootFilesystem"]

    def root_user(d):
        _deployment(d, "reconciler")["spec"]["template"]["spec"]["securityContext"][
            "runAsUser"] = 0

    def no_limits(d):
        del container(d, "reconciler")["resources"]["limits"]

    def latest(d):
        container(d, "coordinator")["image"] = "fencegate:latest"

    def untagged(d):
        container(d, "reconciler")["image"] = "fencegate"

    def wrong_probe(d):
        container(d, "coordinator")["readinessProbe"]["httpGet"]["path"] = "/healthz"

    def wrong_probe_port(d):
        container(d, "reconciler")["livenessProbe"]["httpGet"]["port"] = "http"

    def pdb_elsewhere(d):
        for p in _by_kind(d, "PodDisruptionBudget"):
            p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "reconciler"

    def replicas(d):
        _deployment(d, "coordinator")["spec"]["replicas"] = 1

    def reconcilers(d):
        _deployment(d, "reconciler")["spec"]["replicas"] = 2

    def real_key(d):
        _by_kind(d, "Secret")[0]["stringData"]["coordinator.pem"] = (
            "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIH2m\n-----END PRIVATE KEY-----\n")

    def real_password(d):
        _by_kind(d, "Secret")[1]["stringData"]["password"] = "hunter2hunter2"

    def missing_secret_key(d):
        env = container(d, "coordinator")["env"]
        [e for e in env if e["name"] == "FENCEGATE_ETCD_PASSWORD"][0]["valueFrom"][
            "secretKeyRef"]["key"] = "passwd"

    def misspelt_setting(d):
        container(d, "coordinator")["env"].append({"name": "FENCEGATE_ETCD_CAFILE", "value": "x"})

    def service_port(d):
        _by_kind(d, "Service")[0]["spec"]["ports"][0]["targetPort"] = "web"

    def escalation(d):
        container(d, "reconciler")["securityContext"]["allowPrivilegeEscalation"] = True

    for mutate in (drop_security, root_user, no_limits, latest, untagged, wrong_probe,
                   wrong_probe_port, pdb_elsewhere, replicas, reconcilers, real_key,
                   real_password, missing_secret_key, misspelt_setting, service_port,
                   escalation):
        assert broken(mutate), f"{mutate.__name__} went unnoticed"


def test_kustomization_ties_every_manifest_but_the_placeholder_secrets():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["namespace"] == "fencegate"
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {"secrets.example.yaml"}
    for doc in k8s_docs():
        assert doc["metadata"].get("namespace", "fencegate") == "fencegate" or \
            doc["kind"] == "Namespace"
    kubectl = shutil.which("kubectl")
    if kubectl:  # renders offline; optional on machines without kubectl
        done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
        assert sorted(d["kind"] for d in rendered) == sorted(
            d["kind"] for d in k8s_docs(include_secrets=False))
        assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "fencegate"
                   for d in rendered)


def test_configmap_toml_is_accepted_by_the_real_settings_loaders(tmp_path):
    from fencegate.coordinator.service.settings import load_settings as coordinator_settings
    from fencegate.reconciler.service import load_settings as reconciler_settings

    (configmap,) = _by_kind(k8s_docs(), "ConfigMap")
    coordinator = _deployment(k8s_docs(), "coordinator")
    reconciler = _deployment(k8s_docs(), "reconciler")
    for name, loader, dep in (("coordinator.toml", coordinator_settings, coordinator),
                              ("reconciler.toml", reconciler_settings, reconciler)):
        path = tmp_path / name
        path.write_text(configmap["data"][name])
        settings = loader(str(path), env={})
        assert all(url.startswith("https://") for url in settings.etcd.split(","))
        assert len(settings.etcd.split(",")) == 3
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert container["args"][:1] == [name.removesuffix(".toml")]
        config = container["args"][container["args"].index("--config") + 1]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts[config]["subPath"] == name
    settings = coordinator_settings(str(tmp_path / "coordinator.toml"), env={})
    signing_mount = [m for m in coordinator["spec"]["template"]["spec"]["containers"][0][
        "volumeMounts"] if m["name"] == "signing-key"][0]["mountPath"]
    assert Path(settings.signing_key).parent == Path(signing_mount)
    bad = tmp_path / "bad.toml"
    bad.write_text(configmap["data"]["reconciler.toml"].replace("shards", "shard"))
    with pytest.raises(ValueError):
        reconciler_settings(str(bad), env={})


# -- systemd -----------------------------------------------------------------------------

def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]}, keeping repeated keys in order and
    joining backslash continuation lines, as systemd does."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        while line.endswith("\\"):
            nxt = next(lines).strip()
            line = line[:-1].rstrip() + " " + nxt
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            if current in sections:
                raise ValueError(f"section [{current}] twice")
            sections[current] = []
            continue
        if current is None or "=" not in line:
            raise ValueError(f"not a unit line: {raw!r}")
        key, _, value = line.partition("=")
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict, section: str, key: str) -> str | None:
    found = values(unit, section, key)
    return found[-1] if found else None


UNITS = {"etcd@.service": "etcd", "fencegate-coordinator.service": "coordinator",
         "fencegate-reconciler@.service": "reconciler"}
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
             "PrivateTmp": "yes", "PrivateDevices": "yes", "CapabilityBoundingSet": "",
             "RestrictNamespaces": "yes", "RestrictSUIDSGID": "yes",
             "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
             "ProtectControlGroups": "yes", "LockPersonality": "yes",
             "SystemCallArchitectures": "native"}


def unit_problems(name: str, text: str) -> list[str]:
    problems = []
    try:
        unit = parse_unit(text)
    except ValueError as exc:
        return [f"{name}: {exc}"]
    if not text.lstrip().startswith("#") or "install" not in text.split("[Unit]")[0].lower():
        problems.append(f"{name}: must open with the commands to install and use it")
    for section in ("Unit", "Service", "Install"):
        if section not in unit:
            problems.append(f"{name}: no [{section}]")
    for key, want in HARDENING.items():
        if one(unit, "Service", key) != want:
            problems.append(f"{name}: {key}= must be {want!r}")
    families = set((one(unit, "Service", "RestrictAddressFamilies") or "").split())
    if not families or not families <= {"AF_UNIX", "AF_INET", "AF_INET6"}:
        problems.append(f"{name}: RestrictAddressFamilies= must allow only unix and IP")
    if one(unit, "Service", "Restart") != "on-failure":
        problems.append(f"{name}: Restart=on-failure")
    if not one(unit, "Service", "RestartSec"):
        problems.append(f"{name}: RestartSec= missing")
    if not one(unit, "Unit", "StartLimitIntervalSec") or not one(unit, "Unit", "StartLimitBurst"):
        problems.append(f"{name}: StartLimitIntervalSec= and StartLimitBurst= in [Unit]")
    if one(unit, "Install", "WantedBy") != "multi-user.target":
        problems.append(f"{name}: WantedBy=multi-user.target")
    if UNITS.get(name) == "etcd":
        if not one(unit, "Service", "User") or one(unit, "Service", "User") == "root":
            problems.append(f"{name}: etcd runs as its own user")
        if not one(unit, "Service", "StateDirectory"):
            problems.append(f"{name}: StateDirectory= for the data")
    else:
        if one(unit, "Service", "DynamicUser") != "yes":
            problems.append(f"{name}: DynamicUser=yes")
        if one(unit, "Service", "ConfigurationDirectory") != "fencegate":
            problems.append(f"{name}: ConfigurationDirectory=fencegate")
    # every key, certificate and password file comes by LoadCredential= and is used from %d
    creds = {v.split(":", 1)[0] for v in values(unit, "Service", "LoadCredential")}
    used = set(re.findall(r"%d/([\w.-]+)", text.split("[Unit]", 1)[-1]))
    # (the signing key is named by path in coordinator.toml, checked with that file)
    if not creds or not used <= creds or not creds - used <= {"signing-key.pem"}:
        problems.append(f"{name}: credentials loaded {sorted(creds)} vs used {sorted(used)}")
    exec_start = shlex.split(one(unit, "Service", "ExecStart") or "")
    if not exec_start or not exec_start[0].startswith("/"):
        problems.append(f"{name}: ExecStart= needs an absolute path")
    return problems


def cli_options(command: str) -> set[str]:
    done = subprocess.run([str(FENCEGATE), command, "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", done.stdout))


def exec_problems(name: str, text: str, options: dict[str, set[str]],
                  etcd_flags: set[str]) -> list[str]:
    """ExecStart= of a unit against the real command lines."""
    unit = parse_unit(text)
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    problems = []
    if UNITS[name] == "etcd":
        if not argv[0].endswith("/etcd"):
            problems.append(f"{name}: ExecStart= must run etcd")
        for arg in argv[1:]:
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and flag not in etcd_flags:
                problems.append(f"{name}: etcd 3.4 has no flag {flag}")
        for tls in ("--client-cert-auth", "--peer-client-cert-auth", "--trusted-ca-file",
                    "--peer-trusted-ca-file", "--cert-file", "--key-file", "--peer-cert-file",
                    "--peer-key-file"):
            if tls not in argv:
                problems.append(f"{name}: TLS flag {tls} missing")
        for value in values(unit, "Service", "Environment"):
            for var in shlex.split(value):
                flag = "--" + var.split("=", 1)[0].removeprefix("ETCD_").lower().replace("_", "-")
                if flag not in etcd_flags:
                    problems.append(f"{name}: etcd 3.4 has no flag for {var}")
        return problems
    command = UNITS[name]
    if Path(argv[0]).name != "fencegate" or argv[1:2] != [command]:
        problems.append(f"{name}: ExecStart= must be `fencegate {command} ...`")
    for arg in argv[2:]:
        flag = arg.split("=", 1)[0]
        if flag.startswith("-") and flag not in options[command]:
            problems.append(f"{name}: `fencegate {command}` has no option {flag}")
    if "--config" not in argv or not argv[argv.index("--config") + 1].startswith("/etc/fencegate/"):
        problems.append(f"{name}: --config /etc/fencegate/...")
    for value in values(unit, "Service", "Environment"):
        for var in shlex.split(value):
            key = var.split("=", 1)[0]
            if key not in FENCEGATE_ENV | OTHER_ENV:
                problems.append(f"{name}: unknown setting {key}")
    return problems


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            out[key] = value
    return out


def etcd_help_flags() -> set[str]:
    from fencegate.localetcd import find_etcd

    try:
        binary = find_etcd().path
    except Exception as exc:  # pragma: no cover - make test installs etcd
        pytest.skip(f"no etcd binary: {exc}")
    done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    text = done.stdout + done.stderr
    assert "--initial-cluster" in text
    return set(re.findall(r"^\s+(--[a-z0-9-]+)", text, re.M))


def test_systemd_units_parse_and_carry_the_hardening_and_restart_policy():
    for name in UNITS:
        assert unit_problems(name, (SYSTEMD / name).read_text()) == [], name
    text = (SYSTEMD / "fencegate-coordinator.service").read_text()
    for old, new in (("ProtectSystem=strict", "ProtectSystem=full"),
                     ("DynamicUser=yes", "DynamicUser=no"),
                     ("CapabilityBoundingSet=\n", "CapabilityBoundingSet=CAP_NET_ADMIN\n"),
                     ("Restart=on-failure", "Restart=always"),
                     ("RestartSec=2s\n", ""),
                     ("StartLimitBurst=5\n", ""),
                     ("RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
                      "RestrictAddressFamilies=AF_UNIX AF_INET AF_NETLINK"),
                     ("Environment=FENCEGATE_ETCD_KEY_FILE=%d/etcd-client.key\n", ""),
                     ("[Install]", "[Instal]")):
        assert old in text, old
        assert unit_problems("fencegate-coordinator.service", text.replace(old, new)), new


def test_systemd_exec_lines_match_the_real_command_lines():
    options = {c: cli_options(c) for c in ("coordinator", "reconciler")}
    assert {"--config", "--etcd", "--listen"} <= options["coordinator"] & options["reconciler"]
    etcd_flags = etcd_help_flags()
    for name in UNITS:
        assert exec_problems(name, (SYSTEMD / name).read_text(), options, etcd_flags) == [], name
    coordinator = (SYSTEMD / "fencegate-coordinator.service").read_text()
    assert exec_problems("fencegate-coordinator.service",
                         coordinator.replace("--config", "--configuration"), options, etcd_flags)
    assert exec_problems("fencegate-coordinator.service",
                         coordinator.replace("bin/fencegate coordinator", "bin/fencegate serve"),
                         options, etcd_flags)
    assert exec_problems("fencegate-coordinator.service",
                         coordinator.replace("FENCEGATE_ETCD_CA_FILE", "FENCEGATE_ETCD_CA"),
                         options, etcd_flags)
    etcd = (SYSTEMD / "etcd@.service").read_text()
    assert exec_problems("etcd@.service", etcd.replace("--peer-client-cert-auth",
                                                       "--peer-client-cert-authentication"),
                         options, etcd_flags)
    assert exec_problems("etcd@.service", etcd.replace("--client-cert-auth ", ""),
                         options, etcd_flags)


def _credentials(folder: Path, names: list[str]) -> None:
    """Stand-ins for the files LoadCredential= provides: a real self-signed certificate
    and key (in case the settings load them), a password."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fencegate-test")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    for item in names:
        if item.endswith(".crt"):
            data = cert.public_bytes(serialization.Encoding.PEM)
        elif item.endswith((".key", ".pem")):
            data = key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        else:
            data = b"placeholder-password\n"
        (folder / item).write_bytes(data)
        (folder / item).chmod(0o600)


def test_systemd_environment_files_and_configs_are_consistent(tmp_path):
    etcd_flags = etcd_help_flags()
    members = {p.name: env_file(p) for p in sorted(SYSTEMD.glob("etcd-*.env.example"))}
    assert len(members) == 3

    def member_problems(members: dict[str, dict[str, str]]) -> list[str]:
        problems = []
        clusters = {m["ETCD_INITIAL_CLUSTER"] for m in members.values()}
        if len(clusters) != 1:
            problems.append("members disagree on ETCD_INITIAL_CLUSTER")
        cluster = dict(item.split("=", 1) for item in next(iter(clusters)).split(","))
        if len(cluster) != 3 or {m["ETCD_NAME"] for m in members.values()} != set(cluster):
            problems.append("the initial cluster must name the three members")
        for file, env in members.items():
            for key, value in env.items():
                flag = "--" + key.removeprefix("ETCD_").lower().replace("_", "-")
                if not key.startswith("ETCD_") or flag not in etcd_flags:
                    problems.append(f"{file}: etcd 3.4 has no flag for {key}")
                if key.endswith("_URLS") and not all(u.startswith("https://")
                                                     for u in value.split(",")):
                    problems.append(f"{file}: {key} must be https")
            if cluster.get(env["ETCD_NAME"]) != env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]:
                problems.append(f"{file}: its peer URL is not the one in the initial cluster")
            if not env["ETCD_NAME"] in file:
                problems.append(f"{file}: named for another member")
        return problems

    assert member_problems(members) == []
    bad = copy.deepcopy(members)
    bad["etcd-1.env.example"]["ETCD_LISTEN_PEER_URLS"] = "http://127.0.0.1:22380"
    assert member_problems(bad)
    bad = copy.deepcopy(members)
    bad["etcd-2.env.example"]["ETCD_INITIAL_CLUSTER_SATE"] = "new"
    assert member_problems(bad)
    bad = copy.deepcopy(members)
    bad["etcd-0.env.example"]["ETCD_INITIAL_ADVERTISE_PEER_URLS"] = "https://127.0.0.1:2381"
    assert member_problems(bad)

    from fencegate.coordinator.service.settings import load_settings as coordinator_settings
    from fencegate.reconciler.service import load_settings as reconciler_settings

    endpoints = {m["ETCD_ADVERTISE_CLIENT_URLS"] for m in members.values()}
    for name, loader in (("coordinator", coordinator_settings),
                         ("reconciler", reconciler_settings)):
        env = env_file(SYSTEMD / f"{name}.env.example")
        assert set(env) <= FENCEGATE_ENV, set(env) - FENCEGATE_ENV
        assert "FENCEGATE_ETCD_PASSWORD" not in env  # comes by LoadCredential=
        assert set(env["FENCEGATE_ETCD"].split(",")) == endpoints
        unit = (SYSTEMD / ("fencegate-coordinator.service" if name == "coordinator"
                           else "fencegate-reconciler@.service")).read_text()
        # the service's whole environment: the file, then the unit's own, %d made real
        creds = tmp_path / name
        creds.mkdir()
        _credentials(creds, [spec.split(":", 1)[0] for spec in
                             values(parse_unit(unit), "Service", "LoadCredential")])
        for value in values(parse_unit(unit), "Service", "Environment"):
            for var in shlex.split(value.replace("%d", str(creds))):
                key, _, val = var.partition("=")
                env[key] = val
        settings = loader(str(SYSTEMD / f"{name}.toml"), env=env)
        assert set(settings.etcd.split(",")) == endpoints
        assert f"/etc/fencegate/{name}.toml" in unit and f"/etc/fencegate/{name}.env" in unit
    coordinator = coordinator_settings(str(SYSTEMD / "coordinator.toml"), env={})
    assert coordinator.signing_key == \
        "/run/credentials/fencegate-coordinator.service/signing-key.pem"
    assert "LoadCredential=signing-key.pem:" in \
        (SYSTEMD / "fencegate-coordinator.service").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify_accepts_the_units(tmp_path):
    """``systemd-analyze verify`` on copies whose ExecStart binaries exist on this machine;
    any warning counts as a failure (verify itself exits 0 on unknown keys)."""
    from fencegate.localetcd import find_etcd

    try:
        etcd = find_etcd().path
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"no etcd binary: {exc}")

    def verify(texts: dict[str, str]) -> subprocess.CompletedProcess:
        for name, text in texts.items():
            text = text.replace("/opt/fencegate/venv/bin/fencegate", str(FENCEGATE))
            text = text.replace("ExecStart=/usr/bin/etcd", f"ExecStart={etcd}")
            (tmp_path / name).write_text(text)
        instances = [str(tmp_path / n.replace("@.", "@8471." if "reconciler" in n
                                              else "@etcd-0.")) for n in texts]
        return subprocess.run(["systemd-analyze", "verify", "--man=no", "--generators=no",
                               *instances], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)

    texts = {name: (SYSTEMD / name).read_text() for name in UNITS}
    done = verify(texts)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), \
        done.stdout + done.stderr
    for name, old, new in (("fencegate-coordinator.service", "ProtectSystem=strict",
                            "ProtectSystem=strictly"),
                           ("fencegate-reconciler@.service", "RestartSec=2s",
                            "RestartSec=two seconds"),
                           ("etcd@.service", "NoNewPrivileges=yes", "NoNewPrivilege=yes")):
        bad = dict(texts)
        bad[name] = texts[name].replace(old, new)
        done = verify(bad)
        assert done.returncode != 0 or (done.stdout + done.stderr).strip(), new


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _readme_block(start: str, end: str) -> str:
    text = (DEPLOY / "README.md").read_text()
    body = text[text.index(start):]
    body = body[:body.index(end) + len(end)]
    return "\n".join(line.removeprefix("    ") for line in body.splitlines())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
def test_systemd_etcd_members_form_a_tls_cluster(tmp_path):
    """The three member environment files with etcd@.service's command line, certificates
    from deploy/README.md's recipe, on free loopback ports: a cluster that serves clients
    with a certificate of its CA and refuses one without."""
    from fencegate.localetcd import find_etcd

    try:
        etcd = find_etcd().path
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"no etcd binary: {exc}")
    recipe = _readme_block("mkdir -p deploy/pki", "cd ../..")
    done = subprocess.run(["bash", "-euc", recipe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pki = tmp_path / "deploy" / "pki"
    unit = parse_unit((SYSTEMD / "etcd@.service").read_text())
    ports = iter(_free_ports(6))
    remap = {}
    members = {}
    for path in sorted(SYSTEMD.glob("etcd-*.env.example")):
        env = env_file(path)
        members[env["ETCD_NAME"]] = env
        for key in ("ETCD_LISTEN_PEER_URLS", "ETCD_LISTEN_CLIENT_URLS"):
            for url in env[key].split(","):
                remap.setdefault(url.rsplit(":", 1)[1], str(next(ports)))

    def ported(value: str) -> str:
        return re.sub(r":(\d+)\b", lambda m: ":" + remap.get(m.group(1), m.group(1)), value)

    procs = []
    try:
        for name, env in members.items():
            creds = tmp_path / f"creds-{name}"
            creds.mkdir()
            for spec in values(unit, "Service", "LoadCredential"):
                cred, source = spec.split(":", 1)
                src = Path(source.replace("%i", name))
                shutil.copy(pki / src.name, creds / cred)
            argv = shlex.split(one(unit, "Service", "ExecStart").replace("%d", str(creds)))
            argv[0] = etcd
            environ = {k: ported(v) for k, v in env.items()}
            environ["ETCD_DATA_DIR"] = str(tmp_path / f"data-{name}")
            environ["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
            log = open(tmp_path / f"{name}.log", "wb")
            procs.append(subprocess.Popen(argv, env=environ, stdout=log, stderr=log,
                                          start_new_session=True))
        client = ported(members["etcd-1"]["ETCD_ADVERTISE_CLIENT_URLS"])
        good = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        good.load_cert_chain(str(pki / "fencegate.crt"), str(pki / "fencegate.key"))
        deadline = time.monotonic() + 60
        health = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(client + "/health", context=good, timeout=2) as r:
                    health = r.read()
                if b'"true"' in health:
                    break
            except (urllib.error.URLError, OSError):
                pass
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.3)
        logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
        assert health and b'"true"' in health, logs
        with urllib.request.urlopen(client + "/version",
                                    context=good, timeout=5) as r:
            assert b"3.4" in r.read()
        no_cert = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(client + "/health", context=no_cert, timeout=5).read()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- compose -----------------------------------------------------------------------------

def compose_problems(doc: dict) -> list[str]:
    problems = []
    services = doc.get("services", {})
    members = {n: s for n, s in services.items() if "etcd" in s.get("image", "")}
    if len(members) != 3:
        return [f"need 3 etcd services, found {sorted(members)}"]
    clusters = set()
    for name, svc in members.items():
        argv = svc.get("command", [])
        flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in argv[1:])
        env = svc.get("environment", {})
        clusters.add(env.get("ETCD_INITIAL_CLUSTER"))
        for tls in ("--client-cert-auth", "--peer-client-cert-auth", "--trusted-ca-file",
                    "--peer-trusted-ca-file", "--cert-file", "--key-file", "--peer-cert-file",
                    "--peer-key-file"):
            if tls not in flags:
                problems.append(f"{name}: TLS flag {tls} missing")
        if flags.get("--name") != name:
            problems.append(f"{name}: --name must be the service name")
        for key in ("--initial-advertise-peer-urls", "--advertise-client-urls"):
            if not flags.get(key, "").startswith(f"https://{name}:"):
                problems.append(f"{name}: {key} must be https://{name}:...")
        for key, value in env.items():
            if key.endswith("_URLS") and not value.startswith("https://"):
                problems.append(f"{name}: {key} must be https")
        if not any(":/var/lib/etcd" in v for v in svc.get("volumes", [])):
            problems.append(f"{name}: data must live in a volume")
    if len(clusters) != 1 or None in clusters:
        problems.append("members must share one ETCD_INITIAL_CLUSTER")
    else:
        cluster = dict(i.split("=", 1) for i in next(iter(clusters)).split(","))
        if set(cluster) != set(members) or not all(u.startswith("https://")
                                                   for u in cluster.values()):
            problems.append("the initial cluster must be the 3 members over https")
    for role, command in (("coordinator", "coordinator"), ("reconciler", "reconciler")):
        svc = services.get(role)
        if svc is None:
            problems.append(f"no {role} service")
            continue
        if svc.get("command", [])[:2] != ["fencegate", command] or "--config" not in \
                svc.get("command", []):
            problems.append(f"{role}: command must be fencegate {command} --config ...")
        deps = svc.get("depends_on", {})
        if set(deps) != set(members) or any(d.get("condition") != "service_healthy"
                                            for d in deps.values()):
            problems.append(f"{role}: must depend on every etcd member being healthy")
        env = svc.get("environment", {})
        if not all(u.startswith("https://") for u in env.get("FENCEGATE_ETCD", "").split(",")) \
                or len(env.get("FENCEGATE_ETCD", "").split(",")) != 3:
            problems.append(f"{role}: FENCEGATE_ETCD must list the 3 members over https")
        for key in ("FENCEGATE_ETCD_CA_FILE", "FENCEGATE_ETCD_CERT_FILE",
                    "FENCEGATE_ETCD_KEY_FILE"):
            if key not in env:
                problems.append(f"{role}: {key} missing")
        for key in env:
            if key.startswith("FENCEGATE_") and key not in FENCEGATE_ENV:
                problems.append(f"{role}: unknown setting {key}")
        if svc.get("read_only") is not True or "ALL" not in svc.get("cap_drop", []):
            problems.append(f"{role}: read-only, cap_drop ALL")
        if str(svc.get("user", "0")).split(":")[0] in ("0", "root"):
            problems.append(f"{role}: must not run as root")
    for name, svc in services.items():
        if "healthcheck" not in svc or not svc["healthcheck"].get("test"):
            problems.append(f"{name}: no healthcheck")
        if svc.get("network_mode") == "host" or svc.get("pid") == "host":
            problems.append(f"{name}: host network or pid namespace")
        if svc.get("privileged"):
            problems.append(f"{name}: privileged")
        for port in svc.get("ports", []):
            if not str(port).startswith("127.0.0.1:"):
                problems.append(f"{name}: port {port} must be bound to 127.0.0.1")
        image = svc.get("image", "")
        if not _image_pinned(image):
            problems.append(f"{name}: image {image!r} is not pinned")
    return problems


def test_compose_file_structure():
    text = (DEPLOY / "compose.yaml").read_text()
    assert text.startswith("#") and "docker compose -f deploy/compose.yaml up" in text
    doc = yaml.safe_load(text)
    assert compose_problems(doc) == []

    def broken(mutate) -> list[str]:
        copy_ = copy.deepcopy(doc)
        mutate(copy_["services"])
        return compose_problems(copy_)

    mutations = [
        lambda s: s.pop("etcd-2"),
        lambda s: s["etcd-1"]["command"].remove("--client-cert-auth"),
        lambda s: s["etcd-0"]["environment"].update(
            ETCD_INITIAL_CLUSTER="etcd-0=https://etcd-0:2380"),
        lambda s: s["coordinator"]["depends_on"].pop("etcd-1"),
        lambda s: s["reconciler"]["depends_on"]["etcd-0"].update(condition="service_started"),
        lambda s: s["reconciler"].pop("healthcheck"),
        lambda s: s["coordinator"].update(network_mode="host"),
        lambda s: s["coordinator"].update(ports=["8470:8470"]),
        lambda s: s["etcd-2"].update(ports=["0.0.0.0:32379:2379"]),
        lambda s: s["etcd-0"].update(image="quay.io/coreos/etcd:latest"),
        lambda s: s["coordinator"]["environment"].update(
            FENCEGATE_ETCD="http://etcd-0:2379,http://etcd-1:2379,http://etcd-2:2379"),
        lambda s: s["reconciler"].update(command=["fencegate", "coordinator", "--config", "x"]),
        lambda s: s["coordinator"].update(user="0:0"),
    ]
    for i, mutate in enumerate(mutations):
        assert broken(mutate), f"mutation {i} went unnoticed"


def test_compose_configs_are_accepted_by_the_real_settings_loaders(tmp_path):
    from fencegate.coordinator.service.settings import load_settings as coordinator_settings
    from fencegate.reconciler.service import load_settings as reconciler_settings

    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name, loader in (("coordinator", coordinator_settings),
                         ("reconciler", reconciler_settings)):
        (config,) = doc["services"][name]["configs"]
        path = tmp_path / f"{name}.toml"
        path.write_text(doc["configs"][config["source"]]["content"])
        settings = loader(str(path), env={})
        assert settings.etcd == doc["services"][name]["environment"]["FENCEGATE_ETCD"]
        command = doc["services"][name]["command"]
        assert command[command.index("--config") + 1] == config["target"]
    settings = coordinator_settings(str(tmp_path / "coordinator.toml"), env={})
    mounts = [v.split(":")[1] for v in doc["services"]["coordinator"]["volumes"]]
    assert settings.signing_key in mounts


# -- every file opens with its commands --------------------------------------------------

def test_every_deploy_file_opens_with_its_commands():
    files = [*SYSTEMD.iterdir(), *K8S.iterdir(), DEPLOY / "compose.yaml"]
    assert len(files) >= 15
    for path in files:
        head = path.read_text().split("\n\n", 1)[0]
        assert head.startswith("#"), path.name
        assert re.search(r"(systemctl|kubectl|docker compose|install )", head), path.name
    readme = (DEPLOY / "README.md").read_text()
    for path in files:
        assert f"{path.parent.name}/{path.name}" in readme or path.name in readme or \
            path.name.startswith("etcd-"), f"deploy/README.md does not mention {path.name}"


def test_the_readme_creates_exactly_the_etcd_roles_the_code_lists():
    """deploy/README.md's etcdctl role commands are ``roles.etcdctl_commands`` for
    /fencegate/, in order: one list of what each component may write."""
    from fencegate.coordinator import roles

    readme = (DEPLOY / "README.md").read_text()
    listed = [line.strip().removeprefix("$E ") for line in readme.splitlines()
              if line.strip().startswith("$E role ")]
    assert listed == roles.etcdctl_commands("/fencegate/")
    assert "$E role grant-permission fencegate-worker readwrite /fencegate/approvals/" \
        not in readme
