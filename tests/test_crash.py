"""Crash records: real uncaught exceptions, a real allocation failure inside a dense FlexAttention
kernel, SIGTERM and SIGKILL, each in a subprocess; then ``fusionguard report`` on what is left.

The subprocesses that need torch start together (module fixture) so the file runs in seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import traceback
from pathlib import Path

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
from conftest import ROOT, child_env, read_jsonl, run_cli

from fusionguard import _testing
from fusionguard.eventlog import crash, diagnosis
from fusionguard.report import crashfile

PY = sys.executable

# enable() installs the crash records (sys/threading excepthooks, SIGTERM).
PRELUDE = """
import sys, os, time, warnings
import torch
import fusionguard
from fusionguard import _testing
from fusionguard.core.state import STATE
from torch.nn.attention.flex_attention import flex_attention
warnings.simplefilter("ignore")
LOG = sys.argv[1]
fusionguard.enable(log_path=LOG)
assert _testing.crash_hooks_installed()
q = torch.randn(1, 2, 16, 8)
"""

SCRIPTS = {
    # 1. in a worker thread, a real allocation failure inside PyTorch's dense kernel: q/k/v are
    #    16 MB, the fp32 score matrix 1 x 1 x 2^19 x 2^19 would be 1.1 TB; the CPU allocator
    #    refuses it at once. 2. in the main thread, torch.OutOfMemoryError raised by the program
    #    right after a real dense call. A custom excepthook set before fusionguard still runs.
    "oom": """
import sys
def mine(t, e, tb):
    sys.stderr.write("MY-HOOK-RAN " + t.__name__ + "\\n")
sys.excepthook = mine
"""
    + PRELUDE
    + """
import threading
def attention_worker():
    big = torch.randn(1, 1, 2 ** 19, 8)
    flex_attention(big, big, big)
t = threading.Thread(target=attention_worker, name="attn-worker")
t.start(); t.join()
flex_attention(q, q, q)
raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.70 GiB")
""",
    "sigterm": PRELUDE
    + """
for i in range(100000):
    flex_attention(q, q, q)
    if i == 5:
        print("ready", flush=True)
""",
    "sigkill": PRELUDE
    + """
for i in range(100000):
    flex_attention(q, q, q)
    if i == 5:
        print("ready", flush=True)
""",
    # a native crash: a real SIGSEGV (faulthandler's own test helper) right after a dense call
    "segv": PRELUDE
    + """
flex_attention(q, q, q)
import faulthandler
faulthandler._sigsegv()
""",
    # faulthandler is ours while enabled, an entry of the undo registry, given back (off) by
    # disable(); the unused file goes
    "native_off": PRELUDE
    + """
import faulthandler, json
def entries():
    return [e for e in STATE.patches.entries() if e.name == "faulthandler: crash file"]
on = faulthandler.is_enabled()
(first,) = entries()
flex_attention(q, q, q)
fusionguard.enable(log_path=LOG + ".2.jsonl")  # a new log: a crash file of its own, one entry
(second,) = entries()
out = {"on": on, "restored": [first.restored(), second.restored()]}
fusionguard.disable()
out.update(after=faulthandler.is_enabled(), restored_after=[first.restored(), second.restored()],
           left=[e.name for e in STATE.patches.entries()])
