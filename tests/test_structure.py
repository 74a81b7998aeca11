"""The package's shape: no import cycle, every module importable alone, one state with one reset."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Dict, List, Set

import torch
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.core import state as _state

PKG = os.path.dirname(os.path.abspath(fusionguard.__file__))


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PKG))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _modules() -> Dict[str, str]:
    found = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                found[_module_name(path)] = path
    return found


def _imports(name: str, path: str, known: Set[str], late: bool = False) -> Set[str]:
    """The package's modules that ``name`` imports when it is imported (module level, ``try`` and
    ``if`` blocks included, ``if TYPE_CHECKING`` left out); ``late``: also those imported inside
    functions and methods, when they run (a late import that closes a cycle is still one)."""
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: Set[str] = set()

    def visit(body: List[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    if f"{target}.{a.name}" in known:  # ``from . import crash``: the module itself
                        out.add(f"{target}.{a.name}")
                    elif target in known:
                        out.add(target)
            elif late or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for part in getattr(node, field, None) or ():
                        visit(part.body if isinstance(part, ast.ExceptHandler) else [part])

    visit(ast.parse(open(path).read()).body)
    # importing ``a.b.c`` first runs the package ``a.b`` (its own modules are loading already)
    for target in list(out):
        parts = target.split(".")
        out.update(p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p in known and not name.startswith(p + "."))
    out.discard(name)
    return out


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    cycles: List[List[str]] = []
    state: Dict[str, int] = {}
    stack: List[str] = []

    def dfs(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                dfs(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            dfs(n)
    return cycles


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert graph["fusionguard.core.state"] and "fusionguard.core.tables" in graph["fusionguard.core.state"]  # the walk sees imports
    assert _cycles(graph) == []
    # late imports too (the package itself left out: its lazy public names import the modules
    # that implement them, and those may call the public API back)
    late = {name: _imports(name, path, set(modules), late=True) - {"fusionguard"} for name, path in modules.items()}
    assert "fusionguard.report" in late["fusionguard.cli"]  # the walk sees late imports
    assert "fusionguard.watching" in graph["fusionguard.dense.guard"]  # and the package a submodule import runs
    assert _cycles(late) == []
    # the state's own modules import nothing that imports the state
    for low in ("fusionguard.core.tables", "fusionguard.eventlog.crash", "fusionguard.core.registry", "fusionguard.eventlog.log"):
        assert "fusionguard.core.state" not in graph[low], low


# One child Python imports each module in a fork of itself. First, before it has imported torch:
# a module that imports nothing of torch is checked there, as in a fresh interpreter; one that
# starts importing torch stops (exit 3) and is checked again in a fork taken after ``import torch``
# (the state it reaches after its own ``import torch`` anyway), which saves one torch import per
# module (about 2 s of CPU each, 60 modules). Both find structlog loaded (``import fusionguard``
# loads it in any process, and nothing of torch: 0.15 CPU s per fork), never a module of
# fusionguard, nor wrapt (which only some modules import: one reading ``sys.modules["wrapt"]``
# would pass where it fails alone).
_FORK_EACH = r"""
import importlib, os, sys, traceback

class NeedsTorch:  # a meta path finder that ends the fork at the first import of torch
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and self.on:
            os._exit(3)

def check(names, stop_at_torch):
    needs_torch, failed = [], {}
    for n in names:
        pid = os.fork()
        if pid == 0:
            try:
                assert not [m for m in sys.modules if m.split(".")[0] == "fusionguard"]
                HOOK.on = stop_at_torch
                importlib.import_module(n)
                HOOK.on = False
            except BaseException:
                HOOK.on = False
                sys.stderr.write(traceback.format_exc()[-800:])
                os._exit(1)
            os._exit(0)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status == 3 and stop_at_torch:
            needs_torch.append(n)
        elif status:
            failed[n] = status
    return needs_torch, failed

