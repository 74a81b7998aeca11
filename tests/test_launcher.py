"""Zero-code activation: ``FUSIONGUARD=strict|warn|off`` and ``fusionguard run -- CMD``.

Real processes: the launcher execs the command, the start-up hook runs in every Python process
of it (a spawn child included), torch is only imported by programs that import it."""

from __future__ import annotations

import json
import os
import subprocess
import sys


import fusionguard
from fusionguard import _state, activate
from conftest import ROOT, read_jsonl

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
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(theirs)])),
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["theirs", "ran", "False", "False"]


def test_bad_values_and_missing_commands_are_reported_never_a_crash(tmp_path):
    hook = activate.HOOK_DIR
    p = _run([PY, "-c", "print('ran')"], tmp_path, FUSIONGUARD="loud", PYTHONPATH=os.pathsep.join([hook, str(ROOT)]))
    assert p.returncode == 0 and p.stdout.strip() == "ran"
    assert p.stderr.count("ignoring FUSIONGUARD='loud'") == 1
    p = _run([PY, "-m", "fusionguard", "run", "--", "no-such-command-fg"], tmp_path)
    assert p.returncode == 127 and "cannot run 'no-such-command-fg'" in p.stderr
    p = _run([PY, "-m", "fusionguard", "run"], tmp_path)
    assert p.returncode == 2 and "no command given" in p.stderr


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
        _state.reset_for_tests()


def test_torchrun_s_agent_is_left_alone_its_workers_are_not():
    for argv0 in ("/venv/bin/torchrun", "torchrun", "/venv/lib/python3.11/site-packages/torch/distributed/run.py"):
        assert activate.is_launcher(argv0), argv0
    for argv0 in ("train.py", "/x/torchrun_helper.py", "-c", "/venv/lib/python3.11/site-packages/torch/distributed/elastic/x.py"):
        assert not activate.is_launcher(argv0), argv0
    assert activate.is_launcher("-m", ["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"])
    assert not activate.is_launcher("-m", ["python", "-m", "mypkg.train"])
    assert not activate.is_launcher("-m", ["python", "-m"])


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
    p = _run([PY, "-m", "fusionguard", "run", "--log", f"{logs}/", "--", PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "w.py"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    workers = sorted(line.split()[1:] for line in p.stdout.splitlines() if line.startswith("worker"))
    assert [(rank, enabled) for rank, _, enabled in workers] == [("0", "True"), ("1", "True")]
    names = sorted(f.name for f in logs.iterdir() if f.suffix == ".jsonl")
    assert names == sorted(f"fusionguard.rank{rank}.pid{pid}.jsonl" for rank, pid, _ in workers), "no log of the agent"
    for name in names:
        assert [e["event"] for e in read_jsonl(logs / name)].count("flex_call") == 1
