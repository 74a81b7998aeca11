"""Zero-code activation: ``FUSIONGUARD=strict|warn|off`` and ``fusionguard run -- CMD``.

Real processes: the launcher execs the command, the start-up hook runs in every Python process
of it (a spawn child included), torch is only imported by programs that import it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, read_jsonl

import fusionguard
from fusionguard import _testing, activate
from fusionguard.core import state as _state

PY = sys.executable


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    for name in ("FUSIONGUARD_LOG", "FUSIONGUARD", "PYTHONFAULTHANDLER"):
        env.pop(name, None)
    env.update(extra)
    return env


def _run(args, tmp_path, timeout=240, **env):
    return subprocess.run(args, capture_output=True, text=True, env=_env(**env), cwd=tmp_path, timeout=timeout)


# A training script that knows nothing of fusionguard; its spawn child makes a dense call too.
TRAIN = """
import json, multiprocessing as mp, os, sys, warnings
warnings.simplefilter("ignore")

def child(q):
    out = {"pid": os.getpid()}
    try:
        import torch
        from torch.nn.attention.flex_attention import flex_attention
        x = torch.randn(1, 2, 16, 8)
        try:
            flex_attention(x, x, x)
        except RuntimeError as exc:
            out["blocked"] = type(exc).__name__ == "DenseFallbackError"
        import fusionguard
        out["enabled"] = fusionguard.is_enabled()
    finally:
        q.put(out)

if __name__ == "__main__":
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    x = torch.randn(1, 2, 16, 8)
    try:
        flex_attention(x, x, x)
        blocked = False
    except RuntimeError as exc:
        blocked = type(exc).__name__ == "DenseFallbackError"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    print(json.dumps({"pid": os.getpid(), "blocked": blocked, "child": got}))
"""


def test_fusionguard_run_enables_every_python_process_including_spawn_children(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    logs = tmp_path / "logs"
    p = _run([PY, "-m", "fusionguard", "run", "--strict", "--log", f"{logs}/", "--", PY, "train.py"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["blocked"], "FUSIONGUARD=strict: the dense call was stopped, with no code change"
    assert r["child"]["enabled"] and r["child"]["blocked"], "the spawn child enabled fusionguard through the start-up hook"
    for pid, action in ((r["pid"], "raise"), (r["child"]["pid"], "raise")):
        events = read_jsonl(logs / f"fusionguard.rank0.pid{pid}.jsonl")
        assert events[0]["event"] == "header" and events[0]["config"]["strict"] is True
        assert [e["action"] for e in events if e["event"] == "flex_call"] == [action]


def test_the_hook_chains_to_an_existing_sitecustomize_and_never_imports_torch(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("MARK = 'theirs ran'\n")
    code = "import sys, sitecustomize; print(sitecustomize.MARK, 'torch' in sys.modules, 'fusionguard' in sys.modules)"
    p = subprocess.run(
        [PY, "-m", "fusionguard", "run", "--", PY, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env=_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(theirs)])),
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["theirs", "ran", "False", "False"]


# The hook run as site.py runs it, in a Python started with -S (no site: only what the interpreter
# itself imports), so that what the hook imports shows, whatever this venv's .pth files import.
HOOK_IMPORTS = """
import json, os, sys
before = set(sys.modules)
hook = sys.argv[1]
sys.path.insert(0, os.path.dirname(hook))
exec(compile(open(hook).read(), hook, "exec"), {"__file__": hook, "__name__": "sitecustomize"})
print(json.dumps({"new": sorted(set(sys.modules) - before), "finder": type(sys.meta_path[0]).__name__}))
"""


def test_the_hook_imports_next_to_nothing_in_a_process_that_never_imports_torch(tmp_path):
    """#24: every Python process under ``fusionguard run`` pays for the hook (budget: 10 ms over
    plain Python, benchmarks/startup.py): no typing, no importlib.util (contextlib, functools),
    no wrapt (asyncio), nothing of fusionguard's package, no torch."""
    hook = os.path.join(activate.HOOK_DIR, "sitecustomize.py")
    for mode in ("warn", "strict", ""):
        p = _run([PY, "-S", "-c", HOOK_IMPORTS, hook], tmp_path, FUSIONGUARD=mode)
        assert p.returncode == 0 and p.stderr == "", p.stderr
        got = json.loads(p.stdout)
        heavy = {"typing", "importlib.util", "contextlib", "functools", "wrapt", "asyncio", "re", "fusionguard", "torch"}
        assert not heavy & set(got["new"]), (mode, got["new"])
        assert (got["finder"] == "_TorchWatcher") == bool(mode), (mode, got)
        if mode:
            assert set(got["new"]) <= {
                "_fusionguard_activate",
                "__future__",
                "importlib",
                "importlib._bootstrap",
                "importlib._bootstrap_external",
                "importlib.machinery",
                "warnings",
            }, got["new"]


