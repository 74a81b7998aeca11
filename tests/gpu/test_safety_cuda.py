"""Issue #16 on a CUDA GPU: counts that survive SIGKILL, a native crash after a CUDA dense call,
and a child forked after CUDA was initialised (a DataLoader worker) that logs without hanging.

Skipped (and so not counted as passing) on machines without CUDA; run on the device machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT, read_jsonl, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N = 41
SCRIPT = """
import os, signal, sys, time, warnings
import torch
import fusionguard
from fusionguard.core.state import STATE
from torch.nn.attention.flex_attention import flex_attention
warnings.simplefilter("ignore")
fusionguard.enable(log_path=sys.argv[1], dense_first=3)
q = torch.randn(1, 4, 256, 64, device="cuda")
for _ in range(%(n)d):
    flex_attention(q, q, q)
torch.cuda.synchronize()
how = sys.argv[2]
if how == "fork":  # a worker forked after CUDA init that only logs (as DataLoader workers may)
    pid = os.fork()
    if pid == 0:
        try:
            for j in range(5):
                STATE.log.emit("warning", "child_probe", j=j)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got, st = os.waitpid(pid, os.WNOHANG)
        if got:
            print("child", pid, os.waitstatus_to_exitcode(st), flush=True)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("child hung", flush=True)
    fusionguard.disable()
    sys.exit(0)
time.sleep(1.5)
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
import faulthandler
faulthandler._sigsegv()
"""


def _run(tmp_path, how):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(SCRIPT % {"n": N}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("FUSIONGUARD_LOG", "FUSIONGUARD", "PYTHONFAULTHANDLER"):
        env.pop(name, None)
    log = tmp_path / f"{how}.jsonl"
    p = subprocess.run([sys.executable, str(script), str(log), how], capture_output=True, text=True, env=env, timeout=300)
    return p, log


def test_cuda_dense_counts_survive_sigkill(tmp_path, capsys):
    p, log = _run(tmp_path, "sigkill")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    rc, out, _ = run_cli(capsys, log, "--format", "json")
    rep = json.loads(out)
    assert rep["totals"]["dense_calls"] == N
    assert [e["ending"] for e in rep["endings"]] == ["stopped"]


def test_native_crash_after_a_cuda_dense_call_is_in_the_report(tmp_path, capsys):
    p, log = _run(tmp_path, "segv")
    assert p.returncode == -signal.SIGSEGV, p.stderr[-2000:]
    header = read_jsonl(log)[0]
    assert header["crash_capture"] == "faulthandler" and header["cuda"]["available"]
    rc, out, _ = run_cli(capsys, log, "--format", "json")
    (c,) = json.loads(out)["crashes"]
    assert c["crash"]["exc_type"] == "native crash (SIGSEGV)"
    assert c["crash"]["last_flex"]["path"] == "dense"


def test_a_child_forked_after_cuda_init_logs_to_its_own_pid(tmp_path):
    p, log = _run(tmp_path, "fork")
    assert p.returncode == 0, p.stderr[-2000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("child")][-1]
    assert line.split()[2] == "0", line
    child = int(line.split()[1])
    events = read_jsonl(log)
    mine = [e for e in events if e["pid"] == child]
    assert [e["event"] for e in mine] == ["header"] + ["child_probe"] * 5
    assert mine[0]["forked_from"] != child