print(json.dumps(out))
""",
}


class Runs:
    """The torch subprocesses, started together when the module starts (they run while the
    fast tests do); the looping ones get their signal from a helper thread once "ready"."""

    def __init__(self, base):
        self.procs, self.results, self.threads = {}, {}, {}
        for name, code in SCRIPTS.items():
            script = base / f"{name}.py"
            script.write_text(textwrap.dedent(code))
            log = base / f"{name}.jsonl"
            proc = forkserver.popen(
                [PY, str(script), str(log)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=base
            )
            self.procs[name] = (proc, log)
        for name, sig in (("sigterm", signal.SIGTERM), ("sigkill", signal.SIGKILL)):
            t = threading.Thread(target=self._signal_when_ready, args=(name, sig), daemon=True)
            t.start()
            self.threads[name] = t

    def _signal_when_ready(self, name, sig):
        proc, _ = self.procs[name]
        self.results.setdefault(name, {})["ready"] = proc.stdout.readline().strip()
        if proc.poll() is None:
            proc.send_signal(sig)

    def get(self, name):
        proc, log = self.procs[name]
        if name in self.threads:
            self.threads[name].join(timeout=120)
        out, err = proc.communicate(timeout=120)
        r = self.results.setdefault(name, {})
        r.update(rc=proc.returncode, out=out, err=err, log=log)
        return r

    def close(self):
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module", autouse=True)
def runs(tmp_path_factory):
    r = Runs(tmp_path_factory.mktemp("crash"))
    yield r
    r.close()


# -- crash-only subprocesses (no torch: fast) ---------------------------------------------------

# crash.py imports nothing that imports torch: loaded from its file (its own copy of the hooks,
# not the package's), these subprocesses start in a fraction of a second.
_EMIT_TO_FILE = """
import importlib.util, json, os, sys, threading, types
pkg = types.ModuleType("fg_nopkg")  # a parent for this copy of crash.py
pkg.__path__ = [os.path.dirname(sys.argv[2])]
sys.modules["fg_nopkg"] = pkg
spec = importlib.util.spec_from_file_location("fg_nopkg.crash", sys.argv[2])
crash = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crash)
assert "torch" not in sys.modules
LOG = sys.argv[1]
def emit(level, event, **fields):
    fields.setdefault("thread", threading.current_thread().name)
    with open(LOG, "a") as fh:
        fh.write(json.dumps({"event": event, "level": level, **fields}, default=str) + "\\n")
"""


def _run(code, tmp_path, timeout=30):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(code))
    log = tmp_path / "log.jsonl"
    p = subprocess.run([PY, str(script), str(log), crash.__file__], capture_output=True, text=True, env=child_env(), timeout=timeout)
    return p, (read_jsonl(log) if log.exists() else [])


def test_worker_thread_exception_is_recorded_and_chained(tmp_path):
    p, events = _run(
        _EMIT_TO_FILE
        + """
def theirs(args):
    sys.stderr.write("THEIR-THREAD-HOOK " + args.thread.name + "\\n")
threading.excepthook = theirs
crash.install(emit, last_flex_event=lambda: {"event": "flex_call", "path": "fused", "phase": "backward", "layer": "layers.3"})
def work():
    raise KeyError("boom")
t = threading.Thread(target=work, name="loader-7")
t.start(); t.join()
print("main goes on")
""",
        tmp_path,
    )
    assert p.returncode == 0 and "main goes on" in p.stdout
    assert "THEIR-THREAD-HOOK loader-7" in p.stderr
    (event,) = events
    assert event["event"] == "crash" and event["where"] == "threading.excepthook"
    assert event["thread"] == "loader-7" and event["exc_type"] == "KeyError" and event["message"] == "'boom'"
    assert event["diagnosis"] == "KeyError outside FlexAttention; last FlexAttention event: fused backward of layers.3"
    assert any("in work" in f for f in event["frames"])


def test_main_thread_exception_default_hook_still_prints(tmp_path):
    p, events = _run(_EMIT_TO_FILE + "crash.install(emit)\nraise ValueError('bad shape')\n", tmp_path)
    assert p.returncode == 1
    assert "ValueError: bad shape" in p.stderr and "Traceback" in p.stderr
    (event,) = events
    assert event["exc_type"] == "ValueError" and event["last_flex"] is None
    assert event["diagnosis"] == "ValueError; no FlexAttention event was recorded before it"


def test_sigterm_hands_over_to_a_previous_python_handler(tmp_path):
    p, events = _run(
        _EMIT_TO_FILE
        + """
import os, signal, time
def theirs(signum, frame):
    print("THEIR-HANDLER", signum, flush=True)
    raise SystemExit(7)
signal.signal(signal.SIGTERM, theirs)
crash.install(emit, summary=lambda: {"counts": {"dense_forward": 3}})
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
""",
        tmp_path,
    )
    assert p.returncode == 7 and "THEIR-HANDLER 15" in p.stdout
    (event,) = events
    assert event["event"] == "shutdown" and event["reason"] == "sigterm" and event["counts"] == {"dense_forward": 3}


def test_ignored_sigterm_is_left_alone(tmp_path):
    p, events = _run(
        _EMIT_TO_FILE
        + """
