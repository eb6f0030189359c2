"""The deployment files, offline. ``compose.yaml`` and ``compose.cluster.yaml`` against the
Compose specification's JSON schema (as check-jsonschema bundles it); the Kubernetes
manifests in ``deploy/kubernetes/`` against the Kubernetes API's schemas (as
kubernetes-validate bundles them, strict: an unknown field is an error). Then what no
schema says about a cluster (issue 44): each host's node id its own, its UDP range its
own and the one published, its advertise URL naming itself, its grace period longer than
its drain, its ``--cluster`` URL naming the Redis service. Every check is also run on a
broken copy, which it must refuse. Nothing here reaches the network."""

from __future__ import annotations

import base64
import copy
import json
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

# The test extra's (pip install -e '.[test]'); where absent, this module skips and says so.
REASON = "needs the test extra's schema packages: pip install -e '.[test]'"
jsonschema = pytest.importorskip("jsonschema", reason=REASON)
get_builtin_schema = pytest.importorskip("check_jsonschema.builtin_schemas",
                                         reason=REASON).get_builtin_schema
kubernetes_validate = pytest.importorskip("kubernetes_validate.utils", reason=REASON)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
MANIFESTS = ("redis.yaml", "avatar-hosts.yaml", "avatar-service.yaml")
NODE_ID = re.compile(r"[a-z0-9-]{1,40}")  # cluster.node_id's alphabet and length
DRAIN = "cluster.drain_timeout_s"


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemas are the packages' own files: any connection or name look-up fails."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tests/test_deploy_manifests.py must not use the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ---------------------------------------------------------------------------------------
# Reading the files


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT (Dockerfile, exec form): what every host's arguments follow."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    found = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert found, "Dockerfile has no exec-form ENTRYPOINT"
    return json.loads(found.group(1))


def options(argv: list[str]) -> list[tuple[str, str]]:
    """``--flag value`` and ``--flag=value`` pairs, in order."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            pairs.append(tuple(arg.split("=", 1)))
        elif arg.startswith("--") and i + 1 < len(argv):
            pairs.append((arg, argv[i + 1]))
            i += 1
        i += 1
    return pairs  # type: ignore[return-value]


def option(argv: list[str], flag: str) -> list[str]:
    return [value for name, value in options(argv) if name == flag]


def settings(argv: list[str]) -> dict[str, str]:
    """``--set SECTION.KEY=VALUE`` overrides, the last of each winning (as the server does),
    with ``--port`` as http.port."""
    out: dict[str, str] = {}
    for name, value in options(argv):
        if name == "--set":
            key, _, setting = value.partition("=")
            out[key.strip()] = setting.strip()
        elif name == "--port":
            out["http.port"] = value
    return out


def udp_range(value: str) -> tuple[int, int]:
    low, high = (int(p) for p in value.split(","))
    return low, high


def seconds(duration: str | int | float) -> float:
    """A Compose duration (``150s``, ``2m30s``) in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def published(ports: list[Any]) -> list[tuple[tuple[int, int], tuple[int, int], str]]:
    """Compose ports as (host range, container range, protocol)."""
    out = []
    for port in ports:
        if isinstance(port, dict):
            target = str(port["target"])
            host = str(port.get("published", target))
            protocol = port.get("protocol", "tcp")
        else:
            spec, _, protocol = str(port).partition("/")
            protocol = protocol or "tcp"
            parts = spec.split(":")
            target, host = parts[-1], parts[-2] if len(parts) > 1 else parts[-1]

        def span(text: str) -> tuple[int, int]:
            low, _, high = text.partition("-")
            return int(low), int(high or low)
        out.append((span(host), span(target), protocol))
    return out


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


# ---------------------------------------------------------------------------------------
# The schemas


def compose_errors(doc: Any) -> list[str]:
    schema = get_builtin_schema("vendor.compose-spec")
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in validator.iter_errors(doc)]


def kubernetes_versions() -> list[str]:
    """The oldest and the newest Kubernetes whose schemas kubernetes-validate bundles."""
    versions = kubernetes_validate.all_versions()
    return sorted({versions[0], versions[-1]})


