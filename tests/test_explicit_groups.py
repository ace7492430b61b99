"""Every collective of the library runs on a process group it names; groups are made in one place.

CONTRIBUTING.md: "Every collective runs on a process group it was given; never the world
implicitly. Groups are created by all ranks." Checked on the syntax tree of every module
of ds_xc/ and ops/:

* a call of a torch.distributed collective (COLLECTIVES: all_reduce, all_gather*, broadcast*,
  reduce*, reduce_scatter*, all_to_all*, barrier, monitored_barrier, gather*, scatter*,
  send/recv and their ``i``/``_object`` variants) passes ``group=`` by keyword, and not the
  literal None. The call may go through ``dist.X``, ``torch.distributed.X``, a name imported
  from torch.distributed, or an alias bound at module level to one of them (``_ALL_GATHER =
  getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor``);
* ``dist.get_rank()`` / ``dist.get_world_size()`` name their group (an argument or ``group=``);
* the world group (``dist.group.WORLD``, ``GroupMember.WORLD``) is named only where ALLOWED
  says why (the world is meant there, not defaulted to);
* ``dist.new_group`` (and torch's ``new_subgroups*``, ``split_group``) is called only by
  ``ds_xc.parallel.groups.new_group``, and that wrapper only where GROUP_MAKERS says why:
  torch needs every rank of the world in each group creation, so the places that create
  groups are few and each one is called by every rank.

Limitations: names, not types (a local variable holding None passes ``group=group``; the
behavioural test tests/test_subgroups_dist.py runs the components on subgroups to catch that),
and calls through ``getattr`` at the call site are not followed.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ds_xc", "ops")

COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_coalesced", "all_gather_object", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend",
    "irecv", "send_object_list", "recv_object_list",
}
RANK_QUERIES = {"get_rank", "get_world_size"}
GROUP_CREATORS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group"}

# "path:function" -> why that function names the world group
ALLOWED: dict[str, str] = {
    "ds_xc/parallel/groups.py:resolve_group": "group=None is the documented name of the world; resolved once, "
                                              "when a component is built, into the group it then passes",
    "ds_xc/parallel/groups.py:spans_world": "compares a group with the world (is it a proper subgroup?)",
    "ds_xc/parallel/groups.py:new_groups": "group creation is collective over the world in torch: the world's "
                                           "size and this rank's world rank decide the membership",
    "ds_xc/parallel/groups.py:copy_group": "names the world's size in its refusal of a proper subgroup",
    "ds_xc/parallel/groups.py:copy_subgroups": "every rank of the world gathers the others' groups before "
                                               "creating them: group creation involves the world in torch",
    "ds_xc/parallel/groups.py:world_rank_and_size": "which process this is, for messages only",
    "ds_xc/parallel/groups.py:node_groups": "group creation is collective over the world in torch: checks that "
                                            "the node layout covers every rank of the world",
    "ds_xc/engine/setup.py:_agreed_config": "deepspeed.initialize is collective over the world: every rank "
                                            "agrees on the config before it runs",
    "ds_xc/engine/setup.py:engine_group": "DeepSpeed's own default data-parallel group (the world) for an engine "
                                          "that does not name one",
    "ds_xc/parallel/device_simulation.py:init_process_group": "the device audit's simulation records the world "
                                                              "its caller has just started with backend='gloo'",
}

# "path:function" -> why that function may call ds_xc.parallel.groups.new_group
GROUP_MAKERS: dict[str, str] = {
    "ds_xc/parallel/groups.py:new_groups": "the helper every rank calls with the full set of groups",
    "ds_xc/parallel/groups.py:copy_group": "copies a group that spans the world (every rank is a member and calls "
                                           "it); refuses a proper subgroup",
}


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path.relative_to(ROOT)


def _dist_names(tree: ast.Module) -> tuple[set, dict]:
    """Names bound to the torch.distributed module, and names bound to its functions (name -> function)."""
    modules, functions = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                    functions[a.asname or a.name] = a.name
    return modules, functions


def _dist_function(node: ast.AST, modules: set) -> str | None:
    """The torch.distributed function ``node`` names (``dist.X``, ``torch.distributed.X``,
    ``getattr(dist, "X", ...)``), else None."""
    if isinstance(node, ast.Attribute):
        base = node.value
        if isinstance(base, ast.Name) and base.id in modules:
            return node.attr
        if (isinstance(base, ast.Attribute) and base.attr == "distributed" and isinstance(base.value, ast.Name)
                and base.value.id == "torch"):
            return node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in modules
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[1].value
    return None


def _aliases(tree: ast.Module, modules: set, functions: dict) -> dict:
    """Module-level names assigned from a torch.distributed collective (name -> function)."""
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        named = [_dist_function(n, modules) for n in ast.walk(node.value)]
        named += [functions[n.id] for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id in functions]
        hits = [n for n in named if n in COLLECTIVES]
        if hits:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = hits[0]
    return out


def _functions_of(tree: ast.Module) -> dict:
    """id(node) -> the name of the innermost function holding it ("<module>" outside any)."""
    owner = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            owner[id(child)] = inner
            visit(child, inner)
    visit(tree, "<module>")
    return owner


def _has_group(call: ast.Call, positional_ok: bool) -> bool:
    for kw in call.keywords:
        if kw.arg == "group":
            return not (isinstance(kw.value, ast.Constant) and kw.value.value is None)
    return positional_ok and bool(call.args) and not (isinstance(call.args[0], ast.Constant)
                                                      and call.args[0].value is None)


def _is_world(node: ast.AST, modules: set) -> bool:
    """``dist.group.WORLD``, ``torch.distributed.group.WORLD``, ``(dist.)GroupMember.WORLD``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "WORLD"):
        return False
    base = node.value
    if isinstance(base, ast.Name) and base.id == "GroupMember":
        return True
    return isinstance(base, ast.Attribute) and base.attr in ("group", "GroupMember") and \
        _dist_function(base, modules) in ("group", "GroupMember")


