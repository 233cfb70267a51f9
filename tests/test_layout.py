"""The shape of the package, read from its source: at most 8 modules at its top, every subpackage says what it owns,
the layers of fsdp_research/__init__.py stack (no import from a higher one; imports inside functions count), no
import cycle, the leaves import nothing of ours, the library never imports the Hydra wiring or the command-line
faces, and no module imports another's private names."""

import ast
import importlib.util
import os
import sys

import pytest

from tests.conftest import ROOT

PACKAGE = os.path.join(ROOT, "fsdp_research")
LEAVES = {"fsdp_research.config.data_schema", "fsdp_research.config.plugin_schema", "fsdp_research.errors"}
# Lowest first, as fsdp_research/__init__.py lists them; a module imports from its own layer or lower ones.
LAYERS = [
    ["errors"],
    ["config"],
    ["distributed"],
    ["data"],
    ["optim", "callbacks"],
    ["model"],
    ["checkpoint"],
    ["metrics"],
    ["planner"],
    ["train", "objectives"],
    ["jobs"],
    ["tools"],
    ["cli", "__main__"],
]
# Above the library: only train.py, the CLI, tests and benches import these.
FACES = ("fsdp_research.jobs.compose", "fsdp_research.cli", "fsdp_research.__main__")


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


def _imports(module: str):
    """(imported module, imported name or None) for every import statement of the module, wherever it stands."""
    path = MODULES[module]
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
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


def _edges():
    return {m: {t for t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    return next((i for i, names in enumerate(LAYERS) if top in names), -1)


def test_at_most_eight_modules_at_the_top_and_every_subpackage_says_what_it_owns():
    top = [m for m in MODULES if m.count(".") == 1 and not MODULES[m].endswith("__init__.py")]
    assert len(top) <= 8, top
    packages = [m for m, path in MODULES.items() if path.endswith("__init__.py")]
    assert all(ast.get_docstring(ast.parse(open(MODULES[p]).read())) for p in packages)
    # The map names every subpackage, each in one layer.
    assert sorted(m.split(".")[1] for m in packages if m != "fsdp_research") == sorted(
        name for names in LAYERS for name in names if name not in ("errors", "__main__")
    )


def test_no_import_from_a_higher_layer():
    edges = _edges()
    assert all(_layer(m) >= 0 for m in MODULES if m != "fsdp_research"), [m for m in MODULES if _layer(m) < 0]
    upward = {m: sorted(t for t in edges[m] if _layer(t) > _layer(m)) for m in MODULES}
    assert not {m: t for m, t in upward.items() if t}


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


def test_the_schema_imports_only_its_parts():
    parts = {"fsdp_research.config.data_schema", "fsdp_research.config.plugin_schema"}
    assert _edges()["fsdp_research.config.schema"] == parts


def test_library_never_imports_the_faces():
    library = [m for m in MODULES if not m.startswith(FACES)]
    edges = _edges()
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


def test_one_module_owns_the_mesh():
    """Only fsdp_research.distributed.mesh builds, slices or unflattens a device mesh, or computes a data-parallel
    rank from the degrees (get_rank() // ...): the axes' order is written once."""
    builders = {"init_device_mesh", "DeviceMesh", "_unflatten"}
    found = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in builders:
                found.add((module, ast.unparse(node.func)))
            if (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.FloorDiv)
                and "get_rank" in ast.unparse(node.left)
            ):
                found.add((module, ast.unparse(node)))
    assert {m for m, _ in found} <= {"fsdp_research.distributed.mesh"}, sorted(found)


def test_no_module_over_400_lines():
    """The size bar: a module that grows past it splits by concern."""
    long = {m: n for m, path in MODULES.items() if (n := len(open(path).read().splitlines())) > 400}
    assert not long, long


def test_benches_and_the_harness_import_no_test():
    """bench/ and harness/ (what tests and benches both drive) stand beside the tests, never on them."""
    found = []
    for folder in ("bench", "harness"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                tree = ast.parse(open(os.path.join(ROOT, folder, name)).read())
                imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
                imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
                found += [f"{folder}/{name}: {m}" for m in imported if m and m.split(".")[0] == "tests"]
    assert not found, found


def test_every_deliberate_break_still_finds_its_code(capsys):
    """scripts/breaks.py's breaks name the code they plant a bug in by its definition and a snippet of it: code
    moved or reworded since leaves a break that plants nothing (two had, found by hand): each is found, once. Its
    `--list`, in this process (the script is standard library only)."""
    spec = importlib.util.spec_from_file_location("breaks", os.path.join(ROOT, "scripts", "breaks.py"))
    breaks = importlib.util.module_from_spec(spec)
    sys.modules["breaks"] = breaks  # its dataclasses look their module up
    try:
        spec.loader.exec_module(breaks)
        code = breaks.main(["--list"])
    finally:
        del sys.modules["breaks"]
    listed = capsys.readouterr()
    assert code == 0, [line for line in listed.out.splitlines() if "REFUSED" in line] + [listed.err]
