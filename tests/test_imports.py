"""The house's shape, read from the source: no import cycle between expgpu's modules (imports inside
functions count), and no module imports from a layer above its own (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# From the ground up: a module imports only from its own layer or below (docs/architecture.md).
LAYERS = [
    ["expgpu.rundir", "expgpu.envvars", "expgpu.errors", "expgpu.results", "expgpu.faults", "expgpu.lazy"],
    ["expgpu.task", "expgpu.ranks", "expgpu.procs", "expgpu.loggers", "expgpu.report", "expgpu.status"],
    ["expgpu.gpus", "expgpu.distributed", "expgpu.schema", "expgpu.config"],
    ["expgpu.checkpoint", "expgpu.script"],
    ["expgpu.train", "expgpu.pool", "expgpu.slurm"],
    ["expgpu.tune", "expgpu.tasks", "expgpu"],
    ["expgpu.launch", "expgpu.warm_server", "hydra_plugins"],
    ["expgpu.app"],
    ["expgpu.__main__"],
]


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the expgpu modules it imports, anywhere in it. `from pkg import name` counts as an
    import of pkg.name when that is a module, else of pkg (its __init__)."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer(module: str) -> int | None:
    best = None
    for level, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    return None if best is None else best[1]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_expgpu_imports_itself_back():
    found = cycles(graph())
    assert not found, "import cycles (imports inside functions count): " + "; ".join(" -> ".join(c) for c in found)


def test_every_module_has_a_layer_and_imports_nothing_above_it():
    edges = graph()
    unplaced = [m for m in edges if layer(m) is None]
    assert not unplaced, f"modules in no layer of LAYERS (docs/architecture.md): {unplaced}"
    up = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
          for m, deps in sorted(edges.items()) for d in sorted(deps) if layer(d) > layer(m)]
    assert not up, "imports that reach up a layer: " + "; ".join(up)