import structlog  # noqa: E402,F401
HOOK = NeedsTorch()
HOOK.on = False
sys.meta_path.insert(0, HOOK)
names = sys.argv[1:]
needs_torch, failed = check(names, True)
import torch  # noqa: E402
_, more = check(needs_torch, False)
failed.update(more)
print(len(names) - len(needs_torch), len(needs_torch), sorted(failed))
"""


def test_every_module_imports_alone_in_a_fresh_interpreter():
    # (not __main__, which runs the CLI, nor the start-up hook, which is run by path)
    names = sorted(n for n in _modules() if n != "fusionguard.__main__" and not n.startswith("fusionguard._startup"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(PKG), os.environ.get("PYTHONPATH", "")]))
    env.pop("FUSIONGUARD", None)
    p = subprocess.run([sys.executable, "-c", _FORK_EACH, *names], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    alone, after_torch, failed = p.stdout.split(maxsplit=2)
    assert len(names) > 20 and failed.strip() == "[]", p.stdout + p.stderr[-4000:]
    assert int(alone) >= 5 and int(after_torch) >= 5 and int(alone) + int(after_torch) == len(names), p.stdout  # both phases ran


def _tables(state: _state.State) -> Dict[str, int]:
    """Every registry, cache and count of the state, by size."""
    tables = {**state.watch.tables(), **{f"caches.{k}": t for k, t in vars(state.caches).items()}}
    tables.update(rows=state.stats.rows, flex_classes=state.stats.flex_classes, peak=state.stats.peak, counts=state.counts)
    tables.update(pressure=state.stats.pressure, no_flex_told=state.stats.no_flex_told)
    tables.update(reported=state.reported, durable_keys=state.durable_keys, events=state.log.memory)
    tables.update({f"sessions.{k}": t for k, t in state.sessions.tables().items()})
    return {k: len(t) for k, t in tables.items()}


def test_reset_leaves_every_registry_empty(guard):
    state = _state.STATE
    guard()

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return flex_attention(q, k, v, enable_gqa=True)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attn()

        def forward(self, q, k, v):
            return self.attn(q, k, v)

    model = Model()
    q, k, v = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
    with fusionguard.watch(model):
        model(q, k, v)
        filled = {k for k, n in _tables(state).items() if n}
        assert {
            "names",
            "modules",
            "roots",
            "pairs",
            "forward_codes",
            "rows",
            "flex_classes",
            "counts",
            "events",
            "caches.code_kinds",
        } <= filled
        fusionguard.disable()
        held = (state.stats, state.watch, state.caches)
        state.reset()
        assert (state.stats, state.watch, state.caches) == held  # reset in place: modules may hold them
        assert {k: n for k, n in _tables(state).items() if n} == {}
        assert not state.enabled and state.patches.names() == [] and state.stats.watched is state.watch.names


# -- the module map in docs/internals.md: the tree, and its folders as layers -----------------------

DOCS = os.path.join(os.path.dirname(PKG), "docs", "internals.md")
ROOT = os.path.dirname(PKG)


def _section(title: str) -> str:
    text = open(DOCS).read()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _table_cells(section: str) -> List[str]:
    """The first column of a table of the module map (``core/``, ``core/state.py``), in order."""
    rows, text = [], _section("Module map")
    if section != "Module map":
        text = text[text.index(f"### {section}\n") :]
    in_table = False
    for line in text.splitlines():
        if line.startswith("### ") and line != f"### {section}":
            break
        if line.startswith("|"):
            in_table = True
            cell = line.split("|")[1].strip()
            if cell.startswith("`") and cell.endswith("`"):
                rows.append(cell.strip("`"))
        elif in_table:
            break
    return rows


def _layers() -> List[str]:
    """The module map's layer table: folders (``core/``) and top-level modules (``cli.py``), lowest first."""
    return _table_cells("Module map")


def _unit(name: str) -> str:
    """The layer a module belongs to: its folder (``core/``) or, at the top, its file (``cli.py``)."""
    parts = name.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return parts[1] + "/" if os.path.isdir(os.path.join(PKG, parts[1])) else parts[1] + ".py"


def test_the_module_map_lists_exactly_the_files_of_the_tree():
    rows = _table_cells("Modules")
    files = sorted(os.path.relpath(p, PKG).replace(os.sep, "/") for p in _modules().values())
    assert len(rows) == len(set(rows)), [r for r in rows if rows.count(r) > 1]
    assert sorted(rows) == files


def test_the_layer_table_lists_exactly_the_folders_and_top_level_modules():
    layers = _layers()
    assert len(layers) == len(set(layers)), [r for r in layers if layers.count(r) > 1]
    assert sorted(layers) == sorted({_unit(n) for n in _modules()})


def _upward(order: Dict[str, int], modules: Dict[str, str]) -> List[str]:
    up = []
    for name, path in modules.items():
        for target in _imports(name, path, set(modules), late=True):
            if order[_unit(target)] > order[_unit(name)]:
                up.append(f"{name} -> {target}")
    return sorted(up)


