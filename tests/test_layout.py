"""The shape of the package, read from its source: no import cycle (imports inside functions count), the leaves
import nothing of ours, the library never imports the Hydra wiring or the command-line faces (but from its
`if __name__ == "__main__":` block, an old `python -m fsdp_research.<module>` path that runs its command), and no
module imports another's private names."""

import ast
import os

import pytest

from tests.conftest import ROOT

PACKAGE = os.path.join(ROOT, "fsdp_research")
LEAVES = {"fsdp_research.config", "fsdp_research.errors"}
# Above the library: only train.py, the CLI, tests and benches import these.
FACES = ("fsdp_research.composition", "fsdp_research.cli", "fsdp_research.__main__")


def _modules():
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                found[module] = path
    return found


MODULES = _modules()


def _walk(node: ast.AST, library_only: bool):
    """ast.walk, less the `if __name__ == "__main__":` blocks when library_only: such a block runs only when the
    module is the program (an old `python -m` path), a face, never when the library imports it."""
    yield node
    for child in ast.iter_child_nodes(node):
        main_block = isinstance(child, ast.If) and ast.unparse(child.test) == "__name__ == '__main__'"
        if not (library_only and main_block):
            yield from _walk(child, library_only)


def _imports(module: str, library_only: bool = False):
    """(imported module, imported name or None) for every import statement of the module, wherever it stands."""
    path = MODULES[module]
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in _walk(ast.parse(open(path).read()), library_only):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                yield (target, None) if target in MODULES else (base, alias.name)


def _edges(library_only: bool = False):
    return {m: {t for t, _ in _imports(m, library_only) if t in MODULES and t != m} for m in MODULES}


def test_no_import_cycle():
    edges, state, cycles = _edges(), {}, []

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaves_import_nothing_of_ours(leaf):
    assert not _edges()[leaf]


def test_library_never_imports_the_faces():
    library = [m for m in MODULES if not m.startswith(FACES)]
    edges = _edges(library_only=True)
    offenders = {m: sorted(t for t in edges[m] if t.startswith(FACES)) for m in library}
    assert not {m: t for m, t in offenders.items() if t}


def _outside_sources():
    for top in ("tests", "bench"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def test_no_private_names_across_modules():
    """Neither another module of the package nor a test or a bench reaches into a module's private names."""
    outside = {
        (path, f"{node.module}.{alias.name}")
        for path in _outside_sources()
        for node in ast.walk(ast.parse(open(path).read()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_research")
        for alias in node.names
        if alias.name.startswith("_")
    }
    assert not outside
    private = {
        (m, f"{t}.{name}")
        for m in MODULES
        for t, name in _imports(m)
        if name and name.startswith("_") and t.startswith("fsdp_research") and t != m
    }
    assert not private
