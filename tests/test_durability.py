"""Bounded loss of counts: every call that finished ``flush_interval`` (0.5 s) before a process
was killed is in its log. Real subprocesses, real SIGKILL and ``os._exit``, then ``fusionguard
report`` on what is left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
from conftest import child_env, qkv, read_jsonl, run_cli
from torch.nn.attention.flex_attention import flex_attention

import fusionguard

PY = sys.executable
N = 37  # dense calls; dense_first=3: 3 written in full, 34 only counted until the flusher writes them

SCRIPT = """
import os, signal, sys, time, warnings
import torch
import fusionguard
from fusionguard.core.state import STATE
from torch.nn.attention.flex_attention import flex_attention
warnings.simplefilter("ignore")
fusionguard.enable(log_path=sys.argv[1], dense_first=3)
q = torch.randn(1, 2, 16, 8)
for _ in range(%(n)d):
    flex_attention(q, q, q)
for _ in range(%(n)d):  # graph runs of a compiled FlexAttention graph, as inductor.py counts them
    STATE.log.emit_fields("info", "flex_run", {"layer": None, "phase": "forward", "path": "fused", "template": "cpp", "flex_calls": 2})
time.sleep(1.5)
if sys.argv[2] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(0)
"""


def test_calls_before_a_pause_survive_sigkill_and_os_exit(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(SCRIPT % {"n": N}))
    procs = {
        how: forkserver.popen([PY, str(script), str(tmp_path / f"{how}.jsonl"), how], stderr=subprocess.PIPE, text=True, env=child_env())
        for how in ("sigkill", "os_exit")
    }
    for how, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"{how}: no end in 180 s")
        assert proc.returncode == (-signal.SIGKILL if how == "sigkill" else 0), err[-2000:]
        log = tmp_path / f"{how}.jsonl"
        events = read_jsonl(log)
        assert not any(e["event"] == "shutdown" for e in events), "killed: no exit handler ran"
        counters = [e for e in events if e["event"] in ("dense_calls", "fused_calls")]
        assert counters and all(e["level"] in ("warning", "info") for e in counters)
        rc, out, _ = run_cli(capsys, log, "--format", "json")
        rep = json.loads(out)
        assert rep["totals"]["dense_calls"] == N, how
        assert rep["totals"]["fused_calls"] == 2 * N, how
        assert [e["ending"] for e in rep["endings"]] == ["stopped"]


def test_the_flusher_sleeps_while_nothing_is_pending(guard):
    log = guard(dense_first=2, flush_interval=0.2)
    q, k, v = qkv()
    for _ in range(9):
        flex_attention(q, k, v)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        counted = sum(e["count"] for e in read_jsonl(log) if e["event"] == "dense_calls")
        if counted == 7:
            break
        time.sleep(0.05)
    assert counted == 7, "the 7 counted calls were written without any exit or disable()"
    lines = len(read_jsonl(log))
    time.sleep(0.6)
    assert len(read_jsonl(log)) == lines, "nothing pending: nothing written"
    from fusionguard.core.state import STATE

    assert not STATE.log.sampler.pending
    fusionguard.disable()
    assert STATE.flusher._thread is None, "disable() stops the flusher"


def test_flush_interval_zero_keeps_counters_at_every_n_calls(guard):
    log = guard(dense_first=1, dense_every=4, flush_interval=0)
    q, k, v = qkv()
    for _ in range(10):
        flex_attention(q, k, v)
    time.sleep(0.3)
    assert [e["count"] for e in read_jsonl(log) if e["event"] == "dense_calls"] == [4, 4]
    fusionguard.disable()
    assert [e["count"] for e in read_jsonl(log) if e["event"] == "dense_calls"] == [4, 4, 1]


def test_flush_interval_is_validated():
    for bad in (-1, "1", True, 10_000):
        with pytest.raises(ValueError):
            fusionguard.enable(log_path=False, flush_interval=bad)
    assert not fusionguard.is_enabled()
