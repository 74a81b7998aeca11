"""SIGTERM while the main thread is inside a log write, and a dense call in the window before the
process dies (docs/guarantees.md, "SIGTERM during a log write"): the ``shutdown`` event's counts
are exactly the ``flex_call`` events of the log, every time; strict mode still blocks there.

Deterministic, not by load: a real subprocess, real eager FlexAttention calls on CPU, a real
SIGTERM from this process. The test seam is in the child script only: a wrapper around its own
log file's ``write`` holds the main thread inside the write of its 5th ``flex_call`` event (the
log's lock held, as in every write) and says so; the test sends SIGTERM then. The handler cannot
write ``shutdown`` under that lock, so it hands the write to a helper thread and returns after
its 1 s wait; the main thread, still inside the write, then makes one more dense call: the
window. Before the fix the helper had read the counts (5) before it waited, and that call was
counted and logged (6 ``flex_call`` events, ``dense_forward: 5``), in 10 runs of 10.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
from conftest import child_env, read_jsonl

CHILD = """
import json, sys, time, warnings
import torch
import fusionguard
from fusionguard.core.state import STATE
from fusionguard.errors import DenseFallbackError
from fusionguard.eventlog import crash
from torch.nn.attention.flex_attention import flex_attention

warnings.simplefilter("ignore")
LOG, STRICT = sys.argv[1], sys.argv[2] == "strict"
fusionguard.enable(log_path=LOG, strict=STRICT, dense_first=1000)  # every call written in full
q = torch.randn(1, 2, 16, 8)


def call():
    try:
        flex_attention(q, q, q)
        return "ran"
    except DenseFallbackError as exc:
        return "blocked: " + str(exc)


sink = STATE.log.sink
real_write = sink.write
written = []


def write(line, durable):
    real_write(line, durable)
    if '"event":"flex_call"' in line:
        written.append(line)
        if len(written) == 5:
            in_the_window()


def in_the_window():
    print("in-write", flush=True)  # the test sends SIGTERM now
    deadline = time.monotonic() + 60
    while crash.CRASH.sigterm_state != "pending" and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs in here, hands the write over, returns after 1 s
    window = {"state": crash.CRASH.sigterm_state, "before": dict(STATE.counts)}
    window["call"] = call()  # SIGTERM pending, its shutdown event not written yet
    window["after"] = dict(STATE.counts)
    print(json.dumps(window), flush=True)


sink.write = write
for _ in range(5):
    call()
time.sleep(30)  # the write is over: the helper writes shutdown and delivers SIGTERM again
print("not reached", flush=True)
"""


@pytest.mark.parametrize("mode", ["warn", "strict"])
def test_sigterm_during_a_log_write_counts_match_the_events(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    log = tmp_path / f"{mode}.jsonl"
    proc = forkserver.popen(
        [sys.executable, str(script), str(log), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(OMP_NUM_THREADS="1"),
    )
    try:
        assert proc.stdout.readline().strip() == "in-write", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert "not reached" not in out
    window = json.loads(out.strip().splitlines()[0])
    assert window["state"] == "pending"
    events = read_jsonl(log)  # every line parses: nothing torn
    shutdowns = [e for e in events if e["event"] == "shutdown"]
    assert [e["reason"] for e in shutdowns] == ["sigterm"] and events[-1] is shutdowns[0]
    calls = [e for e in events if e["event"] == "flex_call"]
    assert not any(e["event"] == "dense_calls" for e in events)  # (dense_first=1000: each call in full)
    assert shutdowns[0]["counts"] == {"dense_forward": len(calls)} == {"dense_forward": 5}
    # the call in the window is neither counted nor logged; strict mode blocks it all the same
    assert window["after"] == window["before"] == {"dense_forward": 5}
    if mode == "strict":
        assert window["call"].startswith("blocked: fusionguard: dense FlexAttention forward blocked before it allocated (strict mode)")
        assert all(e["action"] == "raise" for e in calls)
    else:
        assert window["call"] == "ran" and all(e["action"] == "warn" for e in calls)