import os, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
crash.install(emit)
assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
os.kill(os.getpid(), signal.SIGTERM)
print("still here")
""",
        tmp_path,
    )
    assert p.returncode == 0 and "still here" in p.stdout and events == []


# -- in-process: exact restoration ----------------------------------------------------------------


@pytest.fixture
def clean_hooks():
    saved = (sys.excepthook, threading.excepthook, signal.getsignal(signal.SIGTERM))
    yield
    crash.uninstall()
    sys.excepthook, threading.excepthook = saved[0], saved[1]
    signal.signal(signal.SIGTERM, saved[2])


def test_uninstall_restores_the_exact_previous_hooks(clean_hooks):
    def my_hook(*a):
        pass

    def my_thread_hook(args):
        pass

    def my_handler(signum, frame):
        pass

    sys.excepthook, threading.excepthook = my_hook, my_thread_hook
    signal.signal(signal.SIGTERM, my_handler)
    events = []
    crash.install(lambda level, event, **f: events.append(event))
    crash.install(lambda level, event, **f: events.append(event))  # twice: never chains to itself
    assert sys.excepthook is crash._sys_hook and threading.excepthook is crash._thread_hook
    assert signal.getsignal(signal.SIGTERM) is crash._on_sigterm
    assert crash.CRASH.prev_sys is my_hook and crash.CRASH.prev_threading is my_thread_hook
    crash.uninstall()
    assert sys.excepthook is my_hook and threading.excepthook is my_thread_hook
    assert signal.getsignal(signal.SIGTERM) is my_handler
    assert not _testing.crash_hooks_installed()


def test_ours_put_back_by_a_trainer_after_disable_never_breaks_the_next_disable(tmp_path):
    """Lightning saves the SIGTERM handler at fit start (ours) and puts it back at teardown, after
    the callback's disable() restored the previous one: the next enable() finds ours installed,
    and its disable() raised TypeError (signal.signal(SIGTERM, None)) before #33."""
    import fusionguard

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        fusionguard.enable(log_path=str(tmp_path / "a.jsonl"))
        saved = signal.getsignal(signal.SIGTERM)  # the trainer's signal connector at fit start
        assert saved is crash._on_sigterm
        fusionguard.disable()
        signal.signal(signal.SIGTERM, saved)  # its teardown: ours is back
        fusionguard.enable(log_path=str(tmp_path / "b.jsonl"))
        fusionguard.disable()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
        _testing.reset_for_tests()


def test_uninstall_leaves_a_hook_installed_after_ours(clean_hooks):
    seen = []

    def later(t, e, tb):
        seen.append(t)

    crash.install(lambda level, event, **f: None)
    sys.excepthook = later  # somebody replaced ours
    crash.uninstall()
    assert sys.excepthook is later
    # ours, if still called by someone's chain, is a pass-through that writes nothing
    written = []
    crash.CRASH.emit = written.append  # type: ignore[assignment]
    try:
        raise ValueError("x")
    except ValueError as exc:
        prev = crash.CRASH.prev_sys
        crash.CRASH.prev_sys = lambda *a: seen.append("chained")
        try:
            crash._sys_hook(type(exc), exc, exc.__traceback__)
        finally:
            crash.CRASH.prev_sys = prev
            crash.CRASH.emit = None
    assert written == [] and seen == ["chained"]


def test_real_thread_exception_in_process(clean_hooks):
    events = []
    crash.install(lambda level, event, **f: events.append((level, event, f)), sigterm=False)
    prev = crash.CRASH.prev_threading
    crash.CRASH.prev_threading = lambda args: None  # keep pytest's output clean

    def work():
        [][1]

    try:
        t = threading.Thread(target=work, name="w1")
        t.start()
        t.join()
    finally:
        crash.CRASH.prev_threading = prev
    ((level, event, f),) = events
    assert (level, event, f["thread"], f["exc_type"]) == ("error", "crash", "w1", "IndexError")


def test_record_writes_a_crash_for_a_caught_exception(clean_hooks):
    events = []
    crash.install(lambda level, event, **f: events.append(f) or f, sigterm=False)
    try:
        int("x")
    except ValueError as exc:
        crash.record(exc)
    assert events[0]["where"] == "record" and events[0]["exc_type"] == "ValueError"


