"""The import graph of the project's packages has no circle: every import, at module level or
inside a function (a lazy import is still a dependency), points one way."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "sim", "scenarios", "calibration")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                r = resolve(t)
                if r and r != m and not (m.startswith(r + ".") and (mods[r].name == "__init__.py")):
                    graph[m].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_the_projects_modules():
    g = import_graph()
    assert "engine.core.scheduler" in g and "sim.scenario" in g["scenarios.plan"]
    assert cycles(g) == []


def test_layers_import_downwards_only():
    """engine/core imports nothing of torch, engine, sim or above; sim imports no engine model,
    calibration or scenarios; calibration imports no scenarios."""
    g = import_graph()
    for m, deps in g.items():
        if m.startswith("engine.core"):
            assert all(d.startswith("engine.core") for d in deps), (m, deps)
        if m.startswith("sim"):
            assert not any(d.startswith(("scenarios", "calibration", "engine.model", "engine.server")) for d in deps), (m, deps)
        if m.startswith("calibration"):
            assert not any(d.startswith("scenarios") for d in deps), (m, deps)
