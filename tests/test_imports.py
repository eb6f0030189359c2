"""The import picture runs one way: no module imports another that imports it back, and a
module's folder says which process it runs in and what it may import (docs/architecture.md):

- ``server/`` (top level): shared by every process (settings, costs, knobs, load, metrics);
- ``server/http/``: what the front door and the workers both serve HTTP with;
- ``server/front_door/``: the front door's process, which never loads the media path;
- ``server/worker/`` and ``server/media/``: a media worker's process and its media path;
- ``server/integrations/``: third-party servers a worker's sessions join (Janus);
- ``server/client/``: what runs in a caller's process, never in the server's;
- ``inference/``: the engine side, which never imports the server; ``inference/training/``
  is never imported by what serves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from server.config import REPO_ROOT

pytestmark = pytest.mark.unit

PACKAGES = ("server", "inference", "benchmarks")


def import_graph(root: Path = REPO_ROOT, *, outside: bool = False) -> dict[str, set[str]]:
    """Project module -> the project modules it imports, anywhere in its body (imports
    inside functions count: they only hide a circle); with ``outside``, the top-level
    names of what else it imports (``aiortc``, ``numpy``)."""
    modules = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            if outside:
                graph[name] |= {t.split(".")[0] for t in targets
                                if t.split(".")[0] not in PACKAGES}
            else:
                graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_a_circle_is_found_where_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_inference_never_imports_the_server():
    graph = import_graph()
    assert not {(m, t) for m, ts in graph.items() if m.startswith("inference")
                for t in ts if t.startswith("server")}


def test_the_front_door_never_loads_the_media_path():
    """The front door's process places sessions and relays requests: no WebRTC, no codec,
    no session, whatever it imports on the way."""
    graph, outside = import_graph(), import_graph(outside=True)
    for module in (m for m in graph if _within(m, "server.front_door")):
        loaded = reached(graph, module) | {module}
        media = {m for m in loaded if _within(m, "server.media", "server.integrations",
                                              "server.client", "server.worker.api",
                                              "server.worker.app", "server.worker.main")}
        assert not media, (module, media)
        codecs = {name for m in loaded for name in outside[m]} & {"aiortc", "av", "aioice"}
        assert not codecs, (module, codecs)


def test_the_media_path_knows_nothing_of_the_processes_around_it():
    graph = import_graph()
    for module in (m for m in graph if _within(m, "server.media")):
        around = {t for t in graph[module] if _within(t, "server.worker", "server.front_door",
                                                        "server.client", "server.http",
                                                        "server.integrations")}
        assert not around, (module, around)


def test_clients_use_no_part_of_the_server_process():
    """What runs in a caller's process (the reference peer, SessionClient, pipecat) may
    share the media path's codecs, not the server's processes or its HTTP side."""
    graph = import_graph()
    for module in (m for m in graph if _within(m, "server.client")):
        server_side = {t for t in reached(graph, module)
                       if _within(t, "server.worker", "server.front_door", "server.http",
                                  "server.integrations")}
        assert not server_side, (module, server_side)


def test_what_serves_never_imports_the_training():
    graph = import_graph()
    for module in (m for m in graph if not _within(m, "inference.training", "benchmarks")):
        assert not {t for t in graph[module] if _within(t, "inference.training")}, module