# -- the one-line diagnosis --------------------------------------------------------------------------


def _frames(*names):
    return [traceback.FrameSummary("/x/torch/_higher_order_ops/flex_attention.py", 1, n) for n in names]


DENSE_BWD = {
    "event": "flex_call",
    "path": "dense",
    "phase": "backward",
    "layer": "layers.17.self_attn",
    "cause": "eager_call",
    "scores_bytes": 2_700_000_000,
}


def test_diagnosis_wording():
    import torch

    oom = torch.OutOfMemoryError
    assert diagnosis.diagnose(oom, "CUDA out of memory", DENSE_BWD, _frames("sdpa_dense_backward")) == (
        "OOM inside dense backward of layers.17.self_attn; the dense score matrix is 2.70 GB in fp32"
    )
    autograd = [traceback.FrameSummary("/x/site-packages/torch/autograd/graph.py", 1, "_engine_run_backward")]
    assert diagnosis.diagnose(oom, "CUDA out of memory", DENSE_BWD, autograd) == (
        "OOM during backward, right after a dense backward of layers.17.self_attn; the dense score matrix is 2.70 GB in fp32"
    )
    fused = dict(DENSE_BWD, path="fused", cause=None)
    assert diagnosis.diagnose(oom, "x", fused, []) == (
        "OOM outside FlexAttention; last FlexAttention event: fused backward of layers.17.self_attn; the dense fallback is not the cause"
    )
    from fusionguard.errors import DenseFallbackError

    assert diagnosis.diagnose(DenseFallbackError, "x", dict(DENSE_BWD, phase="forward"), []) == (
        "strict mode blocked a dense forward of layers.17.self_attn (cause eager_call) before it allocated its 2.70 GB fp32 score matrix"
    )
    assert diagnosis.diagnose(RuntimeError, "DefaultCPUAllocator: can't allocate memory", None, []) == (
        "OOM; no FlexAttention event was recorded before it"
    )


# -- the torch subprocesses (started with the module, checked last) --------------------------------


def test_oom_inside_a_real_dense_kernel_in_a_worker_thread(runs, capsys):
    r = runs.get("oom")
    assert r["rc"] == 1, r["err"]
    assert "can't allocate memory" in r["err"], "the default threading.excepthook still printed"
    assert "MY-HOOK-RAN OutOfMemoryError" in r["err"], "the previous sys.excepthook still ran"
    events = read_jsonl(r["log"])
    first, second = [e for e in events if e["event"] == "crash"]
    assert first["level"] == "error" and first["where"] == "threading.excepthook" and first["thread"] == "attn-worker"
    assert first["exc_type"] == "RuntimeError" and "can't allocate memory" in first["message"]
    last = first["last_flex"]
    assert last["event"] == "flex_call" and last["path"] == "dense" and last["phase"] == "forward"
    assert last["cause"] == "eager_call" and last["scores_bytes"] == 2**38 * 4
    assert first["diagnosis"].startswith("OOM inside dense forward at ")
    assert "in attention_worker" in first["diagnosis"]
    assert first["diagnosis"].endswith("; the dense score matrix is 1.10 TB in fp32")
    assert any("_math_attention_inner" in f for f in first["frames"])
    assert "cuda" not in first, "no allocator figures without CUDA"

    # main thread: torch.OutOfMemoryError raised by the program after a small dense call
    assert second["where"] == "sys.excepthook" and second["thread"] == "MainThread"
    assert second["exc_type"] == "torch.OutOfMemoryError"
    assert second["message"] == "CUDA out of memory. Tried to allocate 2.70 GiB"
    assert second["last_flex"]["path"] == "dense" and second["last_flex"]["seq"] > last["seq"]
    assert second["diagnosis"].startswith("OOM outside FlexAttention; the last FlexAttention call was a dense forward at ")
    assert second["diagnosis"].endswith("the dense score matrix is 2.05 KB in fp32")
    kinds = [e["event"] for e in events]
    assert kinds.index("crash") < kinds.index("shutdown"), "normal-exit records still follow"

    rc, out, _ = run_cli(capsys, r["log"])
    assert rc == 0
    assert "ended:    crash (rank 0)" in out
    assert "CRASH rank 0" in out and "in thread attn-worker" in out
    assert "diagnosis: OOM inside dense forward" in out
    first_section = out.split("CRASH", 2)[1]
    assert "flex_call  (no layer) forward  path=dense  cause=eager_call" in first_section
    assert "scores=1.10 TB" in first_section

    rc, out, _ = run_cli(capsys, r["log"], "--format", "json")
    rep = json.loads(out)
    assert [c["crash"]["exc_type"] for c in rep["crashes"]] == ["RuntimeError", "torch.OutOfMemoryError"]
    assert [e["event"] for e in rep["crashes"][0]["last_events"]] == ["header", "flex_call"]


