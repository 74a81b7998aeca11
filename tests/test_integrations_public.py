"""#33: the framework adapters (fusionguard/integrations/) and the pytest plugin, the examples and
the Python blocks of the docs use only the public API: what ``fusionguard.__all__`` exports and
the documented public submodules (``fusionguard.session``, ``fusionguard.integrations.*``). They
import nothing private, spell no name a public module does not export (``fusionguard.session._LIVE``,
``fusionguard.session.STATE``: a submodule's names are its ``__all__``) and never read the state object."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import docs_blocks

import fusionguard

ROOT = Path(fusionguard.__file__).parent
ADAPTERS = sorted((ROOT / "integrations").glob("*.py")) + [ROOT / "pytest_plugin.py"]
EXAMPLES = sorted((ROOT.parent / "examples").glob("*.py"))
PUBLIC_MODULES = {
    "fusionguard",
    "fusionguard.session",
    "fusionguard.integrations",
    "fusionguard.integrations.lightning",
    "fusionguard.integrations.transformers",
}


def _exports(module: str) -> Set[str]:
    """The ``__all__`` of a public submodule, read from its source (importing it would import its
    framework); a module without one (the ``integrations`` package) exports only its submodules."""
    path = ROOT.parent.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _private_name(module: str, name: str) -> bool:
    """``name`` of the public ``module`` is not public: a ``_``-name, or one the module does not export
    (``fusionguard.__all__``; a public submodule's own ``__all__``), nor a public submodule."""
    if name.startswith("__") and name.endswith("__"):
        return False
    if name.startswith("_"):
        return True
    exported = set(fusionguard.__all__) if module == "fusionguard" else _exports(module)
    return name not in exported and f"{module}.{name}" not in PUBLIC_MODULES


def offences(source: str, where: str) -> List[str]:
    tree = ast.parse(source)
    found: List[str] = []
    bound: Dict[str, str] = {}  # local name -> the fusionguard module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fusionguard"):
                    if a.name not in PUBLIC_MODULES:
                        found.append(f"{where}:{node.lineno} import {a.name}")
                    bound[a.asname or "fusionguard"] = a.name if a.asname else "fusionguard"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusionguard"):
            module = node.module or ""
            if module not in PUBLIC_MODULES:
                found.append(f"{where}:{node.lineno} from {module} import ...")
                continue
            for a in node.names:
                if f"{module}.{a.name}" in PUBLIC_MODULES:
                    bound[a.asname or a.name] = f"{module}.{a.name}"
                elif _private_name(module, a.name):
                    found.append(f"{where}:{node.lineno} from {module} import {a.name}")
        elif isinstance(node, ast.Name) and node.id == "STATE":
            found.append(f"{where}:{node.lineno} STATE")
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts: List[str] = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            parts.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in bound:
            continue
        module = bound[base.id]
        for part in parts:  # down the public modules, to the first name that is not one
            if _private_name(module, part):
                found.append(f"{where}:{node.lineno} {module}.{part}")
                break
            if f"{module}.{part}" not in PUBLIC_MODULES:
                break
            module = f"{module}.{part}"
    return found


def test_the_adapters_use_only_the_public_api():
    assert len(ADAPTERS) >= 4
    assert [o for p in ADAPTERS for o in offences(p.read_text(), p.name)] == []


def test_the_examples_use_only_the_public_api():
    assert len(EXAMPLES) >= 5
    assert [o for p in EXAMPLES for o in offences(p.read_text(), p.name)] == []


def test_the_python_blocks_of_the_docs_use_only_the_public_api():
    blocks = [b for b in docs_blocks.blocks() if b.python]
    assert len(blocks) >= 10
    found: List[str] = []
    unparsed: Set[str] = set()
    for b in blocks:
        try:
            found += offences(b.text, b.id)
        except SyntaxError:
            unparsed.add(b.id)
    assert found == []
    assert len(unparsed) <= len(blocks) // 4, unparsed  # (fragments may elide; most blocks parse)


def test_the_check_catches_what_main_did(tmp_path):
    bad = (
        "import fusionguard\nfrom fusionguard.core.state import STATE\nfrom fusionguard import _summary\n"
        "fusionguard._enable_as('x')\nSTATE.counts\n"
    )
    assert len(offences(bad, "bad.py")) == 4
    sneaky = (
        "import fusionguard\nimport fusionguard.session as s\nfrom fusionguard import session\n"
        "from fusionguard.session import _Tally, Session\nfusionguard.session._LIVE\ns._LIVE\nsession._tap\n"
        "fusionguard.core.state.STATE\nfusionguard.track(None).counts()\nfusionguard.__version__\n"
    )
    assert offences(sneaky, "x.py") == [
        "x.py:4 from fusionguard.session import _Tally",
        "x.py:5 fusionguard.session._LIVE",
        "x.py:6 fusionguard.session._LIVE",
        "x.py:7 fusionguard.session._tap",
        "x.py:8 fusionguard.core",
    ]


def test_the_check_catches_unexported_names_of_a_public_submodule():
    """A public submodule's names are its ``__all__``: its imports (``STATE``, ``internal_error``) are not API."""
    spellings = (
        "import fusionguard\nimport fusionguard.session\nfrom fusionguard.session import STATE\n"
        "fusionguard.session.STATE.runtime\nfusionguard.session.internal_error('x', None)\n"
        "from fusionguard.integrations.transformers import logger\n"
        "from fusionguard.session import Counts, Session, Verdict, describe, track\n"
        "from fusionguard.integrations.lightning import FusionGuardCallback\nfusionguard.session.Counts\n"
        "from fusionguard import integrations\nintegrations.transformers.FusionGuardCallback\nintegrations.lightning.said\n"
    )
    assert sorted(offences(spellings, "x.py")) == [
        "x.py:12 fusionguard.integrations.lightning.said",
        "x.py:3 from fusionguard.session import STATE",
        "x.py:4 fusionguard.session.STATE",
        "x.py:5 fusionguard.session.internal_error",
        "x.py:6 from fusionguard.integrations.transformers import logger",
    ]
    assert {"Counts", "Session", "Verdict", "describe", "track"} <= _exports("fusionguard.session")
