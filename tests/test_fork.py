"""Fork safety: real ``os.fork`` while other threads write events, and forked workers that end
with ``os._exit``. Each scenario runs in its own subprocess (so a hang or a leaked patch cannot
reach pytest); every wait is bounded and only our own children are killed, by pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
from conftest import child_env, read_jsonl, run_cli

PY = sys.executable

# A bounded wait for forked children: (exit codes by pid, pids that hung and were killed).
WAIT = """
import os, signal, time
def wait_children(pids, timeout):
    status, deadline = {}, time.monotonic() + timeout
    while len(status) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in status:
                got, st = os.waitpid(pid, os.WNOHANG)
                if got:
                    status[pid] = os.waitstatus_to_exitcode(st)
        time.sleep(0.02)
    hung = [p for p in pids if p not in status]
    for p in hung:
        os.kill(p, signal.SIGKILL)
        os.waitpid(p, 0)
    return status, hung
"""

# 20 children forked while two threads of the parent write fsync-ed events as fast as they can
# (no torch math anywhere: only fusionguard's own writer). Before the at-fork handlers, a child
# could inherit a lock held by a writer thread and hang in its first event.
UNDER_LOAD = (
    WAIT
    + """
import json, sys, threading
import fusionguard
from fusionguard.core.state import STATE
fusionguard.enable(log_path=sys.argv[1] + os.sep)
stop = threading.Event()
def writer(n):
    while not stop.is_set():
        STATE.log.emit("warning", "probe", writer=n)
threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(2)]
for t in threads:
    t.start()
time.sleep(0.2)
children = []
for i in range(20):
    pid = os.fork()
    if pid == 0:
        try:
            for j in range(5):
                STATE.log.emit("warning", "child_probe", i=i, j=j)
        finally:
            os._exit(0)
    children.append(pid)
    time.sleep(0.01)
status, hung = wait_children(children, 30)
stop.set()
for t in threads:
    t.join(5)
fusionguard.disable()
print(json.dumps({"parent": os.getpid(), "status": status, "hung": hung}))
"""
)

# Dense calls before the fork (some counted, not yet written), then a child that makes its own
# calls and ends with os._exit 1.5 s later (as DataLoader workers do), then the parent again.
COUNTS = (
    WAIT
    + """
import json, sys, warnings
import torch
torch.set_num_threads(1)
import fusionguard
from torch.nn.attention.flex_attention import flex_attention
warnings.simplefilter("ignore")
fusionguard.enable(log_path=sys.argv[1], dense_first=2)
q = torch.randn(1, 2, 16, 8)
for _ in range(5):
    flex_attention(q, q, q)
pid = os.fork()
if pid == 0:
    try:
        for _ in range(7):
            flex_attention(q, q, q)
        time.sleep(1.5)
    finally:
        os._exit(0)
status, hung = wait_children([pid], 60)
for _ in range(4):
    flex_attention(q, q, q)
