"""#33: the framework adapters (fusionguard/integrations/) and the pytest plugin use only the
public API: what ``fusionguard.__all__`` exports and the documented public submodule
``fusionguard.session``. They import nothing private and never read the state object."""

from __future__ import annotations

import ast
from pathlib import Path

import fusionguard

ROOT = Path(fusionguard.__file__).parent
ADAPTERS = sorted((ROOT / "integrations").glob("*.py")) + [ROOT / "pytest_plugin.py"]
PUBLIC_MODULES = {"fusionguard", "fusionguard.session"}


def offences(path: Path):
    tree = ast.parse(path.read_text())
    found = []
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fusionguard") and a.name not in PUBLIC_MODULES:
                    found.append(f"{path.name}:{node.lineno} import {a.name}")
                if a.name == "fusionguard":
                    aliases.add(a.asname or "fusionguard")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusionguard"):
            if node.module not in PUBLIC_MODULES:
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
            elif node.module == "fusionguard":
                found += [
                    f"{path.name}:{node.lineno} from fusionguard import {a.name}"
                    for a in node.names
                    if a.name not in fusionguard.__all__ and a.name != "session"
                ]
        elif isinstance(node, ast.Name) and node.id == "STATE":
            found.append(f"{path.name}:{node.lineno} STATE")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr not in fusionguard.__all__ and node.attr != "session":
                found.append(f"{path.name}:{node.lineno} fusionguard.{node.attr}")
    return found


def test_the_adapters_use_only_the_public_api():
    assert len(ADAPTERS) >= 4
    assert [o for p in ADAPTERS for o in offences(p)] == []


def test_the_check_catches_what_main_did(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import fusionguard\nfrom fusionguard.core.state import STATE\nfrom fusionguard import _summary\n"
        "fusionguard._enable_as('x')\nSTATE.counts\n"
    )
    assert len(offences(bad)) == 4