def test_every_import_goes_to_its_own_layer_or_a_lower_one():
    """Folders are layers: each folder and top-level module imports only its own folder and the
    layers listed above it in docs/internals.md (module level and inside functions), so the
    folders and top-level modules import each other in no cycle."""
    order = {u: i for i, u in enumerate(_layers())}
    modules = _modules()
    # the check sees an upward edge: core.state importing dense (as it did before #33)
    assert _upward(dict(order, **{"dense/": 0}), modules), "the walk sees imports"
    assert _upward(order, modules) == [], "move the import, or register a callback from the upper layer (docs/internals.md, Module map)"
    units: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        units.setdefault(_unit(name), set()).update(
            _unit(t) for t in _imports(name, path, set(modules), late=True) if _unit(t) != _unit(name)
        )
    assert "core/" in units["dense/"] and "eventlog/" in units["core/"]
    assert _cycles(units) == []
    # the test and benchmark hooks: nothing in the package uses them
    assert [u for u, targets in units.items() if "_testing.py" in targets] == []


# -- size: a module over MAX_MODULE_LINES holds more than one job (issue #33) ------------------------

MAX_MODULE_LINES = 700


def test_no_module_is_longer_than_700_lines():
    lengths = {os.path.relpath(p, PKG).replace(os.sep, "/"): len(open(p).read().splitlines()) for p in _modules().values()}
    assert lengths["report/aggregate.py"] > 100, "the walk counts lines"
    too_long = {f: n for f, n in lengths.items() if n > MAX_MODULE_LINES}
    assert too_long == {}, "split the module: move one coherent part into a new module of the same folder (docs/internals.md)"


def test_the_package_init_is_the_public_surface_only():
    """``__init__.py`` defines the public names and the lazy loading, nothing else: the work of
    ``enable()`` and who made it (the program, the launcher, a session) live in ``_lifecycle.py``."""
    tree = ast.parse(open(os.path.join(PKG, "__init__.py")).read())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assigned = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) for t in ast.walk(n) if isinstance(t, ast.Name)}
    assert defined - set(fusionguard.__all__) == {"__getattr__", "__dir__"}
    assert assigned - {"__all__", "_LAZY"} == set(), "module state of __init__.py: it belongs to a lower layer"


def _dynamic_lookups(path: str) -> List[int]:
    """Lines where ``importlib.import_module`` or ``sys.modules`` reach a fusionguard module by name."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        names: List[ast.expr] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if f.attr == "import_module" or (f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "modules"):
                names = [node.args[0]]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "modules":
            names = [node.slice]
        for arg in names:
            if isinstance(arg, ast.JoinedStr) and arg.values:  # f"fusionguard.{x}"
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith(("fusionguard", ".")):
                found.append(node.lineno)
    return found


def test_no_dynamic_lookup_stands_in_for_an_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib, sys\nimportlib.import_module('fusionguard.patch_sites')\nsys.modules.get('fusionguard')\n"
        "sys.modules['fusionguard.x']\nsys.modules.get('torch')\nimportlib.import_module('torch')\n"
    )
    assert _dynamic_lookups(str(probe)) == [2, 3, 4]  # the check finds them
    found = {os.path.relpath(p, PKG): _dynamic_lookups(p) for p in _modules().values()}
    # (``__init__.py``'s lazy public names may load their modules through importlib: they keep
    # torch out of `import fusionguard`; their names are relative, in ``_LAZY``, not looked up here)
    assert {p: lines for p, lines in found.items() if lines} == {}


def _bare_late_imports(name: str, path: str) -> List[str]:
    lines = open(path).read().splitlines()
    bare: List[str] = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                own = lines[child.end_lineno - 1] if child.end_lineno else ""
                above = lines[child.lineno - 2].strip() if child.lineno > 1 else ""
                reason = own.split("#", 1)[1] if "#" in own else ""
                reason = reason.replace("noqa", "").replace("type: ignore", "").strip(" :#,")
                if not reason and not above.startswith("#"):
                    bare.append(f"{name}:{child.lineno}")
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse("\n".join(lines)), False)
    return bare


def test_every_import_inside_a_function_says_why(tmp_path):
    """A one-line reason on the import's line, or a comment line right above it (a cycle, the cost
    of importing torch, an optional dependency)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\ndef f():\n    import sys\n    import re  # why\n    # why\n    import json\n")
    assert _bare_late_imports("probe", str(probe)) == ["probe:3"]  # the check finds a bare one
    assert [b for name, path in _modules().items() for b in _bare_late_imports(name, path)] == []


