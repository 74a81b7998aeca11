"""fusionguard's logging surfaces: its own structlog pipeline (JSON lines byte for byte as
before, nothing shared with a host's structlog), the standard ``fusionguard`` logger for the
human messages, and ``TORCH_LOGS=fusionguard``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import fusionguard
from fusionguard import log as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Today's lines for a fixed event, byte for byte (written by the pipeline before it was a
# structlog bound logger: the hand-run processor chain of fusionguard 0.1.0).
GOLDEN = (
    '{"event":"flex_call","level":"warning","ts":1764582000.125,"seq":1,"phase":"forward","path":"dense",'
    '"q_shape":[1,2,16,8],"evidence":{"how":"é ü","set":[3]},"dtype":null,"size":[1,2],"scores_bytes":2048,'
    '"ratio":0.5,"pid":7,"rank":0,"thread":"MainThread"}\n'
    '{"event":"internal_error","level":"error","ts":1764582000.125,"seq":2,"where":"w","pid":7,"rank":0,"thread":"T"}\n'
    '{"event":"header","level":"info","ts":1764582000.125,"seq":3,"schema":1,"pid":7,"rank":0,"thread":"T"}\n'
)


def test_json_lines_are_byte_identical_on_a_fixed_event(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "time", types.SimpleNamespace(time=lambda: 1764582000.125))
    path = tmp_path / "x.jsonl"
    log = L.EventLog()
    log.open(str(path), fsync=False)
    returned = log.emit(
        "warning", "flex_call", phase="forward", path="dense", q_shape=[1, 2, 16, 8], evidence={"how": "é ü", "set": {3}},
        dtype=None, size=(1, 2), scores_bytes=2048, ratio=0.5, pid=7, rank=0, thread="MainThread", seq=99,
    )
    log.emit_fields("error", "internal_error", {"level": "x", "where": "w", "pid": 7, "rank": 0, "thread": "T"})
    log.emit("info", "header", schema=1, pid=7, rank=0, thread="T")
    log.close()
    assert path.read_bytes() == GOLDEN.encode("utf-8")
    assert returned is log.memory[0] and returned["seq"] == 1, "emit() returns the event kept in memory"
    assert json.loads(log._header_copy() or "{}")["rotated"] is True


HOST = r"""
import io, json, sys, warnings
import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars, get_contextvars, merge_contextvars
import torch
from torch.nn.attention.flex_attention import flex_attention
import fusionguard

out = io.StringIO()
structlog.configure(processors=[merge_contextvars, structlog.processors.JSONRenderer()],
                    logger_factory=structlog.PrintLoggerFactory(out), cache_logger_on_first_use=False)
bind_contextvars(request_id="r1", api_token="hf_secret")
host = structlog.get_logger()
warnings.simplefilter("ignore")
fusionguard.enable(log_path=sys.argv[1])
q = torch.randn(1, 2, 16, 8)
flex_attention(q, q, q)
host.info("host_event", step=1)
ours_kept = get_contextvars()
clear_contextvars()                  # the host wipes its context and its configuration:
structlog.reset_defaults()           # fusionguard's own pipeline goes on unchanged
flex_attention(q, q, q)
fusionguard.disable()
print(json.dumps({"host": out.getvalue().splitlines(), "context": ours_kept}))
"""


def test_a_host_structlog_setup_and_contextvars_are_not_shared(tmp_path):
    log = tmp_path / "fg.jsonl"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", HOST, str(log)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["context"] == {"request_id": "r1", "api_token": "hf_secret"}, "our events left the host's context alone"
    assert [json.loads(line) for line in result["host"]] == [{"request_id": "r1", "api_token": "hf_secret", "step": 1, "event": "host_event"}]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    text = log.read_text()
    assert "request_id" not in text and "hf_secret" not in text, "the host's bound context is not in our log"
    assert [e["event"] for e in events if e["event"] in ("flex_call", "dense_calls")] == ["flex_call", "flex_call"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), "one pipeline, before and after the host's reset"