def violations(source: str, path: str) -> list[str]:
    """Every breach of the rules above in one module's source (``path`` names it in messages)."""
    tree = ast.parse(source)
    modules, functions = _dist_names(tree)
    aliases = _aliases(tree, modules, functions)
    owner = _functions_of(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path}:{owner.get(id(node), '<module>')}"
        line = f"{path}:{getattr(node, 'lineno', '?')}"
        if _is_world(node, modules) and where not in ALLOWED:
            found.append(f"{line}: names the world group in {where} (not in ALLOWED)")
        if not isinstance(node, ast.Call):
            continue
        name = _dist_function(node.func, modules)
        if name is None and isinstance(node.func, ast.Name):
            name = functions.get(node.func.id) or aliases.get(node.func.id)
            if name is None and node.func.id == "new_group" and where not in GROUP_MAKERS \
                    and where != "ds_xc/parallel/groups.py:new_group":
                found.append(f"{line}: calls ds_xc.parallel.groups.new_group in {where} (not in GROUP_MAKERS)")
        if name in COLLECTIVES and not _has_group(node, positional_ok=False):
            found.append(f"{line}: {name}(...) without group= (the world by default) in {where}")
        elif name in RANK_QUERIES and not _has_group(node, positional_ok=True):
            found.append(f"{line}: {name}() without a group (the world by default) in {where}")
        elif name in GROUP_CREATORS and where != "ds_xc/parallel/groups.py:new_group":
            found.append(f"{line}: torch.distributed.{name} in {where}: create groups through "
                         "ds_xc.parallel.groups (new_groups, copy_group, copy_subgroups)")
    return found


def test_library_collectives_name_their_group():
    found = []
    for rel in _modules():
        found += violations((ROOT / rel).read_text(), rel.as_posix())
    assert not found, "collectives or group creation on the implicit world:\n" + "\n".join(found)


def test_allow_lists_name_existing_functions():
    defined = set()
    for rel in _modules():
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(f"{rel.as_posix()}:{node.name}")
    stale = sorted((set(ALLOWED) | set(GROUP_MAKERS)) - defined)
    assert not stale, f"allow-list entries without a function: {stale}"


BAD = '''
import torch
import torch.distributed as dist
from torch.distributed import all_gather_object as ago
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

def f(t, group):
    dist.all_reduce(t)
    dist.all_reduce(t, group=None)
    torch.distributed.broadcast(t, 0)
    ago([None], 1)
    _GATHER(t, t)
    dist.barrier()
    r = dist.get_rank()
    w = dist.get_world_size(group=None)
    g = dist.group.WORLD
    dist.new_group([0, 1])
    new_group([0])

def fine(t, group):
    dist.all_reduce(t, group=group)
    _GATHER(t, t, group=group)
    return dist.get_rank(group), dist.get_world_size(group=group)
'''


def test_the_checker_finds_each_kind_of_violation():
    found = violations(BAD, "x.py")
    assert len(found) == 11, "\n".join(found)
    assert not [f for f in found if ":fine" in f]
    for text in ("all_reduce(...) without group=", "broadcast(...) without", "all_gather_object(...) without",
                 "all_gather_single(...) without", "barrier(...) without", "get_rank() without",
                 "get_world_size() without", "names the world group", "torch.distributed.new_group",
                 "calls ds_xc.parallel.groups.new_group"):
        assert any(text in f for f in found), text
