"""No module reaches into another package's private (``_name``) members.

CONTRIBUTING.md: "No access to another package's ``_private`` names". The rule, checked on
the syntax tree of every module of ds_xc/, ops/ and launch/:

* a *unit* is a subpackage of ds_xc (``ds_xc.head``, ``ds_xc.compression``, ...), a top-level
  module of ds_xc (``ds_xc.config``, ``ds_xc.engine``, ...), ``ops`` or ``launch``;
* a unit *defines* a private name when one of its modules binds ``_name`` at module level,
  in a class body, or as ``self._name`` / ``cls._name``;
* violation 1: ``from M import _name`` (or ``import M._name``) where M belongs to another unit;
* violation 2: ``X._name`` or ``getattr(X, "_name")`` (X not ``self``, ``cls`` or ``super()``)
  where ``_name`` is defined by another unit and not by the accessing unit itself.

Dunder names are never private. Underscore names of torch and the standard library that
ds_xc uses (``tensor._values()``, ``os._exit``, ...) are not defined by any unit, so they
are no violation; the few that share a name with one of ours are listed in THIRD_PARTY.
Limitations: the check goes by name, not by type, so ``X._name`` passes when the accessing
unit also defines ``_name`` (a unit's own private names are its own business); and a subclass's
``self._name`` is its own, even when the base class lives in another unit (the compressed
reducer overrides ``BucketedGradReducer._launch``, the documented extension point).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ds_xc", "ops", "launch")

# underscore APIs of torch and the standard library that ds_xc uses, never a violation even if a
# unit of ours comes to define the same name: sparse tensors' _values() / _indices() (engine.py,
# head/optim.py), os._exit (launch/train.py), nn.Module._apply / _load_from_state_dict (overridden
# by ClassParallelHead; the overrides call super()'s)
THIRD_PARTY = {"_values", "_indices", "_exit", "_apply", "_load_from_state_dict"}

# (accessing unit, name): cross-unit private accesses still present, each with the reason it stays
# (keyed by unit, not file, so that moving code inside a unit keeps the entry)
ALLOWED: dict[tuple[str, str], str] = {}


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path.relative_to(ROOT)


def _unit_of_path(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    if parts[0] != "ds_xc":
        return parts[0]
    return ".".join(parts[:2])  # ds_xc.<subpackage> or ds_xc.<module> (ds_xc/__init__.py: "ds_xc.__init__")


def _unit_of_module(name: str) -> str | None:
    """The unit of an imported module name (absolute or relative), None for third-party modules."""
    parts = name.split(".")
    if parts[0] == "ds_xc_ops":  # the ops/ folder installs as ds_xc_ops
        return "ops"
    if parts[0] not in PACKAGES:
        return None
    if parts[0] != "ds_xc":
        return parts[0]
    if len(parts) == 1:
        return "ds_xc.__init__"
    return ".".join(parts[:2])


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _is_owner(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: access to the object's own members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _definitions(tree: ast.Module) -> set[str]:
    names: set[str] = set()

    def bind(target):
        for t in ast.walk(target):
            if isinstance(t, ast.Name) and _is_private(t.id):
                names.add(t.id)

    def scan(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_private(node.name):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                scan(node.body)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    bind(t)
            elif isinstance(node, (ast.If, ast.Try)):
                scan(node.body + node.orelse + getattr(node, "finalbody", []))

    scan(tree.body)
    for node in ast.walk(tree):  # self._x = ... / cls._x = ... anywhere
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_owner(node.value):
            if _is_private(node.attr):
                names.add(node.attr)
    return names


def _accesses(tree: ast.Module):
    """(line, module or None, name) for every private import and non-owner private attribute."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if _is_private(alias.name):
                    yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                private = [p for p in alias.name.split(".") if _is_private(p)]
                if private:
                    yield node.lineno, alias.name, private[0]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_owner(node.value):
            yield node.lineno, None, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr",
              "hasattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)
              and not _is_owner(node.args[0])):
            yield node.lineno, None, node.args[1].value


