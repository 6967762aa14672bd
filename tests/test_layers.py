"""The package's import structure (docs/reference/layout.md; DESIGN.md's "no subpackage cycles"):
each subpackage imports only from the layers below it, no two modules import each other even
through a chain or from inside a function, and no module imports another's private names.

Reference: the source itself, read with :mod:`ast` (every ``import`` statement, module level or
inside a function), not the import system's state after some test imported something."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "src" / "gpt2mha"

#: The layers, lowest first: a module may import from its own subpackage and from lower layers.
LAYERS = (
    {"core", "kernels", "progress", "distributed", "version"},
    {"io"},
    {"inference"},
    {"serving", "learn", "train"},
    {"api"},
    {"__init__"},
    {"cli"},
    {"__main__"},
)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """``(module imported, names taken, line)`` for every import statement of ``path``."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "gpt2mha"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "gpt2mha":
                out.append((target, [a.name for a in node.names], node.lineno))
    return out


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(target: str, names: list[str]) -> list[str]:
    """The modules an import statement reaches: ``from pkg import mod`` reaches ``pkg.mod``."""
    found = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
    return found or ([target] if target in MODULES else [])


def layer(module: str) -> tuple[int, str]:
    part = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, group in enumerate(LAYERS) if part in group), part


def test_every_subpackage_is_in_a_layer():
    for module in MODULES:
        layer(module)                                      # StopIteration: a new subpackage without a layer


def test_each_layer_imports_only_from_below():
    wrong = []
    for module, path in MODULES.items():
        rank, part = layer(module)
        for target, names, line in imports(path):
            for reached in resolve(target, names):
                r, p = layer(reached)
                if p != part and r >= rank:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} ({part}) imports {reached} ({p})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycle_between_modules():
    graph = {m: {r for t, n, _ in imports(p) for r in resolve(t, n) if r != m} for m, p in MODULES.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):                                          # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    # a package's __init__ that re-exports its modules is no cycle of code: ignore package -> own module edges
    cycles = [c for c in cycles if not all(any(o.startswith(m + ".") or m.startswith(o + ".") for o in c if o != m)
                                           for m in c)]
    assert not cycles, "modules that import each other (through a chain or a function):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_is_imported_from_another_module():
    wrong = [f"{path.relative_to(ROOT)}:{line} takes {name} from {target}"
             for module, path in MODULES.items() for target, names, line in imports(path)
             for name in names if name.startswith("_") and not name.startswith("__") and target != module]
    assert not wrong, "private names used across modules:\n" + "\n".join(wrong)
