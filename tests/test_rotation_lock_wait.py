"""A rotating log's lock file held by someone else never hangs the program (issue #32 point 3).

``<log>.lock`` is opened read-only, so any reader of the log may ``flock`` it, and a sibling
writer stopped with Ctrl-Z or in a debugger holds it for good. fusionguard waits a bounded time
once per process, then writes without the lock, says so once, and never waits again (later
writes try ``LOCK_NB``). Real processes: one holding the lock, one writing through enable().
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
from conftest import child_env, read_jsonl

fcntl = pytest.importorskip("fcntl")

HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
if sys.argv[2] == "stop":
    os.kill(os.getpid(), __import__("signal").SIGSTOP)  # a sibling stopped while holding it
sys.stdin.read()  # until the test closes our stdin
"""

WRITER = r"""
import json, sys, time
import torch  # (imported first: enable() is timed, not the import)
import fusionguard
from fusionguard.core.state import emit
from fusionguard.eventlog import sink
LOCK_WAIT_S = getattr(sink, "LOCK_WAIT_S", 2.0)
t0 = time.monotonic()
fusionguard.enable(log_path=sys.argv[1], log_max_bytes=8192, log_backups=20)
t1 = time.monotonic()
for i in range(200):
    emit("info", "probe", i=i)
t2 = time.monotonic()
fusionguard.disable()
print(json.dumps({"enable_s": t1 - t0, "writes_s": t2 - t1, "wait": LOCK_WAIT_S}))
"""


def _hold(lock, how):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if how == "stop":
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # stopped (state T) once it holds the lock
            with open(f"/proc/{holder.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.05)
    else:
        assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("how", ["reader", "stop"])
def test_a_held_lock_file_costs_one_bounded_wait_and_one_message(tmp_path, how):
    if how == "stop" and not os.path.exists("/proc/self/stat"):
        pytest.skip("reads the holder's state from /proc")
    log = tmp_path / "fg.jsonl"
    holder = _hold(tmp_path / "fg.jsonl.lock", how)
    try:
        run = forkserver.run([sys.executable, "-c", WRITER, str(log)], capture_output=True, text=True, timeout=120, env=child_env())
    except subprocess.TimeoutExpired:
        pytest.fail("enable() and the writes hung on the held lock file")
    finally:
        if how == "stop":
            os.kill(holder.pid, signal.SIGCONT)
        holder.stdin.close()
        holder.wait(30)
    assert run.returncode == 0, run.stderr
    times = json.loads(run.stdout.strip().splitlines()[-1])
    assert times["enable_s"] < times["wait"] + 10  # (enable() imports torch: a generous margin)
    assert times["writes_s"] < 2.0, "later writes waited again"
    said = [line for line in run.stderr.splitlines() if "lock" in line and "without" in line]
    assert len(said) == 1, run.stderr
    assert str(log) + ".lock" in said[0]
    # nothing lost: every probe is in the log or its backups (rotated without the lock)
    assert len([p for p in tmp_path.glob("fg.jsonl.*") if not p.name.endswith(".lock")]) >= 2
    probes = set()
    for path in tmp_path.glob("fg.jsonl*"):
        if not path.name.endswith(".lock"):
            probes.update(e["i"] for e in read_jsonl(path) if e.get("event") == "probe")
    assert probes == set(range(200))


def test_a_lock_released_in_time_is_taken_and_nothing_is_said(tmp_path):
    """The bounded wait is a wait: a holder that lets go within it is waited for (the lock is
    taken, no message)."""
    log = tmp_path / "fg.jsonl"
    holder = _hold(tmp_path / "fg.jsonl.lock", "reader")
    writer = forkserver.popen(
        [sys.executable, "-c", WRITER, str(log)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()
    )
    time.sleep(0.2)  # (the writer is still importing torch: the lock is released before its first write or during its wait)
    holder.stdin.close()
    holder.wait(30)
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    assert not [line for line in err.splitlines() if "lock" in line and "without" in line], err
    assert json.loads(out.strip().splitlines()[-1])["writes_s"] < 2.0