def _scan(planted: dict | None = None):
    """(violations as (path, line, name, defining units), private names per unit); ``planted``:
    extra {relative path: source} modules, for the tests of the checker itself."""
    trees = {rel: ast.parse((ROOT / rel).read_text(), str(rel)) for rel in _modules()}
    trees.update({Path(rel): ast.parse(src) for rel, src in (planted or {}).items()})
    defined: dict[str, set[str]] = {}
    for rel, tree in trees.items():
        defined.setdefault(_unit_of_path(rel), set()).update(_definitions(tree))
    found = []
    for rel, tree in trees.items():
        unit = _unit_of_path(rel)
        for line, module, name in _accesses(tree):
            if module is not None:
                owner = _unit_of_module(module)
                bad = owner is not None and owner != unit
                where = owner
            else:
                owners = sorted(u for u, names in defined.items() if name in names and u != unit)
                bad = bool(owners) and name not in defined.get(unit, set()) and name not in THIRD_PARTY
                where = ", ".join(owners)
            if bad:
                found.append((str(rel), line, name, where))
    return found, defined


def test_no_cross_package_private_access():
    found, _ = _scan()
    left = [f for f in found if (_unit_of_path(Path(f[0])), f[2]) not in ALLOWED]
    assert not left, "private names of another package (make them public, or move the code):\n" + "\n".join(
        f"  {path}:{line}: {name} (defined in {where})" for path, line, name, where in left)


def test_allow_list_is_current():
    """Every allow-list entry still matches an access: a fixed reach-in leaves the list too."""
    found, _ = _scan()
    present = {(_unit_of_path(Path(f[0])), f[2]) for f in found}
    stale = sorted(set(ALLOWED) - present)
    assert not stale, f"allow-list entries that no longer occur: {stale}"


def test_rule_catches_a_reach_in():
    """The checker's parts on planted code: private imports, attributes and getattr are found,
    own members are not; definitions are module-level, class-level and self./cls. bindings."""
    src = ("from ds_xc.config import _Section, HEAD_SECTION\n"
           "import ds_xc.head._hidden\n"
           "def f(head, opt):\n"
           "    head._check(1)\n"
           "    getattr(opt, '_stats_due')()\n"
           "    return opt.__class__, opt.public\n")
    assert sorted(_accesses(ast.parse(src))) == [(1, "ds_xc.config", "_Section"), (2, "ds_xc.head._hidden", "_hidden"),
                                                 (4, None, "_check"), (5, None, "_stats_due")]
    own = "class A:\n    def f(self):\n        return self._x, super()._y(), getattr(self, '_z')\n"
    assert not list(_accesses(ast.parse(own)))
    defs = ("_TOP = 1\ndef _helper():\n    _local = 2\nclass _K:\n    _slot = 0\n    def _m(self):\n"
            "        self._state = 1\n        other._not_a_definition = 2\n")
    assert _definitions(ast.parse(defs)) == {"_TOP", "_helper", "_K", "_slot", "_m", "_state"}
    assert _unit_of_module("ds_xc.config") == "ds_xc.config" and _unit_of_module("torch.nn") is None
    assert _unit_of_module("ds_xc.head.head") == "ds_xc.head" and _unit_of_module("ds_xc_ops.hamming") == "ops"
    assert _unit_of_path(Path("ds_xc/compression/config.py")) == "ds_xc.compression"
    assert _unit_of_path(Path("ds_xc/engine.py")) == "ds_xc.engine"
    assert _unit_of_path(Path("launch/train.py")) == "launch"


def test_the_scan_sees_the_packages():
    """The scan reads every package: the head's own private names are known, and a planted
    reach-in of the overlap package into the head is reported, while the head's own use is not."""
    planted = {"ds_xc/overlap/planted.py": "def f(head):\n    return head._unchecked_bad\n",
               "ds_xc/head/planted.py": "def f(head):\n    return head._unchecked_bad\n",
               "launch/planted.py": "from ds_xc.head.head import _INIT_BLOCK\n"}
    found, defined = _scan(planted)
    mine = sorted(f for f in found if f[0].endswith("planted.py"))
    assert mine == [("ds_xc/overlap/planted.py", 2, "_unchecked_bad", "ds_xc.head"),
                    ("launch/planted.py", 1, "_INIT_BLOCK", "ds_xc.head")], mine
    assert {"ds_xc.head", "ds_xc.compression", "ds_xc.overlap", "ds_xc.parallel", "ds_xc.config", "ops",
            "launch"} <= set(defined)
    assert {"_calls", "_unchecked_bad"} <= defined["ds_xc.head"]  # self._x bindings of ClassParallelHead
    assert "_stats_due" in defined["ds_xc.compression"] and "_stats_due" not in defined["ds_xc.overlap"]
