"""fusionguard's logging surfaces: its own structlog pipeline (JSON lines byte for byte as
before, nothing shared with a host's structlog), the standard ``fusionguard`` logger for the
human messages, and ``TORCH_LOGS=fusionguard``."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import torch_internals as ti
from fusionguard.core import state as _state
from fusionguard.eventlog import log as L

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
    monkeypatch.setattr(time, "time", lambda: 1764582000.125)  # the clock structlog's TimeStamper reads
    path = tmp_path / "x.jsonl"
    log = L.EventLog()
    log.open(str(path), fsync=False)
    returned = log.emit(
        "warning",
        "flex_call",
        phase="forward",
        path="dense",
        q_shape=[1, 2, 16, 8],
        evidence={"how": "é ü", "set": {3}},
        dtype=None,
        size=(1, 2),
        scores_bytes=2048,
        ratio=0.5,
        pid=7,
        rank=0,
        thread="MainThread",
        seq=99,
    )
    log.emit_fields("error", "internal_error", {"level": "x", "where": "w", "pid": 7, "rank": 0, "thread": "T"})
    log.emit("info", "header", schema=1, pid=7, rank=0, thread="T")
    log.close()
    assert path.read_bytes() == GOLDEN.encode("utf-8")
    assert returned is log.memory[0] and returned["seq"] == 1, "emit() returns the event kept in memory"
    assert json.loads(log.header_copy() or "{}")["rotated"] is True


HOST = r"""
import io, json, sys, warnings
import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars, merge_contextvars
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
ours_kept = merge_contextvars(None, None, {})  # the host's context (get_contextvars is 21.2+; setup.cfg: structlog>=21.1)
clear_contextvars()                  # the host wipes its context and its configuration:
structlog.reset_defaults()           # fusionguard's own pipeline goes on unchanged
flex_attention(q, q, q)
fusionguard.disable()
print(json.dumps({"host": out.getvalue().splitlines(), "context": ours_kept}))
"""


def test_a_host_structlog_setup_and_contextvars_are_not_shared(tmp_path):
    log = tmp_path / "fg.jsonl"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = forkserver.run([sys.executable, "-c", HOST, str(log)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["context"] == {"request_id": "r1", "api_token": "hf_secret"}, "our events left the host's context alone"
    assert [json.loads(line) for line in result["host"]] == [
        {"request_id": "r1", "api_token": "hf_secret", "step": 1, "event": "host_event"}
    ]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    text = log.read_text()
    assert "request_id" not in text and "hf_secret" not in text, "the host's bound context is not in our log"
    assert [e["event"] for e in events if e["event"] in ("flex_call", "dense_calls")] == ["flex_call", "flex_call"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), "one pipeline, before and after the host's reset"


# -- logging.getLogger("fusionguard"): the human messages ------------------------------------------


@pytest.fixture
def fg_logger():
    """The ``fusionguard`` logger, put back as it was (level, propagation, handlers)."""
    logger = logging.getLogger("fusionguard")
    saved = (logger.level, logger.propagate, list(logger.handlers))
    yield logger
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _announce(path) -> str:
    return (
        f"fusionguard: logging FlexAttention verdicts to {path} "
        "(FUSIONGUARD_LOG or enable(log_path=...) to change, log_path=False for none)\n"
    )


def _lacks() -> list:
    """The one-line notices of what this torch release lacks (``enable()`` prints them first:
    rescue before 2.11, say), so the expected output holds on every release."""
    return [f"fusionguard: {why}" for why in _state.STATE.not_patched.values() if " is unavailable on torch " in why]


def _internal(where: str) -> str:
    return f"fusionguard: internal error in {where} (ignored; PyTorch runs unchanged): ValueError: boom\n"


def test_unconfigured_stderr_is_byte_identical(guard, fg_logger, capsys):
    log = guard()
    _state.internal_error("a test", ValueError("boom"))
    assert capsys.readouterr().err == "".join(f"{line}\n" for line in _lacks()) + _announce(log) + _internal("a test")
    assert fg_logger.propagate is False and fg_logger.getEffectiveLevel() == logging.INFO


def test_silenced_by_level_the_usual_way(guard, fg_logger, capsys):
    fg_logger.setLevel(logging.ERROR)
    guard()
    _state.internal_error("a test", ValueError("boom"))
    assert capsys.readouterr().err == _internal("a test"), "INFO gone, ERROR kept"


def test_a_handler_of_the_user_takes_the_messages_off_stderr(guard, fg_logger, capsys):
    mine = Collect()
    fg_logger.addHandler(mine)
    log = guard()
    q = torch.randn(1, 2, 16, 8)
    with pytest.warns(fusionguard.DenseFallbackWarning) as caught:
        flex_attention(q, q, q)
    _state.internal_error("a test", ValueError("boom"))
    assert capsys.readouterr().err == "", "ours steps aside for the user's handler"
    got = [(r.levelno, r.getMessage()) for r in mine.records if r.levelno >= logging.INFO and r.getMessage() not in _lacks()]
    assert got[0] == (logging.INFO, _announce(log).rstrip("\n"))
    warned = [str(w.message) for w in caught if w.category is fusionguard.DenseFallbackWarning]
    assert got[1] == (logging.WARNING, warned[0]), "the logged dense call's text, as warned"
    assert got[2] == (logging.ERROR, _internal("a test").rstrip("\n"))


def test_propagate_hands_them_to_the_root_logger(guard, fg_logger, capsys):
    root, theirs = logging.getLogger(), Collect()
    root.addHandler(theirs)
    fg_logger.propagate = True
    try:
        log = guard()
    finally:
        root.removeHandler(theirs)
    assert capsys.readouterr().err == ""
    assert [r.getMessage() for r in theirs.records if r.name == "fusionguard" and r.getMessage() not in _lacks()] == [
        _announce(log).rstrip("\n")
    ]


def test_every_event_at_debug(guard, fg_logger):
    mine = Collect()
    fg_logger.addHandler(mine)
    fg_logger.setLevel(logging.DEBUG)
    guard()
    debug = [r.getMessage() for r in mine.records if r.levelno == logging.DEBUG]
    assert debug and debug[0].startswith('fusionguard event: {"event":"header"')


def test_registered_with_torch_logging_while_enabled(guard, fg_logger):
    if "fusionguard" in os.environ.get("TORCH_LOGS", ""):
        pytest.skip("TORCH_LOGS named fusionguard when torch was imported: torch registered it itself")
    assert not ti.torch_log_registered("fusionguard"), "registered before enable(): an earlier test in this process left it"
    guard()
    assert ti.torch_log_registered("fusionguard")
    fusionguard.disable()
    assert not ti.torch_log_registered("fusionguard"), "disable() undoes the registration"


TORCH_LOGS_RUN = r"""
import json, logging, sys, warnings
import torch
import fusionguard
from torch.nn.attention.flex_attention import flex_attention
warnings.simplefilter("ignore")
fusionguard.enable(log_path=sys.argv[1])
flex_attention(*[torch.randn(1, 2, 16, 8)] * 3)
level = logging.getLogger("fusionguard").getEffectiveLevel()
if len(sys.argv) > 2:  # (TORCH_LOGS unset: set_logs ignores calls while it is set)
    torch._logging.set_logs(modules={"fusionguard": int(sys.argv[2])})
    flex_attention(*[torch.randn(1, 2, 16, 8)] * 3)
    level = logging.getLogger("fusionguard").getEffectiveLevel()