def test_sigterm_writes_shutdown_then_dies_of_sigterm(runs, capsys):
    r = runs.get("sigterm")
    assert r["rc"] == -signal.SIGTERM, r["err"]
    events = read_jsonl(r["log"])  # every line parses: nothing torn
    last = events[-1]
    assert last["event"] == "shutdown" and last["reason"] == "sigterm" and last["level"] == "warning"
    calls = [e for e in events if e["event"] == "flex_call"]
    assert len(calls) >= 6
    assert last["counts"]["dense_forward"] >= len(calls)
    rc, out, _ = run_cli(capsys, r["log"])
    assert rc == 0 and "ended:    sigterm (rank 0)" in out
    assert "CRASH" not in out and "STOPPED" not in out


def test_sigkill_leaves_a_readable_log_that_report_calls_stopped(runs, capsys):
    r = runs.get("sigkill")
    assert r["rc"] == -signal.SIGKILL
    raw = Path(r["log"]).read_bytes()
    events = read_jsonl(r["log"])  # one os.write per line: every line parses
    n_calls = sum(e["event"] == "flex_call" for e in events)
    counted = n_calls + sum(e["count"] for e in events if e["event"] == "dense_calls")  # by the flusher
    assert n_calls >= 6 and not any(e["event"] == "shutdown" for e in events)
    assert raw.endswith(b"\n")
    rc, out, _ = run_cli(capsys, r["log"], "--last", "4")
    assert rc == 0
    assert "STOPPED rank 0" in out and "without a shutdown event" in out
    tail = out.split("last events", 1)[1].strip().splitlines()[1:]
    assert len(tail) == 4 and all("flex_call" in line or "dense_calls" in line for line in tail)
    assert f"eager_call×{counted}" in out


def test_sigterm_while_the_main_thread_holds_the_log_lock(tmp_path):
    """The handler must not deadlock on a lock held by the code it interrupted: it defers the
    write to a helper thread, which re-delivers SIGTERM once written; then SIG_DFL ends it."""
    p, events = _run(
        _EMIT_TO_FILE
        + """
import os, signal, time
LOCK = threading.Lock()
def locked_emit(level, event, **fields):
    with LOCK:
        emit(level, event, **fields)
crash.install(locked_emit)
with LOCK:  # as if the signal arrived in the middle of writing an event
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(3):
        time.sleep(0.01)
    print("lock released", flush=True)
time.sleep(20)
print("not reached", flush=True)
""",
        tmp_path,
    )
    assert p.returncode == -signal.SIGTERM
    assert "lock released" in p.stdout and "not reached" not in p.stdout
    (event,) = events
    assert event["event"] == "shutdown" and event["reason"] == "sigterm"


def test_sigterm_shutdown_counts_are_read_under_the_write_lock(tmp_path):
    """The counts go into ``shutdown`` in the same hold of the log's lock as its write: an event
    the interrupted thread counts and writes before letting go of the lock is in them (they were
    read before the wait once, and came out one behind: docs/guarantees.md)."""
    p, events = _run(
        _EMIT_TO_FILE
        + """
import os, signal, time
LOCK = threading.RLock()  # the log's lock: re-entrant, like EventLog.write_lock
COUNTS = {"dense_forward": 0}
def locked_emit(level, event, **fields):
    with LOCK:
        emit(level, event, **fields)
crash.install(locked_emit, summary=lambda: {"counts": dict(COUNTS)}, write_lock=lambda: LOCK)
with LOCK:  # the main thread in the middle of writing an event
    os.kill(os.getpid(), signal.SIGTERM)  # the handler hands the write over, returns after 1 s
    for _ in range(3):
        time.sleep(0.01)
    COUNTS["dense_forward"] += 1  # then it counts and writes one more, still holding the lock
    locked_emit("warning", "flex_call")
time.sleep(20)
print("not reached", flush=True)
""",
        tmp_path,
    )
    assert p.returncode == -signal.SIGTERM and "not reached" not in p.stdout, p.stderr
    assert [e["event"] for e in events] == ["flex_call", "shutdown"]
    assert events[1]["counts"] == {"dense_forward": 1}