def kubernetes_error(doc: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(map(str, e.path))}: {e.message}"
    return None


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cluster.yaml"])
def test_compose_files_match_the_compose_specification(name: str) -> None:
    assert compose_errors(load(ROOT / name)) == []


def test_the_compose_schema_refuses_a_broken_file() -> None:
    doc = load(ROOT / "compose.cluster.yaml")
    doc["services"]["avatar-1"]["stop_grace_periods"] = "1s"  # no such key
    doc["services"]["avatar-2"]["ports"] = "8082:8080"  # a list, not a string
    errors = compose_errors(doc)
    assert any("stop_grace_periods" in e for e in errors), errors
    assert any(e.startswith("services.avatar-2.ports") for e in errors), errors


@pytest.mark.parametrize("version", kubernetes_versions())
@pytest.mark.parametrize("name", MANIFESTS)
def test_kubernetes_manifests_match_the_api_schemas(name: str, version: str) -> None:
    docs = list(yaml.safe_load_all((KUBERNETES / name).read_text()))
    assert docs and all(docs)
    for doc in docs:
        assert kubernetes_error(doc, version) is None, (name, doc["kind"])


@pytest.mark.parametrize("version", kubernetes_versions())
def test_the_generated_secret_matches_the_api_schema(version: str) -> None:
    """The Secret kustomize makes from api-keys.env (here from its example)."""
    name, keys = secret_generator()
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": name},
              "data": {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()}}
    assert kubernetes_error(secret, version) is None