fusionguard.disable()
logger = logging.getLogger("fusionguard")
print(json.dumps([level, [type(h).__name__ for h in logger.handlers], logger.level, logger.propagate]))
"""


@pytest.mark.parametrize(
    "setting, level",
    [("+fusionguard", logging.DEBUG), ("fusionguard", logging.INFO), ("-fusionguard", logging.ERROR), ("set_logs", logging.DEBUG)],
)
def test_torch_logs_sets_our_level(tmp_path, setting, level):
    """``TORCH_LOGS`` (or ``set_logs``, for a registered component) sets the level and puts
    PyTorch's handler and format on our logger, as for PyTorch's own components."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    args = [sys.executable, "-c", TORCH_LOGS_RUN, str(tmp_path / "fg.jsonl")]
    if setting == "set_logs":
        args.append(str(level))
    else:
        env["TORCH_LOGS"] = setting
    proc = forkserver.run(
        args, capture_output=True, text=True, env=env, timeout=300
    )  # (TORCH_LOGS set: a real subprocess, forkserver.why_not)
    assert proc.returncode == 0, proc.stderr
    level_seen, handlers, level_after, propagate = json.loads(proc.stdout.splitlines()[-1])
    assert level_seen == level
    if setting == "set_logs":  # disable() undid what torch._logging did to a registered logger
        assert (handlers, level_after, propagate) == (["_StderrHandler"], logging.INFO, False)
    announce = [line for line in proc.stderr.splitlines() if "fusionguard: logging FlexAttention verdicts" in line]
    if setting == "set_logs":  # enabled before set_logs: the announcement was ours, as always
        assert announce == [_announce(tmp_path / "fg.jsonl").rstrip("\n")], proc.stderr
        assert "] fusionguard event: " in proc.stderr and "] fusionguard: dense FlexAttention forward" in proc.stderr
    elif level <= logging.INFO:  # in PyTorch's format: "I1201 08:00:00.000000 123 fusionguard/_lifecycle.py:31] fusionguard: ..."
        assert len(announce) == 1 and announce[0].startswith("I") and "] fusionguard: logging" in announce[0], proc.stderr
        assert ("fusionguard event: " in proc.stderr) == (level == logging.DEBUG)
        assert "] fusionguard: dense FlexAttention forward is materialising" in proc.stderr, "the logged dense call's text"
    else:
        assert announce == [] and "fusionguard event" not in proc.stderr


def test_a_logger_configured_before_the_import_stays_as_configured(tmp_path):
    code = (
        "import logging, sys\n"
        "logging.getLogger('fusionguard').setLevel(logging.ERROR)\n"
        "import fusionguard\n"
        "fusionguard.enable(log_path=sys.argv[1])\n"
        "lg = logging.getLogger('fusionguard')\n"
        "print(lg.level, lg.propagate)\n"
        "fusionguard.disable()\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_LOGS", None)
    proc = forkserver.run([sys.executable, "-c", code, str(tmp_path / "fg.jsonl")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(logging.ERROR), "True"] and "fusionguard: logging" not in proc.stderr