fusionguard.disable()
print(json.dumps({"parent": os.getpid(), "child": pid, "status": status, "hung": hung}))
"""
)


def _start(code, tmp_path, name, arg):
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(code))
    return forkserver.popen(
        [PY, str(script), str(arg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=tmp_path
    )


def _finish(proc, timeout=180):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"scenario did not finish in {timeout} s: {err[-2000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _dense_total(events):
    return sum(1 for e in events if e["event"] == "flex_call") + sum(e["count"] for e in events if e["event"] == "dense_calls")


def test_children_forked_while_threads_write_never_hang_and_log_to_their_own_files(tmp_path):
    logs = tmp_path / "logs"
    r = _finish(_start(UNDER_LOAD, tmp_path, "under_load", logs))
    assert r["hung"] == [], f"{len(r['hung'])} of 20 forked children hung in fusionguard's writer"
    assert sorted(r["status"].values()) == [0] * 20
    parent = r["parent"]
    parent_events = read_jsonl(logs / f"fusionguard.rank0.pid{parent}.jsonl")
    assert {e["pid"] for e in parent_events} == {parent}, "no child wrote into the parent's file"
    assert not [e for e in parent_events if e["event"] == "child_probe"]
    for child in map(int, r["status"]):
        events = read_jsonl(logs / f"fusionguard.rank0.pid{child}.jsonl")
        assert {e["pid"] for e in events} == {child}
        header = events[0]
        assert header["event"] == "header" and header["forked_from"] == parent
        assert [e["j"] for e in events if e["event"] == "child_probe"] == [0, 1, 2, 3, 4]
        assert not [e for e in events if e["event"] == "probe"], "the parent's events are not the child's"


@pytest.mark.parametrize("mode", ["directory", "file"])
def test_forked_child_counts_are_its_own_and_survive_os_exit(tmp_path, mode, capsys):
    target = tmp_path / "logs" if mode == "directory" else tmp_path / "fg.jsonl"
    arg = str(target) + os.sep if mode == "directory" else str(target)
    r = _finish(_start(COUNTS, tmp_path, "counts", arg))
    assert r["hung"] == [] and list(r["status"].values()) == [0]
    parent, child = r["parent"], r["child"]
    if mode == "directory":
        events = read_jsonl(target / f"fusionguard.rank0.pid{parent}.jsonl") + read_jsonl(target / f"fusionguard.rank0.pid{child}.jsonl")
    else:
        events = read_jsonl(target)
    mine = {pid: [e for e in events if e["pid"] == pid] for pid in (parent, child)}
    assert _dense_total(mine[parent]) == 5 + 4, "the parent's calls, each counted once"
    assert _dense_total(mine[child]) == 7, "the child's own calls only, written before os._exit"
    headers = {pid: [e for e in evs if e["event"] == "header"] for pid, evs in mine.items()}
    assert len(headers[child]) == 1 and headers[child][0]["forked_from"] == parent
    crash_files = {pid: h[0]["crash_file"] for pid, h in headers.items()}
    assert f"pid{child}" in crash_files[child] and crash_files[child] != crash_files[parent]
    assert not any(e["event"] == "shutdown" for e in mine[child]), "os._exit: no exit handlers ran"
    rc, out, _ = run_cli(capsys, target, "--format", "json")
    assert rc == 0
    assert json.loads(out)["totals"]["dense_calls"] == 16
    rc, out, _ = run_cli(capsys, target)
    assert f"forked from pid {parent}: a worker that ended with os._exit, or killed" in out


# A real DataLoader (fork, 2 workers) whose dataset calls FlexAttention: the workers end with
# os._exit after multiprocessing's _exit_function; their counts and a shutdown are in the log.
DATALOADER = """
import json, os, sys, warnings
import torch
torch.set_num_threads(1)
import fusionguard
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.data import DataLoader, Dataset
warnings.simplefilter("ignore")

class Attn(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        q = torch.randn(1, 2, 16, 8)
        return flex_attention(q, q, q).sum()

fusionguard.enable(log_path=sys.argv[1], dense_first=1, flush_interval=0)
loader = DataLoader(Attn(), batch_size=2, num_workers=2, multiprocessing_context="fork")
assert len(list(loader)) == 4
del loader
fusionguard.disable()
print(json.dumps({"parent": os.getpid()}))
"""


def test_dataloader_fork_workers_end_with_a_shutdown_and_all_their_counts(tmp_path, capsys):
    target = tmp_path / "logs"
    r = _finish(_start(DATALOADER, tmp_path, "loader", str(target) + os.sep))
    rc, out, _ = run_cli(capsys, target, "--format", "json")
    rep = json.loads(out)
    assert rc == 0 and rep["totals"]["dense_calls"] == 8, "every worker call counted (flush_interval=0: only the exit writes them)"
    workers = [e for e in rep["endings"] if e["pid"] != r["parent"]]
    assert len(workers) == 2 and {e["ending"] for e in rep["endings"]} == {"exit", "disable"}, rep["endings"]
    assert not list(target.glob("*.crash")), "no crash: each worker removed its empty crash file"