# -- native crashes -----------------------------------------------------------------------------------


def test_a_segfault_is_reported_as_a_crash_with_the_last_flex_event(runs, capsys):
    r = runs.get("segv")
    assert r["rc"] == -signal.SIGSEGV, r["err"][-2000:]
    events = read_jsonl(r["log"])
    header = events[0]
    assert header["crash_capture"] == "faulthandler"
    crash_file = Path(header["crash_file"])
    assert crash_file.parent == Path(r["log"]).parent and f"pid{header['pid']}" in crash_file.name
    assert "Segmentation fault" in crash_file.read_text()
    assert stat_mode(crash_file) == 0o600
    rc, out, _ = run_cli(capsys, r["log"], "--format", "json")
    rep = json.loads(out)
    assert [e["ending"] for e in rep["endings"]] == ["crash"]
    (c,) = rep["crashes"]
    ev = c["crash"]
    assert ev["exc_type"] == "native crash (SIGSEGV)" and ev["where"] == "faulthandler"
    assert ev["last_flex"]["event"] == "flex_call" and ev["last_flex"]["path"] == "dense"
    assert ev["diagnosis"].startswith("the process died of SIGSEGV; last FlexAttention event: dense forward at ")
    assert ev["frames"] and ev["frames"][-1].endswith("in <module>")
    rc, out, _ = run_cli(capsys, r["log"])
    assert "ended:    crash (rank 0)" in out
    assert "native crash (SIGSEGV): Fatal Python error: Segmentation fault" in out
    assert "last FlexAttention event: flex_call dense forward" in out


def test_a_crash_file_found_beside_a_moved_log(runs, capsys, tmp_path):
    r = runs.get("segv")
    moved = tmp_path / "copied"
    moved.mkdir()
    header = read_jsonl(r["log"])[0]
    (moved / "run.jsonl").write_bytes(Path(r["log"]).read_bytes())
    (moved / Path(header["crash_file"]).name).write_bytes(Path(header["crash_file"]).read_bytes())
    Path(header["crash_file"]).rename(tmp_path / "gone.crash")
    try:
        rc, out, _ = run_cli(capsys, moved / "run.jsonl", "--format", "json")
    finally:
        (tmp_path / "gone.crash").rename(header["crash_file"])
    assert [c["crash"]["exc_type"] for c in json.loads(out)["crashes"]] == ["native crash (SIGSEGV)"]


def test_faulthandler_is_given_back_and_an_empty_crash_file_removed(runs):
    r = runs.get("native_off")
    assert r["rc"] == 0, r["err"][-2000:]
    assert json.loads(r["out"].strip().splitlines()[-1]) == {
        "on": True,
        "restored": [False, False],
        "after": False,
        "restored_after": [True, True],
        "left": [],
    }
    files = [read_jsonl(log)[0]["crash_file"] for log in (r["log"], str(r["log"]) + ".2.jsonl")]
    assert len(set(files)) == 2 and not any(Path(f).exists() for f in files)


def test_a_host_owned_faulthandler_is_left_alone(tmp_path):
    import faulthandler

    import fusionguard

    was = faulthandler.is_enabled()  # pytest enables it by default (then it stays pytest's)
    if not was:
        faulthandler.enable()
    try:
        fusionguard.enable(log_path=str(tmp_path / "fg.jsonl"))
        fusionguard.disable()
        header = read_jsonl(tmp_path / "fg.jsonl")[0]
        assert header["crash_capture"] == "host-owned" and header["crash_file"] is None
        assert faulthandler.is_enabled(), "still the host's"
        assert not list(tmp_path.glob("*.crash"))
    finally:
        _testing.reset_for_tests()
        if not was:
            faulthandler.disable()


