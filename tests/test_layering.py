"""The floors of the house (docs/design.md, "package layering"): imports only go downwards, no cycles.

Every module of ds_xc/ and ops/ is parsed (ast, nothing is imported) and each import
statement becomes an edge to the most specific module it names. Two checks:

* no import cycle among module-level imports (imports inside functions are lazy and may
  close a loop on purpose, e.g. CompressedOptimizer.overlapped_reducer);
* no import, module-level or lazy, from a lower floor into a higher one (FLOORS below).

Violations that are known and owned by a later change are listed in ALLOWED with the
reason; any other violation fails, and so does an ALLOWED entry that no longer occurs
(remove it, so that the list only ever shrinks).
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ds_xc", "ops")
IMPORT_NAME = {"ds_xc": "ds_xc", "ops": "ds_xc_ops"}  # the ops/ folder installs as ds_xc_ops

# floor of each package or module (the longest matching prefix wins); see docs/design.md
FLOORS = {
    "ds_xc_ops": 0,
    "ds_xc.parallel": 1, "ds_xc.peers": 1, "ds_xc.host_syncs": 1, "ds_xc.replay_check": 1,
    "ds_xc.head": 2, "ds_xc.sampling": 2,
    "ds_xc.checkpoint": 3, "ds_xc.cost": 3, "ds_xc.evaluate": 3, "ds_xc.manifest": 3,
    "ds_xc.compression": 4, "ds_xc.optim": 4,
    "ds_xc.overlap": 5,
    "ds_xc.engine": 6, "ds_xc.tune": 6, "ds_xc": 6,  # ds_xc/__init__.py: the public API
}
# the configuration models: read by every floor, import nothing but each other
CONFIG = ("ds_xc.config", "ds_xc.config_base", "ds_xc.config_compression", "ds_xc.config_topology",
          "ds_xc.config_schedule")
# beside the stack (the built-in job's data and backbones): import each other and the config only,
# and only launch/, tests and benchmarks import them
BESIDE = ("ds_xc.data", "ds_xc.models")

ALLOWED: set = set()  # empty: add an entry only with the reason and the change that owns it


def module_files() -> dict:
    """{dotted module name: path} for every .py file of PACKAGES."""
    out = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    rel = IMPORT_NAME[package] + rel[len(package):]
                    out[rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return out


def _resolve(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (None: outside the packages)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: str, module: str, modules) -> list:
    """[(imported module, lineno, module_level)] for the import statements of one file."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []

    def visit(node, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1]
                                    + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in child.names]  # a submodule, or a name of module `base`
            else:
                nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, top and not nested)
                continue
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != module:
                    out.append((target, child.lineno, top))
    visit(tree, True)
    return out


def import_graph() -> dict:
    """{module: [(imported module, lineno, module_level)]} over ds_xc/ and ops/."""
    files = module_files()
    return {m: imports_of(p, m, files) for m, p in files.items()}


def _floor(module: str):
    key = _resolve(module, FLOORS)
    return FLOORS[key] if key is not None else None


def _in(module: str, group: tuple) -> bool:
    return any(module == g or module.startswith(g + ".") for g in group)


def floor_violations(graph: dict) -> set:
    """{(importer, imported)} whose import breaks the floors."""
    bad = set()
    for src, edges in graph.items():
        for dst, _, _ in edges:
            if _in(src, CONFIG):
                ok = _in(dst, CONFIG)  # the config reads nobody ...
            elif _in(dst, CONFIG):
                ok = True  # ... and everybody reads the config
            elif _in(src, BESIDE) or _in(dst, BESIDE):
                ok = _in(src, BESIDE) and _in(dst, BESIDE)
            else:
                fs, fd = _floor(src), _floor(dst)
                ok = fs is not None and fd is not None and fd <= fs
            if not ok:
                bad.add((src, dst))
    return bad


def import_cycles(graph: dict) -> list:
    """Strongly connected components (more than one module) of the module-level import graph."""
    edges = {m: sorted({d for d, _, top in es if top and d in graph}) for m, es in graph.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):  # Tarjan, iterative enough for this graph's depth
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
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
                out.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def _where(graph: dict, pairs) -> list:
    return sorted(f"{src} -> {dst} (line {line})" for src, dst in pairs
                  for d, line, _ in graph[src] if d == dst)


# ---------------------------------------------------------------------- the checks on the real code
def test_every_module_is_parsed_and_has_a_floor():
    graph = import_graph()
    assert {"ds_xc.engine.core", "ds_xc.checkpoint.files", "ds_xc.parallel.timeline", "ds_xc_ops.hamming"} <= set(graph)
    homeless = [m for m in graph if not (_in(m, CONFIG) or _in(m, BESIDE) or _floor(m) is not None)]
    assert not homeless, f"modules without a floor in FLOORS: {homeless}"


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, f"module-level import cycles: {cycles}"


def test_imports_only_go_down_the_floors():
    graph = import_graph()
    bad = floor_violations(graph)
    new = bad - ALLOWED
    assert not new, "imports from a lower floor into a higher one (docs/design.md):\n  " + \
        "\n  ".join(_where(graph, new))
    stale = ALLOWED - bad
    assert not stale, f"ALLOWED lists violations that no longer occur; remove them: {sorted(stale)}"


# ---------------------------------------------------------------------- the checker itself can fail
def test_checker_finds_a_cycle_and_an_upward_import():
    graph = {"ds_xc.head.a": [("ds_xc.head.b", 1, True)], "ds_xc.head.b": [("ds_xc.head.a", 2, True)],
             "ds_xc.parallel.c": [("ds_xc.overlap.d", 3, False)], "ds_xc.overlap.d": [],
             "ds_xc.config": [("ds_xc.compression.e", 4, False)], "ds_xc.compression.e": [("ds_xc.config", 5, True)],
             "ds_xc.data.f": [("ds_xc.head.a", 6, True)], "ds_xc.engine.g": [("ds_xc.parallel.c", 7, False)]}
    assert import_cycles(graph) == [["ds_xc.head.a", "ds_xc.head.b"]]
    lazy_loop = dict(graph, **{"ds_xc.head.b": [("ds_xc.head.a", 2, False)]})
    assert import_cycles(lazy_loop) == []  # an import inside a function does not close a cycle
    assert floor_violations(graph) == {("ds_xc.parallel.c", "ds_xc.overlap.d"), ("ds_xc.config", "ds_xc.compression.e"),
                                       ("ds_xc.data.f", "ds_xc.head.a")}


def test_parser_resolves_relative_lazy_and_from_imports(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom ds_xc import config as cfg\nfrom . import b\n"
                   "import ds_xc.parallel.groups\nif TYPE_CHECKING:\n    from ds_xc.engine import XCEngine\n"
                   "def f():\n    from ds_xc.overlap.run import build_overlap\n")
    modules = {"ds_xc", "ds_xc.config", "ds_xc.head", "ds_xc.head.b", "ds_xc.head.mod", "ds_xc.parallel.groups",
               "ds_xc.overlap.run", "ds_xc.engine"}
    got = imports_of(str(src), "ds_xc.head.mod", modules)
    assert got == [("ds_xc.config", 2, True), ("ds_xc.head.b", 3, True), ("ds_xc.parallel.groups", 4, True),
                   ("ds_xc.overlap.run", 8, False)]
