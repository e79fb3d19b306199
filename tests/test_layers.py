"""The package's import graph: no circle, and nothing imports upward across the layers of docs/design.md.

Read statically from the source (every import, module-level or inside a function, since a lazy import
that closes a circle still breaks at run time for whoever calls it first).
"""

import ast
from pathlib import Path

import tilewise

ROOT = Path(tilewise.__file__).parent

# docs/design.md's layers, top (high) to bottom (low): a module may import its own layer or lower ones
LAYERS = {
    "cli": 4, "report": 4,
    "pipelines": 3, "jobs": 3,
    "vae": 2, "diffusion": 2, "buckets": 2,
    "locality": 1,
    "geometry": 0, "blending": 0, "sinks": 0, "metrics": 0, "patterns": 0, "memory": 0, "distributed": 0,
    "atomic": 0, "plots": 0, "models": 0, "wrapper": 0, "errors": 0, "limits": 0, "sources": 0,
    "vocabulary": 0,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["tilewise", *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """tilewise modules `name` imports (a name imported from a package that is a submodule counts as it)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [(base, a.name) for a in node.names]
        else:
            continue
        for mod, attr in targets:
            if not mod.startswith("tilewise"):
                continue
            sub = f"{mod}.{attr}" if attr else None
            target = sub if sub in modules else mod
            if target in modules and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    graph = _graph()
    missing = sorted(n for n in graph if n != "tilewise" and _layer(n) is None)
    assert not missing, f"modules without a layer in docs/design.md's table (add them to LAYERS): {missing}"


def test_nothing_imports_upward():
    upward = [(a, b) for a, deps in _graph().items() for b in deps
              if a != "tilewise" and _layer(b) is not None and _layer(a) < _layer(b)]
    assert not upward, f"imports from a lower layer into a higher one: {upward}"


def test_the_import_graph_has_no_circle():
    graph = _graph()
    graph["tilewise"] = set()  # the package's lazy name table is not an import of its layers
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import circles: {cycles}"


def test_the_graph_reader_sees_lazy_and_relative_imports():
    graph = _graph()
    assert "tilewise.vae.runner" in graph["tilewise.vae.tiled"]  # module level, relative
    assert "tilewise.distributed" in graph["tilewise.vae.run.sharding"]  # module level, three levels up
    assert "tilewise.pipelines" in graph["tilewise.cli.vae"]  # inside a function (the CLI's lazy imports)