def test_bad_values_and_missing_commands_are_reported_never_a_crash(tmp_path):
    hook = activate.HOOK_DIR
    p = _run([PY, "-c", "print('ran')"], tmp_path, FUSIONGUARD="loud", PYTHONPATH=os.pathsep.join([hook, str(ROOT)]))
    assert p.returncode == 0 and p.stdout.strip() == "ran"
    assert p.stderr.count("ignoring FUSIONGUARD='loud'") == 1
    p = _run([PY, "-m", "fusionguard", "run", "--", "no-such-command-fg"], tmp_path)
    assert p.returncode == 127 and "cannot run 'no-such-command-fg'" in p.stderr
    (tmp_path / "t5.py").write_text("print('ran')\n")  # #33: a script that exists, named as a command
    p = _run([PY, "-m", "fusionguard", "run", "t5.py", "--x"], tmp_path)
    assert (
        p.returncode == 127
        and "cannot run 't5.py': No such file or directory (a Python script: fusionguard run python t5.py --x)" in p.stderr
    )
    p = _run([PY, "-m", "fusionguard", "run"], tmp_path)
    assert p.returncode == 2 and "no command given" in p.stderr


def test_a_bad_value_is_said_once_by_the_hook_and_the_programs_enable_alike(tmp_path):
    """The start-up hook loads activate.py by path, the package imports it again: the two copies
    share one set of notes said, so the bad value is said once per process, not once per copy."""
    hook = activate.HOOK_DIR
    code = "import fusionguard; fusionguard.enable(log_path=False); fusionguard.disable(); print('ran')"
    p = _run([PY, "-c", code], tmp_path, FUSIONGUARD="bogus", PYTHONPATH=os.pathsep.join([hook, str(ROOT)]))
    assert p.returncode == 0 and p.stdout.strip() == "ran", p.stderr
    assert p.stderr.count("ignoring FUSIONGUARD='bogus'") == 1, p.stderr