def test_native_crash_parser_reads_faulthandler_text(tmp_path):
    f = tmp_path / "x.crash"
    f.write_text(
        "Fatal Python error: Aborted\n\nThread 0x00007f01 (most recent call first):\n  File \"/a/worker.py\", line 3 in loop\n\n"
        "Current thread 0x00007f00 (most recent call first):\n"
        "  File \"/t/torch/_higher_order_ops/flex_attention.py\", line 80 in sdpa_dense\n"
        "  File \"/u/train.py\", line 12 in step\n  File \"/u/train.py\", line 20 in <module>\n\nExtension modules: x (total: 1)\n"
    )
    recent = [{"event": "flex_call", "path": "dense", "phase": "forward", "layer": "layers.3.attn", "seq": 7}]
    ev = crashfile.native_crash(str(f), (), recent)
    assert ev["exc_type"] == "native crash (SIGABRT)" and ev["message"] == "Fatal Python error: Aborted"
    assert ev["frames"] == [
        "/u/train.py:20 in <module>",
        "/u/train.py:12 in step",
        "/t/torch/_higher_order_ops/flex_attention.py:80 in sdpa_dense",
    ]
    assert ev["diagnosis"] == (
        "the process died of SIGABRT inside FlexAttention's dense implementation; last FlexAttention event: dense forward of layers.3.attn"
    )
    f.write_text("")
    assert crashfile.native_crash(str(f), (), recent) is None
    assert crashfile.native_crash(None) is None and crashfile.native_crash(str(tmp_path / "missing")) is None


def stat_mode(path):
    import stat as _stat

    return _stat.S_IMODE(os.stat(path).st_mode)


def test_a_crash_file_of_an_earlier_process_with_our_pid_is_kept(tmp_path):
    """Containers reuse pids (the main process is often pid 1): never overwrite a crash record.
    In a subprocess: faulthandler there is not pytest's."""
    code = """
import json, sys
from pathlib import Path
from fusionguard.eventlog import crash
log = sys.argv[1]
old = Path(crash.crash_file_for(log))
old.write_text("Fatal Python error: Segmentation fault\\n")
fields = crash.capture_native(log)
again = crash.capture_native(log)
crash.release_native()
print(json.dumps({"fields": fields, "again": again, "old": str(old), "old_text": old.read_text(),
                  "new_exists": Path(fields["crash_file"]).exists(), "torch": "torch" in sys.modules}))
"""
    p = subprocess.run([PY, "-c", code, str(tmp_path / "fg.jsonl")], capture_output=True, text=True, env=child_env(), timeout=60)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["fields"]["crash_capture"] == "faulthandler" and r["fields"]["crash_file"].endswith("-1.crash")
    assert r["again"] == r["fields"], "enable() again: the same file"
    assert r["old_text"] == "Fatal Python error: Segmentation fault\n" and not r["new_exists"]
    assert not r["torch"]


def test_a_crash_file_that_is_a_fifo_or_device_never_blocks_report(tmp_path):
    """A header's crash_file (or a file of that name beside the log) that is a FIFO or a device:
    ``report`` skips it instead of waiting forever for a writer. In a subprocess, bounded."""
    fifo = tmp_path / "run.pid7.crash"
    os.mkfifo(fifo)
    header = {"event": "header", "level": "info", "seq": 1, "ts": 1.0, "pid": 7, "rank": 0, "schema": 1, "crash_file": str(fifo)}
    for name, crash_file in (("a", str(fifo)), ("b", "/elsewhere/run.pid7.crash"), ("c", "/dev/zero")):
        (tmp_path / name).mkdir()
        log = tmp_path / name / "run.jsonl"
        if name == "b":  # found beside the log, by name
            os.mkfifo(tmp_path / name / "run.pid7.crash")
        log.write_text(json.dumps(dict(header, crash_file=crash_file)) + "\n")
        p = subprocess.run(
            [sys.executable, "-m", "fusionguard", "report", str(log)],
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        assert p.returncode == 0 and "CRASH" not in p.stdout, (name, p.stderr[-2000:])
