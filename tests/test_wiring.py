"""The package's wiring: what `import fusionguard` loads, where PyTorch's private names live."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import fusionguard
from fusionguard import torch_internals as ti

PKG = pathlib.Path(fusionguard.__file__).parent
#: Every module but torch_internals itself: PyTorch's private names are looked up there only.
CLEAN = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if p.name != "torch_internals.py")


def _private_torch_names(path: pathlib.Path) -> list:
    """``torch._x`` attribute chains and ``from torch._x import`` / ``import torch._x`` in code
    (strings and comments do not count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.append(f"{path.name}:{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names if a.name.startswith("torch._")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{path.name}:{node.lineno} torch.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1:
            name = node.args[1]  # a private attribute read by name: ours, or one of NOT_TORCH
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_") and not name.value.startswith(("__", "_fusionguard")):
                if name.value not in NOT_TORCH:
                    found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {name.value!r})")
    return found


#: Private names fusionguard reads that are not PyTorch's.
NOT_TORCH = {"_at_fork_reinit", "_tmp_path_factory", "_attn_implementation", "_compiler_ctx", "_initializing", "_DummyThread"}  # CPython's lock re-init after fork; pytest's tmp_path factory; transformers' config; importlib's ModuleSpec flag of a module being executed; threading's class of a thread it did not create


def test_private_torch_names_live_in_torch_internals_only():
    found = [hit for name in CLEAN for hit in _private_torch_names(PKG / name)]
    assert found == []
    assert _private_torch_names(PKG / "torch_internals.py"), "the check finds what it looks for"


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
    assert ti._dynamo_attr("torch._dynamo.no_such_module", "x") is None
    assert ti._dynamo_attr("torch._dynamo.utils", "no_such_name") is None


def test_the_allow_dense_context_variable_is_read_only_through_dense_allowed_here():
    """Its value (an ``Allowance``) stays truthy after the block closes: a module testing
    ``if <var>.get():`` lets dense work through in a context copied inside a closed block. Only
    ``core/state.py`` (``dense_allowed_here``, ``open_allowance``, ``close_allowance``) may touch it."""
    touching = []
    for name in CLEAN + ["torch_internals.py"]:
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