def _named_modules(folder: str, doc: str, stems: Set[str]) -> Set[str]:
    """The modules a folder's docstring names: ````x````, ````x.py```` or ````fusionguard.FOLDER.x````,
    where ``x`` is the name of a module of the package (of any folder, or a top-level one)."""
    import re  # (a reason, as the rule above asks of the package)

    named = set()
    for token in re.findall(r"``([\w.]+)``", doc):
        token = token.removesuffix(".py").removeprefix(f"fusionguard.{folder}.")
        if token in stems:
            named.add(token)
    return named


def test_each_folder_docstring_names_exactly_its_modules():
    """A folder's ``__init__`` docstring lists its modules: all of them, and none of another
    folder's (a module that moved leaves a stale list otherwise)."""
    folders: Dict[str, Set[str]] = {}
    for name in _modules():
        parts = name.split(".")
        if len(parts) == 3 and os.path.exists(os.path.join(PKG, parts[1], "__init__.py")):  # (not _startup/: a hook, no package)
            folders.setdefault(parts[1], set()).add(parts[2])
    top = {n.split(".")[1].lstrip("_") for n, path in _modules().items() if n.count(".") == 1 and not path.endswith("__init__.py")}
    stems = set().union(*folders.values()) | top
    assert _named_modules("core", "``state``, ``formatting``, ``fusionguard.core.tables``", stems) == {"state", "formatting", "tables"}
    wrong = {}
    for folder, mods in sorted(folders.items()):
        doc = ast.get_docstring(ast.parse(open(os.path.join(PKG, folder, "__init__.py")).read())) or ""
        named = _named_modules(folder, doc, stems)
        if named != mods:
            wrong[folder] = {"missing": sorted(mods - named), "not its own": sorted(named - mods)}
    assert wrong == {}


def test_the_wiring_section_names_every_lazy_name_and_only_real_state_fields():
    """docs/internals.md names each public name ``import fusionguard`` loads on first use, and no
    ``STATE.x`` the state does not have (it named ``STATE.signals`` long after it was gone)."""
    import re  # (a reason, as the rule above asks of the package)

    wired = _section("Where things are wired")
    assert sorted(n for n in fusionguard._LAZY if f"`{n}`" not in wired) == []
    fields = set(re.findall(r"\bSTATE\.(\w+)", open(DOCS).read()))
    assert "stats" in fields and sorted(f for f in fields if not hasattr(_state.STATE, f)) == []


def test_where_things_go_names_paths_that_exist():
    import re  # (a reason, as the rule above asks of the package)

    named = set(re.findall(r"`((?:fusionguard|tests|docs|examples|benchmarks)/[\w/.]*|pyproject\.toml)`", _section("Where things go")))
    assert len(named) >= 10
    assert sorted(p for p in named if not os.path.exists(os.path.join(ROOT, p))) == []


def _plain_internal_error_trys(path: str) -> List[str]:
    """``try: ... except Exception as exc: internal_error(...)`` blocks whose ``try:`` line gives no
    reason for not being ``guarded()`` (core/state.py)."""
    with open(path, encoding="utf-8") as f:
        src = f.read()
    lines = src.splitlines()
    bare = []
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Try) or "#" in lines[node.lineno - 1]:
            continue
        for h in node.handlers:  # (any handler: a try that also catches Warning first is the same shape)
            calls = {n.func.id for n in ast.walk(h) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            if isinstance(h.type, ast.Name) and h.type.id == "Exception" and "internal_error" in calls:
                bare.append(f"{path}:{node.lineno}")
                break
    return bare


def test_internal_errors_go_through_guarded_or_say_why_not(tmp_path):
    """#33: one shape, ``guarded()``; a plain try/except that logs an internal error stays only with
    a reason on its ``try:`` line (a per-call path, where a try is free and a ``with`` is not; a
    fallback built per call)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    try:\n        g()\n    except Exception as exc:\n        internal_error('f', exc)\n"
        "    try:\n        g()\n    except Warning:\n        pass\n    except Exception as exc:\n        internal_error('f', exc)\n"
    )
    assert _plain_internal_error_trys(str(probe)) == [f"{probe}:2", f"{probe}:6"]  # the check finds both shapes
    assert [b for path in _modules().values() for b in _plain_internal_error_trys(path)] == []
