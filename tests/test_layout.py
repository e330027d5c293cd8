"""The package's layout keeps its promises: dependencies point one way (docs/architecture.md).

Reads every module's imports (top-level and inside functions) with ``ast``; no process starts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "shoal"
# Floors of shoal/runtime/: a room may import rooms on lower floors (or its own), never higher ones.
FLOORS = {"processes": 5, "roles": 4, "sync": 3, "safety": 2, "pool": 2, "transport": 2, "ui": 2,
          "common": 1, "measure": 1, "loopwatch": 0}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> nx.DiGraph:
    graph = nx.DiGraph()
    for path in ROOT.rglob("*.py"):
        mod = _module(path)
        graph.add_node(mod)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shoal"):
                graph.add_edge(mod, node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("shoal"):
                        graph.add_edge(mod, alias.name)
    return graph


def _room(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "runtime" else None


def test_runtime_has_no_import_circle():
    graph = _imports()
    runtime = graph.subgraph(n for n in graph if n.startswith("shoal.runtime."))
    assert list(nx.simple_cycles(runtime)) == []


def test_runtime_rooms_import_only_downwards():
    graph = _imports()
    upward = [(a, b) for a, b in graph.edges
              if _room(a) and _room(b) and _room(a) != _room(b) and FLOORS[_room(a)] <= FLOORS[_room(b)]]
    assert upward == []
    rooms = {_room(n) for n in graph if _room(n)}
    assert rooms <= set(FLOORS), f"a new room needs a floor in FLOORS: {rooms - set(FLOORS)}"


def test_plan_and_sim_never_import_the_runtime():
    graph = _imports()
    bad = [(a, b) for a, b in graph.edges
           if a.startswith(("shoal.plan", "shoal.sim")) and b.startswith("shoal.runtime")]
    # The planner's decisions never ask the simulator; only `shoal plan --compare` (its CLI) judges with it.
    bad += [(a, b) for a, b in graph.edges
            if a.startswith("shoal.plan") and a != "shoal.plan.cli" and b.startswith("shoal.sim")]
    assert bad == []