def test_the_kubernetes_schemas_refuse_a_broken_manifest() -> None:
    version = kubernetes_versions()[-1]
    sts = statefulset(kubernetes_docs())
    typo = copy.deepcopy(sts)
    typo["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 150
    assert "terminationGracePeriodSecond" in (kubernetes_error(typo, version) or "")
    wrong = copy.deepcopy(sts)
    wrong["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8080"
    assert "is not of type 'integer'" in (kubernetes_error(wrong, version) or "")


# ---------------------------------------------------------------------------------------
# compose.cluster.yaml: what the schema cannot say


def compose_hosts(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the server as a cluster host (their command has --cluster)."""
    return {name: service for name, service in doc["services"].items()
            if "--cluster" in (service.get("command") or [])}


def cluster_compose_problems(doc: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    services = doc["services"]
    hosts = compose_hosts(doc)
    if len(hosts) < 2:
        return [f"{len(hosts)} cluster hosts (services with --cluster); a cluster needs 2"]
    ranges: dict[str, tuple[int, int]] = {}
    node_ids: dict[str, str] = {}
    for name, host in hosts.items():
        argv = entrypoint() + list(host["command"])
        given = settings(argv)
        http_port = int(given["http.port"])
        ports = published(host.get("ports", []))

        ids = option(argv, "--node-id")
        if len(ids) != 1 or not NODE_ID.fullmatch(ids[0]):
            problems.append(f"{name}: --node-id {ids}: one id of [a-z0-9-], at most 40")
        elif ids[0] in node_ids:
            problems.append(f"{name}: --node-id {ids[0]} is {node_ids[ids[0]]}'s too")
        else:
            node_ids[ids[0]] = name

        urls = option(argv, "--advertise-url")
        url = urlsplit(urls[0]) if len(urls) == 1 else None
        if url is None or url.scheme != "http" or url.hostname != name \
                or url.port != http_port:
            problems.append(f"{name}: --advertise-url {urls} must be http://{name}:"
                            f"{http_port} (the service's own name, its HTTP port inside)")

        clusters = option(argv, "--cluster")
        redis = urlsplit(clusters[0]) if len(clusters) == 1 else None
        target = services.get(redis.hostname or "") if redis else None
        if redis is None or redis.scheme != "redis" or target is None \
                or not str(target.get("image", "")).startswith("redis:") \
                or redis.port != 6379 or not re.fullmatch(r"/\d+", redis.path):
            problems.append(f"{name}: --cluster {clusters} must be redis://SERVICE:6379/DB "
                            "naming this file's Redis service")
        elif redis.hostname not in _depends_on(host):
            problems.append(f"{name}: does not depend on {redis.hostname}")

        if "ice.udp_ports" not in given:
            problems.append(f"{name}: no ice.udp_ports")
        else:
            low, high = ranges[name] = udp_range(given["ice.udp_ports"])
            if ((low, high), (low, high), "udp") not in ports:
                problems.append(f"{name}: ice.udp_ports={low},{high} is not published as "
                                f"{low}-{high}:{low}-{high}/udp")
        udp = [p for p in ports if p[2] == "udp"]
        if len(udp) != 1:
            problems.append(f"{name}: {len(udp)} published UDP ranges; one, its media")
        if not any(p[1] == (http_port, http_port) and p[2] == "tcp" for p in ports):
            problems.append(f"{name}: its HTTP port {http_port} is not published")

        # A bridged container has only its bridge address: --ice-host would bind another.
        if host.get("network_mode") != "host":
            if option(argv, "--ice-host"):
                problems.append(f"{name}: --ice-host on a bridged container binds an address "
                                "it does not have (no host candidates)")
            if not given.get("ice.servers", "").startswith("turn:"):
                problems.append(f"{name}: bridged, so its peers need ice.servers=turn:...")

        if DRAIN not in given:
            problems.append(f"{name}: no --set {DRAIN}")
        elif seconds(host.get("stop_grace_period", "10s")) <= float(given[DRAIN]):
            problems.append(f"{name}: stop_grace_period {host.get('stop_grace_period')} is "
                            f"not longer than {DRAIN}={given[DRAIN]}")

        keys = (host.get("environment") or {}).get("SONIC_API_KEYS", "")
        if not re.fullmatch(r"\$\{SONIC_API_KEYS:\?[^}]+\}", str(keys)):
            problems.append(f"{name}: SONIC_API_KEYS must be required: ${{SONIC_API_KEYS:?...}}")

        probe = " ".join((host.get("healthcheck") or {}).get("test", []))
        if f"127.0.0.1:{http_port}/healthz" not in probe:
            problems.append(f"{name}: its healthcheck does not ask /healthz")

    for (a, ra), (b, rb) in ((x, y) for x in ranges.items() for y in ranges.items()
                             if x[0] < y[0]):
        if overlap(ra, rb):
            problems.append(f"{a} and {b}: UDP ranges {ra} and {rb} overlap")
    all_published = [(name, p) for name, s in services.items()
                     for p in published(s.get("ports", []))]
    for i, (a, pa) in enumerate(all_published):
        for b, pb in all_published[i + 1:]:
            if pa[2] == pb[2] and overlap(pa[0], pb[0]):
                problems.append(f"{a} and {b} publish the same {pa[2]} port ({pa[0]}, {pb[0]})")
    if len({str((h.get("environment") or {}).get("SONIC_API_KEYS")) for h in hosts.values()
            }) != 1:
        problems.append("the hosts' SONIC_API_KEYS differ")
    return problems


def _depends_on(service: dict[str, Any]) -> list[str]:
    depends = service.get("depends_on") or []
    return list(depends) if isinstance(depends, (list, dict)) else []


def test_the_cluster_compose_file_holds_together() -> None:
    doc = load(ROOT / "compose.cluster.yaml")
    assert set(compose_hosts(doc)) == {"avatar-1", "avatar-2"}
    assert cluster_compose_problems(doc) == []


def _set(command: list[str], key: str, value: str) -> None:
    command[command.index(next(a for a in command if a.startswith(key + "=")))] = \
        f"{key}={value}"


def _unset(command: list[str], key: str) -> None:
    at = command.index(next(a for a in command if a.startswith(key + "=")))
    del command[at - 1:at + 1]  # --set and its value


def _flag(command: list[str], flag: str, value: str) -> None:
    command[command.index(flag) + 1] = value


COMPOSE_BREAKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "same node id": lambda d: _flag(d["services"]["avatar-2"]["command"], "--node-id",
                                    "avatar-1"),
    "node id alphabet": lambda d: _flag(d["services"]["avatar-1"]["command"], "--node-id",
                                        "Avatar_1"),
    "advertises the other host": lambda d: _flag(d["services"]["avatar-2"]["command"],
                                                 "--advertise-url", "http://avatar-1:8080"),
    "advertises the published port": lambda d: _flag(
        d["services"]["avatar-1"]["command"], "--advertise-url", "http://avatar-1:8081"),
    "udp range not published": lambda d: _set(d["services"]["avatar-2"]["command"],
                                              "ice.udp_ports", "40200,40299"),
    "udp ranges overlap": lambda d: (
        _set(d["services"]["avatar-2"]["command"], "ice.udp_ports", "40050,40149"),
        d["services"]["avatar-2"].__setitem__("ports", ["8082:8080",
                                                        "40050-40149:40050-40149/udp"])),
    "same http port": lambda d: d["services"]["avatar-2"]["ports"].__setitem__(
        0, "8081:8080"),
    "cluster names no redis": lambda d: _flag(d["services"]["avatar-1"]["command"],
                                              "--cluster", "redis://turn:6379/0"),
    "cluster url unknown host": lambda d: _flag(d["services"]["avatar-2"]["command"],
                                                "--cluster", "redis://cache:6379/0"),
    "grace not past drain": lambda d: d["services"]["avatar-1"].__setitem__(
        "stop_grace_period", "2m"),
    "no drain timeout": lambda d: _unset(d["services"]["avatar-2"]["command"], DRAIN),
    "ice host bound to an absent address": lambda d: d["services"]["avatar-1"][
        "command"].extend(["--ice-host", "${PUBLIC_IP}"]),
    "keys optional": lambda d: d["services"]["avatar-1"].__setitem__(
        "environment", {"SONIC_API_KEYS": "${SONIC_API_KEYS}"}),
    "one host": lambda d: d["services"].pop("avatar-2"),
}


@pytest.mark.parametrize("name", COMPOSE_BREAKS)
def test_a_broken_cluster_compose_file_is_refused(name: str) -> None:
    doc = load(ROOT / "compose.cluster.yaml")
    # The anchor's mappings are shared between services: break one service only.
    doc["services"] = copy.deepcopy(doc["services"])
    COMPOSE_BREAKS[name](doc)
    assert cluster_compose_problems(doc), name


def test_the_single_server_compose_file_publishes_the_image_range() -> None:
    avatar = load(ROOT / "compose.yaml")["services"]["avatar"]
    low, high = udp_range(settings(entrypoint() + avatar.get("command", []))["ice.udp_ports"])
    assert ((low, high), (low, high), "udp") in published(avatar["ports"])
    assert re.fullmatch(r"\$\{SONIC_API_KEYS:\?[^}]+\}", avatar["environment"]["SONIC_API_KEYS"])


# ---------------------------------------------------------------------------------------
# deploy/kubernetes/: what the schemas cannot say


def kubernetes_docs() -> list[dict[str, Any]]:
    return [doc for name in MANIFESTS
            for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def kustomization() -> dict[str, Any]:
    return load(KUBERNETES / "kustomization.yaml")


def secret_generator() -> tuple[str, dict[str, str]]:
    """The generated Secret's name and its keys, as the example env file gives them."""
    (generator,) = kustomization()["secretGenerator"]
    (env,) = generator["envs"]
    text = (KUBERNETES / (env + ".example")).read_text()
    keys = dict(line.split("=", 1) for line in text.splitlines()
                if line.strip() and not line.startswith("#"))
    return generator["name"], keys


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None
         ) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def statefulset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (sts,) = find(docs, "StatefulSet")
    return sts


def selects(service: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def port_number(container: dict[str, Any], port: int | str) -> int | None:
    if isinstance(port, int):
        return port
    return next((p["containerPort"] for p in container.get("ports", [])
                 if p.get("name") == port), None)


def kubernetes_problems(docs: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    sts = statefulset(docs)
    name = sts["metadata"]["name"]
    pod = sts["spec"]["template"]
    spec = pod["spec"]
    labels = pod["metadata"]["labels"]
    hosts = [c for c in spec["containers"] if "--cluster" in c.get("args", [])]
    if len(hosts) != 1:
        return [f"{len(hosts)} containers run the server with --cluster; one"]
    (server,) = hosts
    argv = entrypoint() + server["args"]
    given = settings(argv)
    http_port = int(given["http.port"])
    env = {e["name"]: e.get("valueFrom", {}) for e in server.get("env", [])}

    def field(var: str) -> str | None:
        return env.get(var, {}).get("fieldRef", {}).get("fieldPath")

    for var in sorted(set(re.findall(r"\$\((\w+)\)", " ".join(server["args"])))):
        if var not in env:
            problems.append(f"args use $({var}), which the container's env does not define")

    # Node ids: the pods' names, each of the node id alphabet, all distinct by construction.
    if option(argv, "--node-id") != ["$(POD_NAME)"] or field("POD_NAME") != "metadata.name":
        problems.append("--node-id must be $(POD_NAME), the pod's name (metadata.name)")
    for ordinal in range(sts["spec"].get("replicas", 1)):
        if not NODE_ID.fullmatch(f"{name}-{ordinal}"):
            problems.append(f"pod {name}-{ordinal} is no node id ([a-z0-9-], at most 40)")

    # The advertise URL: the pod's own name in the StatefulSet's headless Service.
    governing = sts["spec"].get("serviceName")
    want = (f"http://$(POD_NAME).{governing}.$(POD_NAMESPACE).svc.cluster.local:"
            f"{http_port}")
    if option(argv, "--advertise-url") != [want] \
            or field("POD_NAMESPACE") != "metadata.namespace":
        problems.append(f"--advertise-url must be {want} (POD_NAMESPACE: metadata.namespace)")
    headless = find(docs, "Service", governing)
    if not headless or headless[0]["spec"].get("clusterIP") != "None" \
            or not selects(headless[0], labels):
        problems.append(f"serviceName {governing}: no headless Service selecting the hosts")
    elif not headless[0]["spec"].get("publishNotReadyAddresses"):
        problems.append(f"{governing}: publishNotReadyAddresses must be true (a draining "
                        "host keeps its name for the sessions it holds)")
    clients = [s for s in find(docs, "Service") if s["spec"].get("clusterIP") != "None"
               and selects(s, labels)]
    if not clients or any(port_number(server, p.get("targetPort", p["port"])) != http_port
                          for s in clients for p in s["spec"]["ports"]):
        problems.append("no clients' Service to the hosts' HTTP port")

    # Media: the node's own address, bound and announced; one host per node.
    if option(argv, "--ice-host") != ["$(HOST_IP)"] or field("HOST_IP") != "status.hostIP":
        problems.append("--ice-host must be $(HOST_IP), the node's address (status.hostIP)")
    if spec.get("hostNetwork") is not True:
        problems.append("hostNetwork must be true: --ice-host binds the node's address")
    if spec.get("dnsPolicy") != "ClusterFirstWithHostNet":
        problems.append("dnsPolicy must be ClusterFirstWithHostNet to resolve Services")
    anti = (spec.get("affinity", {}).get("podAntiAffinity", {})
            .get("requiredDuringSchedulingIgnoredDuringExecution", []))
    if not any(term.get("topologyKey") == "kubernetes.io/hostname"
               and all(labels.get(k) == v for k, v in
                       term.get("labelSelector", {}).get("matchLabels", {}).items())
               and term.get("labelSelector", {}).get("matchLabels")
               for term in anti):
        problems.append("no required anti-affinity keeping hosts on distinct nodes "
                        "(their UDP ranges and HTTP port are the node's)")
    if "ice.udp_ports" not in given:
        problems.append("no ice.udp_ports")
    else:
        low, high = udp_range(given["ice.udp_ports"])
        if not 1024 <= low <= high <= 65535 or low <= http_port <= high:
            problems.append(f"ice.udp_ports={low},{high}: within 1024-65535, apart from "
                            f"HTTP {http_port}")

    # Drain: the kubelet waits longer than the host drains.
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if DRAIN not in given:
        problems.append(f"no --set {DRAIN}")
    elif grace <= float(given[DRAIN]):
        problems.append(f"terminationGracePeriodSeconds {grace} is not longer than "
                        f"{DRAIN}={given[DRAIN]}")

    # --cluster names the Redis Service, which selects a Redis pod on that port.
    clusters = option(argv, "--cluster")
    redis = urlsplit(clusters[0]) if len(clusters) == 1 else None
    host = (redis.hostname or "").split(".")[0] if redis else ""
    service = find(docs, "Service", host)
    behind = [d for d in find(docs, "Deployment") if service
              and selects(service[0], d["spec"]["template"]["metadata"]["labels"])]
    ok = (redis is not None and redis.scheme == "redis" and re.fullmatch(r"/\d+", redis.path)
          and len(behind) == 1 and any(p["port"] == redis.port
                                       for p in service[0]["spec"]["ports"]))
    if ok:
        (redis_port,) = [p for p in service[0]["spec"]["ports"] if p["port"] == redis.port]
        containers = behind[0]["spec"]["template"]["spec"]["containers"]
        ok = any(c["image"].startswith("redis:")
                 and port_number(c, redis_port.get("targetPort", redis_port["port"])) == 6379
                 for c in containers)
    if not ok:
        problems.append(f"--cluster {clusters} must be redis://SERVICE:PORT/DB naming the "
                        "Service in front of the Redis Deployment")

    # Probes: ready on /healthz (503 while calibrating); alive without it.
    ready = server.get("readinessProbe", {}).get("httpGet", {})
    if ready.get("path") != "/healthz" or port_number(server, ready.get("port")) != http_port:
        problems.append("the readiness probe must be GET /healthz on the HTTP port")
    live = server.get("livenessProbe")
    if not live or live.get("httpGet", {}).get("path") == "/healthz":
        problems.append("a liveness probe is needed, not /healthz (503 while calibrating)")

    # API keys: the same Secret for every host, the one kustomization.yaml makes.
    secret, keys = secret_generator()
    ref = env.get("SONIC_API_KEYS", {}).get("secretKeyRef", {})
    if ref.get("name") != secret or ref.get("key") not in keys:
        problems.append(f"SONIC_API_KEYS must come from Secret {secret} (key in {list(keys)})")
    return problems


def test_the_kubernetes_manifests_hold_together() -> None:
    assert kubernetes_problems(kubernetes_docs()) == []


def _host(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return statefulset(docs)["spec"]["template"]["spec"]["containers"][0]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return statefulset(docs)["spec"]["template"]["spec"]


def _env(docs: list[dict[str, Any]], var: str) -> dict[str, Any]:
    return next(e for e in _host(docs)["env"] if e["name"] == var)


KUBERNETES_BREAKS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "grace not past drain": lambda d: _pod(d).__setitem__(
        "terminationGracePeriodSeconds", 120),
    "no grace period": lambda d: _pod(d).pop("terminationGracePeriodSeconds"),
    "cluster names no service": lambda d: _flag(_host(d)["args"], "--cluster",
                                                "redis://redis:6379/0"),
    "cluster names the hosts": lambda d: _flag(_host(d)["args"], "--cluster",
                                               "redis://sonic-avatar:8080/0"),
    "advertise another service": lambda d: _flag(
        _host(d)["args"], "--advertise-url",
        "http://$(POD_NAME).sonic-avatar.$(POD_NAMESPACE).svc.cluster.local:8080"),
    "advertise wrong port": lambda d: _flag(
        _host(d)["args"], "--advertise-url",
        "http://$(POD_NAME).sonic-avatar-hosts.$(POD_NAMESPACE).svc.cluster.local:80"),
    "node id not the pod": lambda d: _env(d, "POD_NAME")["valueFrom"]["fieldRef"]
    .__setitem__("fieldPath", "spec.nodeName"),
    "undefined variable": lambda d: _host(d)["env"].remove(_env(d, "HOST_IP")),
    "ice host the pod": lambda d: _env(d, "HOST_IP")["valueFrom"]["fieldRef"]
    .__setitem__("fieldPath", "status.podIP"),
    "no host network": lambda d: _pod(d).pop("hostNetwork"),
    "no anti-affinity": lambda d: _pod(d).pop("affinity"),
    "anti-affinity only preferred": lambda d: _pod(d)["affinity"].__setitem__(
        "podAntiAffinity", {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": _pod(d)["affinity"]["podAntiAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"][0]}]}),
    "anti-affinity per os": lambda d: _pod(d)["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"][0].__setitem__(
        "topologyKey", "kubernetes.io/os"),
    "dns of the node": lambda d: _pod(d).__setitem__("dnsPolicy", "ClusterFirst"),
    "not-ready hosts unnamed": lambda d: find(d, "Service", "sonic-avatar-hosts")[0][
        "spec"].pop("publishNotReadyAddresses"),
    "governing service not headless": lambda d: find(d, "Service", "sonic-avatar-hosts")[0][
        "spec"].pop("clusterIP"),
    "readiness elsewhere": lambda d: _host(d)["readinessProbe"]["httpGet"].__setitem__(
        "path", "/"),
    "liveness on healthz": lambda d: _host(d).__setitem__(
        "livenessProbe", {"httpGet": {"path": "/healthz", "port": "http"}}),
    "other secret": lambda d: _env(d, "SONIC_API_KEYS")["valueFrom"]["secretKeyRef"]
    .__setitem__("name", "api-keys"),
    "long name": lambda d: statefulset(d)["metadata"].__setitem__("name", "s" * 40),
    "redis service selects nothing": lambda d: find(d, "Service", "sonic-redis")[0][
        "spec"]["selector"].__setitem__("app.kubernetes.io/name", "redis"),
    "udp range over http": lambda d: _set(_host(d)["args"], "ice.udp_ports", "8000,8099"),
    "no drain timeout": lambda d: _unset(_host(d)["args"], DRAIN),
}


@pytest.mark.parametrize("name", KUBERNETES_BREAKS)
def test_a_broken_kubernetes_manifest_is_refused(name: str) -> None:
    docs = kubernetes_docs()
    KUBERNETES_BREAKS[name](docs)
    assert kubernetes_problems(docs), name


def test_the_kustomization_names_every_manifest_and_the_image() -> None:
    kustom = kustomization()
    assert kustom["kind"] == "Kustomization"
    assert sorted(kustom["resources"]) == sorted(MANIFESTS)
    assert sorted(p.name for p in KUBERNETES.glob("*.yaml")) == sorted(
        [*MANIFESTS, "kustomization.yaml"])
    image = _host(kubernetes_docs())["image"].split(":")[0]
    assert [i["name"] for i in kustom.get("images", [])] == [image]
    name, keys = secret_generator()
    assert list(keys) == ["SONIC_API_KEYS"]
    # The real keys file stays out of git.
    (env,) = kustom["secretGenerator"][0]["envs"]
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert f"/deploy/kubernetes/{env}" in ignored


def test_every_host_command_is_one_the_server_takes() -> None:
    """Each host's arguments (compose's command, the StatefulSet's args with their
    variables as Kubernetes fills them), after the image's entrypoint, are settings the
    server's own parser accepts, naming a cluster."""
    from server.config import parse_args

    argvs = [entrypoint()[3:] + [str(a) for a in service["command"]]
             for service in compose_hosts(load(ROOT / "compose.cluster.yaml")).values()]
    host = _host(kubernetes_docs())
    filled = {"POD_NAME": "sonic-avatar-0", "POD_NAMESPACE": "default",
              "HOST_IP": "10.0.0.5", "NODE_IP": "10.0.0.5"}
    argvs.append([re.sub(r"\$\((\w+)\)", lambda m: filled.get(m[1], "x"), str(a))
                  for a in [*host.get("command", [])[3:], *host.get("args", [])]])
    for argv in argvs:
        settings = parse_args(argv)
        assert settings.cluster.redis_url.startswith("redis://"), argv
        assert settings.cluster.node_id and settings.cluster.advertise_url, argv