def test_launch_env_puts_the_hook_first_once():
    env = activate.launch_env(None, "~/fg/", {"PYTHONPATH": f"/a{os.pathsep}{activate.HOOK_DIR}", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [activate.HOOK_DIR, "/a"]
    assert env["FUSIONGUARD"] == "warn" and env["FUSIONGUARD_LOG"] == os.path.expanduser("~/fg") + os.sep
    assert activate.launch_env("strict", None, {"FUSIONGUARD": "warn"})["FUSIONGUARD"] == "strict"
    assert activate.launch_env(None, None, {"FUSIONGUARD": "off"})["FUSIONGUARD"] == "off"


def test_off_is_a_kill_switch_over_code(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FUSIONGUARD", "OFF")
    activate._told.discard("off")
    fusionguard.enable(strict=True, log_path=str(tmp_path / "fg.jsonl"))
    fusionguard.enable(strict=True, log_path=str(tmp_path / "fg.jsonl"))
    assert not fusionguard.is_enabled() and not (tmp_path / "fg.jsonl").exists()
    assert capsys.readouterr().err.count("FUSIONGUARD=off") == 1
    monkeypatch.setenv("FUSIONGUARD", "warn")  # not off: code decides as always
    fusionguard.enable(strict=True, log_path=str(tmp_path / "fg.jsonl"))
    try:
        assert fusionguard.is_enabled() and _state.STATE.config.strict
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()


def test_torchrun_s_agent_is_left_alone_its_workers_are_not():
    for argv0 in ("/venv/bin/torchrun", "torchrun", "/venv/lib/python3.11/site-packages/torch/distributed/run.py"):
        assert activate.is_launcher(argv0), argv0
    for argv0 in ("train.py", "/x/torchrun_helper.py", "-c", "/venv/lib/python3.11/site-packages/torch/distributed/elastic/x.py"):
        assert not activate.is_launcher(argv0), argv0
    assert activate.is_launcher("-m", ["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"])
    assert not activate.is_launcher("-m", ["python", "-m", "mypkg.train"])
    assert not activate.is_launcher("-m", ["python", "-m"])


# Inductor's CPU vector-ISA check loads a test kernel in a Python child of the compiling process,
# with that process's environment: torch 2.7 on every platform (cpu_vec_isa.VecISA._avx_py_load),
# later releases off Linux only. Under `fusionguard run` it imported torch and wrote a log of its
# own (two per compiling rank: 6 files for 2 ranks in tests/test_distributed.py's fsdp2_unwatched).
PROBE_27 = '\nimport torch\nfrom ctypes import cdll\ncdll.LoadLibrary("__lib_path__")\n'
PROBE_215 = """
import sys
if sys.platform != "linux":
    import torch  # noqa: F401
from ctypes import cdll
try:
    cdll.LoadLibrary("__lib_path__")
except OSError:
    if sys.platform != "linux":
        raise
    import torch  # noqa: F401
    cdll.LoadLibrary("__lib_path__")
"""


def test_torchs_own_helper_processes_are_left_alone():
    from torch._inductor.cpu_vec_isa import VecISA

    for code in (PROBE_27, PROBE_215, VecISA._avx_py_load):  # (2.7's, 2.15's, and this release's)
        assert activate.is_torch_helper("-c", ["python", "-c", code.replace("__lib_path__", "/c/x.so")]), code
    assert activate.is_torch_helper("/venv/lib/python3.11/site-packages/torch/_inductor/compile_worker/__main__.py")
    for code in (
        "import torch\nfrom ctypes import cdll\ncdll.LoadLibrary('x.so')\nrun_attention()",
        "import torch\nfrom ctypes import cdll\nlib = cdll.LoadLibrary('x.so')",
        "import torch\nfrom ctypes import cdll\ntry:\n    cdll.LoadLibrary('x.so')\nexcept OSError:\n    train()",
        "import torch",
        "",
    ):
        assert not activate.is_torch_helper("-c", ["python", "-c", code]), code
    assert not activate.is_torch_helper("-c", ["python", "-c"])
    assert not activate.is_torch_helper("train.py", ["python", "train.py", "-c", PROBE_27])


PROBING = """
import ctypes.util, os, subprocess, sys
import torch
import fusionguard
probe = sys.argv[1].replace("__lib_path__", ctypes.util.find_library("c") or "libc.so.6")
# as torch 2.7's cpu_vec_isa runs it: the parent's environment, its sys.path as PYTHONPATH
subprocess.check_call([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": ":".join(sys.path)})
print(os.getpid(), fusionguard.is_enabled())
"""


def test_fusionguard_run_writes_no_log_for_torchs_vector_isa_probe(tmp_path):
    """The probe child of a compiling process stands down: one log, the program's."""
    (tmp_path / "prog.py").write_text(PROBING)
    logs = tmp_path / "logs"
    p = _run([PY, "-m", "fusionguard", "run", "--log", f"{logs}/", "--", PY, "prog.py", PROBE_27], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    pid, enabled = p.stdout.split()
    assert enabled == "True"
    assert sorted(f.name for f in logs.iterdir() if f.suffix == ".jsonl") == [f"fusionguard.rank0.pid{pid}.jsonl"], p.stderr[-3000:]


WORKER = """
import os, warnings
import torch
from torch.nn.attention.flex_attention import flex_attention
import fusionguard
warnings.simplefilter("ignore")
q = torch.randn(1, 2, 16, 8)
flex_attention(q, q, q)
print("worker", os.environ["RANK"], os.getpid(), fusionguard.is_enabled(), flush=True)
"""


def test_fusionguard_run_torchrun_enables_each_worker_not_the_agent(tmp_path):
    """The issue's example: `fusionguard run -- torchrun ... train.py` with an unmodified script."""
    (tmp_path / "w.py").write_text(WORKER)
    logs = tmp_path / "logs"
    p = _run(
        [PY, "-m", "fusionguard", "run", "--log", f"{logs}/", "--", PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "w.py"],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    workers = sorted(line.split()[1:] for line in p.stdout.splitlines() if line.startswith("worker"))
    assert [(rank, enabled) for rank, _, enabled in workers] == [("0", "True"), ("1", "True")]
    names = sorted(f.name for f in logs.iterdir() if f.suffix == ".jsonl")
    assert names == sorted(f"fusionguard.rank{rank}.pid{pid}.jsonl" for rank, pid, _ in workers), "no log of the agent"
    for name in names:
        assert [e["event"] for e in read_jsonl(logs / name)].count("flex_call") == 1


# -- #27 part 3: the launcher never changes what the program would do ---------------------------


def test_empty_pythonpath_entries_are_kept_the_working_directory_stays_importable(tmp_path):
    """`export PYTHONPATH=$PYTHONPATH:/x` with nothing set before gives `:/x`: the empty entry is
    the working directory, where the script's helper module lives."""
    (tmp_path / "helper.py").write_text("VALUE = 'helper from the working directory'\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text("import json, sys, helper\nprint(json.dumps([helper.VALUE, sys.path]))\n")
    pythonpath = os.pathsep + str(ROOT)
    plain = _run([PY, "scripts/train.py"], tmp_path, PYTHONPATH=pythonpath)
    assert plain.returncode == 0, plain.stderr
    p = _run([PY, "-m", "fusionguard", "run", "--", PY, "scripts/train.py"], tmp_path, PYTHONPATH=pythonpath)
    assert p.returncode == 0, p.stderr[-2000:]
    value, path = json.loads(p.stdout)
    assert value == "helper from the working directory"
    assert [x for x in path if x != activate.HOOK_DIR] == json.loads(plain.stdout)[1], "sys.path as without the launcher"
    # the environment itself: the user's entries exactly, after the hook directory, once
    for old, parts in (
        ("", []),
        (":/a", ["", "/a"]),
        ("/a:", ["/a", ""]),
        ("/a::/b", ["/a", "", "/b"]),
        (f":{activate.HOOK_DIR}:/a", ["", "/a"]),
    ):
        old = old.replace(":", os.pathsep)
        env = activate.launch_env(None, None, {"PYTHONPATH": old} if old else {})
        assert env["PYTHONPATH"].split(os.pathsep) == [activate.HOOK_DIR] + parts, old
        assert activate.launch_env(None, None, env)["PYTHONPATH"] == env["PYTHONPATH"], "a nested launcher changes nothing"


ORDER = """
import json, sys, warnings
warnings.simplefilter("ignore")
{first}
import torch
from torch.nn.attention.flex_attention import flex_attention
import fusionguard
from fusionguard.core.state import STATE
x = torch.randn(1, 2, 16, 8)
try:
    flex_attention(x, x, x)
    outcome = "ran"
except RuntimeError as exc:
    outcome = type(exc).__name__
print(json.dumps({{
    "enabled": fusionguard.is_enabled(), "strict": STATE.config.strict, "not_patched": STATE.not_patched, "outcome": outcome
}}))
"""

ORDERS = {
    "import torch first": "",
    "from fusionguard import watch (isort's order)": "from fusionguard import watch",
    "import fusionguard.fused.runs": "import fusionguard.fused.runs",
    "import fusionguard.dense.guard": "import fusionguard.dense.guard",
    "import fusionguard.dense.rescue": "import fusionguard.dense.rescue",
}


def _order(tmp_path, first, *run_args, name="order.py"):
    (tmp_path / name).write_text(ORDER.format(first=first))
    p = _run([PY, "-m", "fusionguard", "run", *run_args, "--log", f"{tmp_path}/logs/", "--", PY, name], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_every_import_order_gives_a_guarded_process_and_a_true_message(tmp_path):
    baseline, baseline_err = _order(tmp_path, "", "--strict")
    assert baseline["enabled"] and baseline["outcome"] == "DenseFallbackError"
    for label, first in ORDERS.items():
        # (the baseline is the "import torch first" order: the same script, not run twice)
        got, err = (baseline, baseline_err) if first == "" else _order(tmp_path, first, "--strict")
        assert "enable() failed" not in err and "circular import" not in err, (label, err)
        assert got == baseline, (label, got)  # enabled, strict, the same patches, the dense call blocked


def test_a_program_that_enables_before_importing_torch_keeps_its_settings_and_hears_no_false_failure(tmp_path):
    for log_path in ("False", "None"):
        got, err = _order(tmp_path, f"import fusionguard\nfusionguard.enable(strict=False, log_path={log_path})", "--strict")
        assert "enable() failed" not in err and "runs without fusionguard" not in err, (log_path, err)
        assert got["enabled"] and got["strict"] is False and got["outcome"] == "ran", (log_path, got)


def test_modules_loaded_by_another_finder_wait_too_pytest_rewriting_fusionguard(tmp_path):
    """A regular install registers the pytest11 entry point, so pytest's assertion-rewriting
    loader (not the hook's) imports fusionguard's modules: the hook must still wait for them."""
    (tmp_path / "conftest.py").write_text("import pytest\npytest.register_assert_rewrite('fusionguard')\n")
    (tmp_path / "test_inner.py").write_text(
        "from fusionguard import watch\n"
        "import sys, torch, fusionguard\n"
        "from fusionguard.core.state import STATE\n\n"
        "def test_guarded():\n"
        "    assert type(sys.modules['fusionguard.watching'].__loader__).__name__ == 'AssertionRewritingHook'\n"
        "    assert fusionguard.is_enabled() and STATE.config.strict\n"
        "    assert not any('circular' in why for why in STATE.not_patched.values()), STATE.not_patched\n"
    )
    p = _run(
        [
            PY,
            "-m",
            "fusionguard",
            "run",
            "--strict",
            "--log",
            f"{tmp_path}/logs/",
            "--",
            PY,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "test_inner.py",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 passed" in p.stdout and "circular import" not in p.stderr


def test_the_launcher_warns_when_the_command_is_a_python_the_hook_cannot_reach(tmp_path):
    code = "import sys; print('ran', 'fusionguard' in sys.modules or '_fusionguard_activate' in sys.modules)"
    for flags in (["-E"], ["-I"], ["-sE"], ["-S"], ["-X", "dev", "-I"]):
        p = _run([PY, "-m", "fusionguard", "run", "--", PY, *flags, "-c", code], tmp_path)
        assert p.returncode == 0 and p.stdout.split() == ["ran", "False"], (flags, p.stderr)
        (line,) = [x for x in p.stderr.splitlines() if x.startswith("fusionguard run: warning:")]
        assert "start-up hook cannot run in this process" in line and "without fusionguard" in line, line
    script = tmp_path / "tool.py"
    script.write_text(f"#!{PY} -I\n" + code + "\n")
    script.chmod(0o755)
    p = _run([PY, "-m", "fusionguard", "run", "--", str(script)], tmp_path)
    assert p.returncode == 0 and "-I: -I ignores PYTHONPATH" in p.stderr, p.stderr
    for cmd in ([PY, "-c", code], [PY, "-c", code, "-E"], [PY, "-W", "ignore", "-c", code], ["sh", "-c", "echo -E"]):
        p = _run([PY, "-m", "fusionguard", "run", "--", *cmd], tmp_path)
        assert p.returncode == 0 and "warning" not in p.stderr, (cmd, p.stderr)


def test_a_bad_mode_exits_2_before_starting_anything(tmp_path):
    marker = tmp_path / "started"
    cmd = [PY, "-m", "fusionguard", "run", "--", PY, "-c", f"open({str(marker)!r}, 'w')"]
    for bad in ("stirct", "1", "strict,warn"):
        p = _run(cmd, tmp_path, FUSIONGUARD=bad)
        assert p.returncode == 2 and not marker.exists(), (bad, p.stderr)
        assert p.stderr.splitlines() == [
            f"fusionguard run: FUSIONGUARD={bad!r} is not a mode: use one of strict, warn, oom, off "
            "(or --strict / --warn / --oom); nothing was started"
        ]
    for good in ("STRICT", " warn ", "off", ""):
        p = _run(cmd, tmp_path, FUSIONGUARD=good)
        assert p.returncode == 0 and marker.exists(), (good, p.stderr)
        marker.unlink()
    p = _run(cmd[:4] + ["--strict"] + cmd[4:], tmp_path, FUSIONGUARD="stirct")  # the flag decides: the variable is not passed on
    assert p.returncode == 0 and marker.exists(), p.stderr


def test_a_whitespace_mode_is_the_default_warn_never_an_unguarded_run(tmp_path):
    """``FUSIONGUARD='  '`` reads as unset (warn) for the launcher's check: the command gets warn,
    not the blank value the start-up hook would ignore (an unguarded run, silently)."""
    code = "import os, torch, fusionguard; print(repr(os.environ['FUSIONGUARD']), fusionguard.is_enabled())"
    p = _run([PY, "-m", "fusionguard", "run", "--", PY, "-c", code], tmp_path, FUSIONGUARD="  ")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["'warn'", "True"], p.stdout + p.stderr[-3000:]
    assert activate.launch_env(None, None, {"FUSIONGUARD": " Strict\t"})["FUSIONGUARD"] == "strict"
    assert activate.launch_env(None, None, {"FUSIONGUARD": "\t"})["FUSIONGUARD"] == "warn"


def test_an_exported_off_is_said_by_the_launcher_once(tmp_path):
    """``FUSIONGUARD=off`` left exported: the command runs unguarded, as asked, and the launcher
    says so on stderr; a mode flag overrides the variable, and then nothing is said."""
    cmd = [PY, "-m", "fusionguard", "run", "--", PY, "-c", "print('ran')"]
    for off in ("off", " OFF "):
        p = _run(cmd, tmp_path, FUSIONGUARD=off)
        assert p.returncode == 0 and p.stdout.strip() == "ran", p.stderr
        assert p.stderr.splitlines() == [
            "fusionguard run: FUSIONGUARD=off in the environment: the command runs without fusionguard "
            "(unset it, or pass --strict / --warn / --oom)"
        ], p.stderr
    p = _run(cmd[:4] + ["--warn"] + cmd[4:], tmp_path, FUSIONGUARD="off")
    assert p.returncode == 0 and p.stdout.strip() == "ran" and p.stderr == "", p.stderr
    p = _run(cmd, tmp_path)
    assert p.returncode == 0 and p.stderr == "", p.stderr
