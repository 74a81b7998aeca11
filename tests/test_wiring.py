"""The package's wiring: what `import fusionguard` loads, where PyTorch's private names live."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import fusionguard
from fusionguard import torch_internals as ti
from fusionguard.torch_internals import dynamo as dynamo_lookups

PKG = pathlib.Path(fusionguard.__file__).parent
#: Every module but torch_internals' own (a folder): PyTorch's private names are looked up there only.
INTERNALS = sorted(str(p.relative_to(PKG)) for p in (PKG / "torch_internals").glob("*.py"))
CLEAN = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if str(p.relative_to(PKG)) not in INTERNALS)


def _private_torch_names(path: pathlib.Path) -> list:
    """``torch._x`` attribute chains and ``from torch._x import`` / ``import torch._x`` in code
    (strings and comments do not count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.append(f"{path.name}:{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names if a.name.startswith("torch._")]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{path.name}:{node.lineno} torch.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
        ):
            name = node.args[1]  # a private attribute read by name: ours, or one of NOT_TORCH
            if (
                isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and name.value.startswith("_")
                and not name.value.startswith(("__", "_fusionguard"))
            ):
                if name.value not in NOT_TORCH:
                    found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {name.value!r})")
    return found


#: Private names fusionguard reads that are not PyTorch's: name -> whose it is.
NOT_TORCH = {
    "_at_fork_reinit": "CPython: a lock's re-initialisation after fork",
    "_getframe": "CPython: sys._getframe",
    "_initializing": "importlib: the ModuleSpec flag of a module being executed",
    "_DummyThread": "threading: the class of a thread threading did not start",
    "_tmp_path_factory": "pytest: the config's tmp_path factory",
    "_process_event": "structlog: BoundLoggerBase's processor chain",
    "_attn_implementation": "transformers: a model config's attention backend",
    "_compiler_ctx": "lightning: a LightningModule's torch.compile context",
    "_pytest": "pytest: its package, whose fixtures drive yield fixtures (allow_dense() in a generator)",
}


def test_private_torch_names_live_in_torch_internals_only():
    found = [hit for name in CLEAN for hit in _private_torch_names(PKG / name)]
    assert found == []
    assert len(INTERNALS) >= 2 and [hit for name in INTERNALS for hit in _private_torch_names(PKG / name)], (
        "the check finds what it looks for"
    )


# --- Every private name by its spelling: the registry torch_internals.PRIVATE_NAMES -----------

_RE_FUNCTIONS = {"compile", "sub", "subn", "search", "match", "fullmatch", "findall", "finditer", "split"}
_PIECE = re.compile(r"\.([A-Za-z_]\w*)|([A-Za-z_]\w*)\[")
_WORD = re.compile(r"[A-Za-z_]\w*")


