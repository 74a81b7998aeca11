"""The fork server (tests/forkserver.py) serves the suite's children (#34): a request it cannot
serve exactly runs as a fresh interpreter, correct but several CPU seconds slower, and silent.
Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK`` when imported (the suite's collection imports it),
which the server took for a variable read at start-up: every child of a full run was a fresh
interpreter (91 of them, about 870 s on 2 cores), while any one file alone was forked."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import forkserver
import pytest
import torch
from conftest import ROOT, child_env

# What the suite's test modules import at collection (tests/test_integrations_*.py, examples/).
SUITE_IMPORTS = ("lightning", "lightning.pytorch", "transformers", "accelerate", "torch.utils.tensorboard")


def _server_or_skip() -> None:
    why = forkserver.why_not([sys.executable, "-c", "pass"], child_env())
    if why and why.startswith("no fork server"):
        pytest.skip(f"{why}: every child runs as a fresh interpreter on torch {torch.__version__}")


def test_the_suites_own_imports_leave_its_children_forked():
    _server_or_skip()
    for name in SUITE_IMPORTS:
        importlib.import_module(name)  # (in the test extra: a missing one fails here, never skips)
    args = [sys.executable, "-c", "import json, os, sys; print(json.dumps(['torch' in sys.modules, os.environ.get('X')]))"]
    env = child_env(X="late")
    assert forkserver.why_not(args, env) is None
    out = forkserver.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [True, "late"]  # (torch already imported: forked, not a fresh interpreter)


@pytest.mark.parametrize("name", ["TORCH_LOGS", "OMP_NUM_THREADS", "PYTHONHASHSEED", "TMPDIR", "CXX", "COVERAGE_PROCESS_START"])
def test_a_variable_read_at_start_up_still_gets_a_fresh_interpreter(name):
    _server_or_skip()
    env = child_env(**{name: "7" if name != "TORCH_LOGS" else "+dynamo"})
    assert forkserver.why_not([sys.executable, "-c", "pass"], env) == f"{name} read at start-up"


def test_a_pythonpath_with_a_sitecustomize_gets_a_fresh_interpreter():
    """fusionguard's start-up hook (``fusionguard/_startup`` first on PYTHONPATH) runs only when an
    interpreter starts: a fork would silently go without it."""
    _server_or_skip()
    hook = str(ROOT / "fusionguard" / "_startup")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([hook, env["PYTHONPATH"]])
    assert forkserver.why_not([sys.executable, "-c", "pass"], env) == f"PYTHONPATH adds {hook}, whose sitecustomize runs at start-up"


STACK = """
import json, os, sys
from fusionguard.core.frames import is_user_file

def frames():
    f, out = sys._getframe(), []
    while f is not None:
        if is_user_file(f.f_code.co_filename):
            out.append([os.path.basename(f.f_code.co_filename), f.f_code.co_name])
        f = f.f_back
    return out

print(json.dumps(frames()))
"""


@pytest.mark.parametrize("form", ["-c", "script", "-m"])
def test_a_forked_child_sees_the_stack_a_fresh_interpreter_would(tmp_path, form):
    """fusionguard names a call by the first frame that is the user's (not torch's, not its own, not
    ``<string>``): a forked child's stack must hold no frame of the server below its own code. (It
    did: a ``-c`` child's call sites fell on tests/forkserver.py where a fresh one finds none.)"""
    _server_or_skip()
    (tmp_path / "stack_script.py").write_text(STACK)
    args = {"-c": ["-c", STACK], "script": [str(tmp_path / "stack_script.py")], "-m": ["-m", "stack_script"]}[form]
    args = [sys.executable, *args]
    env = child_env()
    assert forkserver.why_not(args, env) is None
    fresh = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    forked = forkserver.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert fresh.returncode == forked.returncode == 0, (fresh.stderr[-2000:], forked.stderr[-2000:])
    assert json.loads(forked.stdout) == json.loads(fresh.stdout), (forked.stdout, fresh.stdout)
    assert json.loads(fresh.stdout)[:1] == ([] if form == "-c" else [["stack_script.py", "frames"]])


ENDINGS = {
    "exit -1": ("import sys; print('x'); sys.exit(-1)\n", "utf-8"),
    "KeyboardInterrupt": ("print('x', flush=True)\nraise KeyboardInterrupt\n", "utf-8"),
    "latin-1 cookie": ("# -*- coding: latin-1 -*-\nprint('caf\xe9')\n", "latin-1"),
    "BOM": ("\ufeffprint('x')\n", "utf-8"),
}


@pytest.mark.parametrize("case", sorted(ENDINGS))
def test_a_forked_script_ends_and_decodes_as_a_fresh_interpreter_does(tmp_path, case):
    """Exit statuses (``sys.exit(-1)`` is 255, an uncaught KeyboardInterrupt ends by SIGINT) and
    source decoding (a coding cookie, a BOM) as Python's own; a script path that is no file (missing,
    a directory) is run by a fresh interpreter, which says what Python says."""
    _server_or_skip()
    text, encoding = ENDINGS[case]
    (tmp_path / "s.py").write_bytes(text.encode(encoding))
    args, env = [sys.executable, "s.py"], child_env()
    assert forkserver.why_not(args, env, tmp_path) is None
    fresh = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, timeout=120)
    forked = forkserver.run(args, env=env, cwd=tmp_path, capture_output=True, timeout=120)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), (forked, fresh)
    assert fresh.returncode == {"exit -1": 255, "KeyboardInterrupt": -2}.get(case, 0)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "__main__.py").write_text("print('dir')")
    for name, rc in (("missing.py", 2), ("d", 0)):
        assert forkserver.why_not([sys.executable, name], env, tmp_path)
        assert forkserver.run([sys.executable, name], env=env, cwd=tmp_path, capture_output=True, timeout=120).returncode == rc