def _names_spelled(source: str) -> list:
    """``(line, name, how)`` of every name a module's code spells: attribute names (``attr``) and
    keyword arguments (``kwarg``); string constants, whole (``str``: an identifier, a file name);
    the ``.name`` / ``name[`` pieces of a path-like string or f-string part, one without
    whitespace (``piece``: ``"._modules["``, ``f"{n}._orig_mod"``); the words of a pattern given
    to ``re`` (``regex``). Docstrings and other prose (text with spaces) do not count, nor do the
    qualified names of torch's own modules in labels and messages (``"torch._dynamo.config.disable"``:
    code reaches those modules through torch_internals only, see the check above)."""
    tree = ast.parse(source)
    prose, parts, patterns = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            prose.add(id(node.value))  # docstrings and bare strings
        elif isinstance(node, ast.JoinedStr):
            parts.update(id(v) for v in node.values if isinstance(v, ast.Constant))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _RE_FUNCTIONS:
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args:
                patterns.add(id(node.args[0]))
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute):
            found.append((line, node.attr, "attr"))
        elif isinstance(node, ast.keyword) and node.arg:
            found.append((line, node.arg, "kwarg"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            text = node.value
            if id(node) in patterns:
                found += [(line, w, "regex") for w in _WORD.findall(text)]
                continue
            if id(node) not in parts:
                found.append((line, text, "str"))
            if not any(c.isspace() for c in text) and not text.startswith("torch."):
                found += [(line, a or b, "piece") for a, b in _PIECE.findall(text)]
    return found


def _defined_here() -> set:
    """Every name fusionguard defines itself: modules, functions, classes, variables, attributes
    it sets, arguments, import aliases."""
    ours = set()
    for path in PKG.rglob("*.py"):
        ours.update(p for p in path.relative_to(PKG).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.arg):
                ours.add(node.arg)
            elif isinstance(node, ast.Import):  # (``import torch._dynamo`` binds ``torch``)
                ours.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                ours.update(a.asname or a.name for a in node.names)
    return ours


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_fusionguard") and name.isidentifier()


def test_no_registered_private_name_is_spelled_outside_torch_internals():
    """A name of ``PRIVATE_NAMES`` (``_orig_mod``, ``py_kernels``, ...) spelled anywhere else:
    use the constant or the lookup of torch_internals instead."""
    found = [
        f"{name}:{line} {what!r} ({how})"
        for name in CLEAN
        for line, what, how in _names_spelled((PKG / name).read_text())
        if what in ti.PRIVATE_NAMES
    ]
    assert found == []


def test_a_private_name_not_ours_is_a_registered_one():
    """Every underscore-prefixed name a module spells is fusionguard's own, another library's
    (``NOT_TORCH``) or, in torch_internals only, one of ``PRIVATE_NAMES``: a new private PyTorch
    name anywhere else fails here until it is registered (and used from) there. (The words of a
    pattern are checked against the registry only: ``(?:_backward)?`` is no name.)"""
    ours = _defined_here()
    found = []
    for name in CLEAN + INTERNALS:
        allowed = ti.PRIVATE_NAMES if name in INTERNALS else {}
        for line, what, how in _names_spelled((PKG / name).read_text()):
            if how != "regex" and _is_private(what) and what not in ours and what not in NOT_TORCH and what not in allowed:
                found.append(f"{name}:{line} {what}")
    assert found == []
    assert not set(ti.PRIVATE_NAMES) & set(NOT_TORCH)
    assert len(ti.PRIVATE_NAMES) > 40 and all(ti.PRIVATE_NAMES.values()), "each name says whose it is"


def test_the_spelling_check_finds_each_kind_of_spelling():
    code = """
\"\"\"A docstring naming _orig_mod and x._modules[0] is prose.\"\"\"
import re
a = m._orig_mod
b = m.__dict__.get("_modules")
c = text.replace("._fwd_fn[", "[")
d = f"{name}._bwd_fn"
e = re.compile(r"(^|\\.)_identity(?=\\.|$)")
f = create_block_mask(fn, _compile=True)
g = frame.f_code.co_filename.endswith("eval_frame.py")
h = "torch._dynamo.config.disable"
i = "a message about _dispatch_cache, in words"
"""
    spelled = {(what, how) for _, what, how in _names_spelled(code)}
    assert {
        ("_orig_mod", "attr"),
        ("_modules", "str"),
        ("_fwd_fn", "piece"),
        ("_bwd_fn", "piece"),
        ("_identity", "regex"),
        ("_compile", "kwarg"),
        ("eval_frame.py", "str"),
    } <= spelled
    names = {what for what, _ in spelled}
    assert "_dynamo" not in names and "_dispatch_cache" not in names
    registered = names & set(ti.PRIVATE_NAMES)
    assert {"_orig_mod", "_modules", "_fwd_fn", "_bwd_fn", "_identity", "_compile", "eval_frame.py"} <= registered


def test_import_fusionguard_does_not_import_torch():
    code = "import sys, fusionguard; fusionguard.is_enabled(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_dynamo_lookups_answer_on_this_torch_and_nothing_where_missing():
    import torch

    assert ti.orig_code_map() is not None and ti.dynamo_config() is not None
    assert ti.recompile_limit_value() == torch._dynamo.config.recompile_limit
    assert ti.dynamo_disabled() is False
    assert ti.compile_callbacks() is not None and ti.structured_trace() is not None
    assert ti.lookup_backend("eager") is not None
    assert ti.cache_entries(test_dynamo_lookups_answer_on_this_torch_and_nothing_where_missing.__code__) == []
    assert isinstance(ti.compilation_metrics(), list) and isinstance(ti.dynamo_counters("graph_break"), dict)
    # a release that keeps a name elsewhere: "nothing", never an exception
    assert dynamo_lookups._dynamo_attr("torch._dynamo.no_such_module", "x") is None
    assert dynamo_lookups._dynamo_attr("torch._dynamo.utils", "no_such_name") is None


def test_hook_and_graph_lookups_answer_on_this_torch_and_nothing_where_missing():
    import torch

    calls = []
    layer = torch.nn.Linear(2, 2)
    handle = layer.register_forward_hook(lambda *a: calls.append(1), with_kwargs=True, always_call=True)
    marks = ti.hook_marks(handle)
    assert marks and ti.hooks_home(handle)() is layer._forward_hooks
    hook = layer._forward_hooks[handle.id]
    handle.remove()
    layer(torch.ones(2))
    assert calls == []
    assert ti.reinsert_hook(handle, hook, marks) is True  # back under its old id, with its flags
    layer(torch.ones(2))
    assert calls == [1] and list(layer._forward_hooks) == [handle.id] and handle.id in layer._forward_hooks_always_called
    # another torch's handle, or no compiled graph: "nothing", never an exception
    assert ti.hook_marks(object()) == () and ti.reinsert_hook(object(), hook, marks) is False
    assert ti.graph_callable(object()) is None and ti.graph_callable_is_own(object()) is False
    assert ti.graph_uses_cudagraphs(object()) is False and ti.compiled_graph_text(object(), source=True) == ""


def test_the_allow_dense_context_variable_is_read_only_through_dense_allowed_here():
    """Its value (an ``Allowance``) stays truthy after the block closes: a module testing
    ``if <var>.get():`` lets dense work through in a context copied inside a closed block. Only
    ``core/state.py`` (``dense_allowed_here``, ``open_allowance``, ``close_allowance``) may touch it."""
    touching = []
    for name in CLEAN + INTERNALS:
        if name == "core/state.py":
            continue
        for node in ast.walk(ast.parse((PKG / name).read_text(), name)):
            ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if ident is None and isinstance(node, ast.alias):
                ident = node.name
            if ident is not None and ident.lstrip("_") == "ALLOW_DENSE":
                touching.append(f"{name}:{getattr(node, 'lineno', '?')} {ident}")
    assert touching == []
    state = (PKG / "core" / "state.py").read_text()
    assert "_ALLOW_DENSE.get()" in state, "the check looks for the name the variable has"
