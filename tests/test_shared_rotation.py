"""Several processes appending to one rotating log (issue #27): every line they wrote is in a
file, each process's ``seq`` has no gap, no file grows past ``log_max_bytes`` and the backups are
numbered without gaps, so ``fusionguard report`` on the directory counts every call exactly.
Real independent processes (started together behind a file barrier), real ``os.fork`` children
in file mode and real dense FlexAttention calls; nothing is mocked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
from conftest import child_env, read_jsonl, run_cli

from fusionguard.eventlog.sink import FileSink

PY = sys.executable
# Each process puts its header copy (about 1.5 kB) before its first line in every file it writes
# to, so 4 processes need a file well above 4 x 1.5 kB for their events.
MAX_BYTES = 16384
BACKUPS = 1000  # enough that rotation itself drops nothing: every line must be found

# One writer: enable() with rotation on the shared path, say it is ready, wait for the go file
# (so the writers overlap), then N dense events: real eager FlexAttention calls ("flex") or
# flex_call events through the real EventLog ("events", cheaper: 4 processes on 2 CPU cores).
WRITER = """
import os, sys, time, warnings
warnings.simplefilter("ignore")
log, n, how, barrier = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
import torch
torch.set_num_threads(1)
import fusionguard
from fusionguard.core.state import STATE
from torch.nn.attention.flex_attention import flex_attention
fusionguard.enable(log_path=log, keep_all=True, log_max_bytes=%(max_bytes)d, log_backups=%(backups)d)
open(os.path.join(barrier, "ready.%%d" %% os.getpid()), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(barrier, "go")) and time.monotonic() < deadline:
    time.sleep(0.005)
if how == "flex":
    q = torch.randn(1, 1, 8, 4)
    for _ in range(n):
        flex_attention(q, q, q)
else:
    for i in range(n):
        STATE.log.emit_fields(
            "warning", "flex_call",
            {"layer": "layers.%%d" %% (i %% 4), "phase": "forward", "path": "dense", "cause": "eager_call", "action": "logged"},
        )
together = int(sys.argv[5]) if len(sys.argv) > 5 else 0  # the writers that end together (0: no wait)
if together:
    open(os.path.join(barrier, "done.%%d" %% os.getpid()), "w").close()
    while len([f for f in os.listdir(barrier) if f.startswith("done.")]) < together and time.monotonic() < deadline:
        time.sleep(0.001)
    for i in range(20):  # the last files hold both processes' lines, interleaved
        STATE.log.emit_fields(
            "warning", "flex_call",
            {"layer": "end", "phase": "forward", "path": "dense", "cause": "eager_call", "action": "logged"},
        )
fusionguard.disable()
"""

# File mode (one path for all), rotation on: the parent forks CHILDREN children, then all of them
# write N flex_call events at once; the children end with os._exit, as DataLoader workers do.
FORKED = """
import json, os, signal, sys, time
import fusionguard
from fusionguard.core.state import STATE
log, n, children = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fusionguard.enable(log_path=log, keep_all=True, log_max_bytes=%(max_bytes)d, log_backups=%(backups)d)
r, w = os.pipe()
pids = []
for c in range(children):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(w)
            os.read(r, 1)  # the go signal: the parent closes its end when every child is forked
            for i in range(n):
                STATE.log.emit_fields(
                    "warning", "flex_call",
                    {"layer": "child.%%d" %% c, "phase": "forward", "path": "dense", "cause": "eager_call", "action": "logged"},
                )
            code = 0
        finally:
            os._exit(code)
    pids.append(pid)
os.close(r)
os.close(w)
for i in range(n):
    STATE.log.emit_fields(
        "warning", "flex_call",
        {"layer": "parent", "phase": "forward", "path": "dense", "cause": "eager_call", "action": "logged"},
    )
status, deadline = {}, time.monotonic() + 120
while len(status) < len(pids) and time.monotonic() < deadline:
    for pid in pids:
        if pid not in status:
            got, st = os.waitpid(pid, os.WNOHANG)
            if got:
                status[pid] = os.waitstatus_to_exitcode(st)
    time.sleep(0.01)
hung = [p for p in pids if p not in status]
for p in hung:
    os.kill(p, signal.SIGKILL)
    os.waitpid(p, 0)
fusionguard.disable()
print(json.dumps({"parent": os.getpid(), "status": status, "hung": hung}))
"""

_PART = re.compile(r"^fg\.jsonl(?:\.(\d+))?$")


def _script(tmp_path: Path, name: str, code: str, max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> Path:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(code % {"max_bytes": max_bytes, "backups": backups}))
    return script


def _run_writers(
    tmp_path: Path, processes: int, n: int, how: str, max_bytes: int = MAX_BYTES, backups: int = BACKUPS, together: bool = False
) -> Path:
    """``processes`` independent Python processes writing ``n`` dense events each to one path
    (``together``: then 20 more each once all are done, and disable())."""
    logs, barrier = tmp_path / "logs", tmp_path / "barrier"
    logs.mkdir()
    barrier.mkdir()
    script = _script(tmp_path, "writer", WRITER, max_bytes, backups)
    log = logs / "fg.jsonl"
    procs = [
        forkserver.popen(
            [PY, str(script), str(log), str(n), how, str(barrier), str(processes if together else 0)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=tmp_path,
        )
        for _ in range(processes)
    ]
    try:
        deadline = time.monotonic() + 180
        while len(list(barrier.glob("ready.*"))) < processes and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.02)
        (barrier / "go").touch()
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return logs


def _check_shared_log(logs: Path, capsys, pids: int, per_pid: int) -> None:
    """The invariants of a rotating log shared by ``pids`` processes of ``per_pid`` events each
    (every broken one is named in the failure, not just the first)."""
    problems = []
    numbers, sizes = [], {}
    for f in logs.iterdir():
        m = _PART.match(f.name)
        if m is None:
            continue  # crash files of forked children (removed when empty), nothing else
        if m.group(1):
            numbers.append(int(m.group(1)))
        sizes[f.name] = f.stat().st_size
    numbers.sort()
    assert numbers, "the log was rotated"
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"backup numbering has gaps: {len(numbers)} backups, the highest {numbers[-1]}")
    too_big = sorted(size for size in sizes.values() if size > MAX_BYTES)
    if too_big:
        problems.append(f"{len(too_big)} files past log_max_bytes={MAX_BYTES}, the largest {too_big[-1]} bytes")

    seqs: dict = {}
    for name in sizes:
        events = read_jsonl(logs / name)
        if events[0]["event"] != "header":
            problems.append(f"{name} does not start with a header (or its copy)")
        for e in events:
            if not e.get("rotated"):  # a header copy repeats its process's header seq
                seqs.setdefault(e["pid"], []).append(e["seq"])
    if len(seqs) != pids:
        problems.append(f"{len(seqs)} processes in the log, not {pids}")
    for pid, got in seqs.items():
        missing = sorted(set(range(1, max(got) + 1)) - set(got))
        if missing or len(got) != len(set(got)):
            problems.append(f"pid {pid}: {len(missing)} seq missing (first {missing[:5]}), {len(got) - len(set(got))} twice")

    rc, out, _ = run_cli(capsys, logs, "--format", "json")
    rep = json.loads(out)
    assert rc == 0
    if sum(f["corrupt_lines"] for f in rep["files"]) or any(f["torn_last_line"] for f in rep["files"]):
        problems.append("corrupt or torn lines")
    if rep["totals"]["dense_calls"] != pids * per_pid:
        problems.append(f"report counts {rep['totals']['dense_calls']} dense calls, not {pids * per_pid}")
    assert not problems, "; ".join(problems)


def test_two_processes_real_dense_calls_share_one_rotating_log(tmp_path, capsys):
    n = 1500
    logs = _run_writers(tmp_path, 2, n, "flex")
    _check_shared_log(logs, capsys, 2, n)


@pytest.mark.parametrize("processes", [2, 4])
def test_independent_processes_share_one_rotating_log(tmp_path, capsys, processes):
    n = 1500
    logs = _run_writers(tmp_path, processes, n, "events")
    _check_shared_log(logs, capsys, processes, n)


def test_forked_children_in_file_mode_share_the_rotating_log(tmp_path, capsys):
    n, children = 1500, 3
    logs = tmp_path / "logs"
    logs.mkdir()
    script = _script(tmp_path, "forked", FORKED)
    proc = forkserver.run(
        [PY, str(script), str(logs / "fg.jsonl"), str(n), str(children)],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["hung"] == [] and sorted(r["status"].values()) == [0] * children
    _check_shared_log(logs, capsys, children + 1, n)


# -- two writers of one path in this process: each its own open file, as two processes have ------


def _line(who: str, i: int) -> str:
    return json.dumps({"event": "probe", "who": who, "i": i, "pad": "x" * 200})


def test_a_writer_follows_a_rotation_made_by_another(tmp_path):
    path = tmp_path / "fg.jsonl"
    a, b = (FileSink(str(path), fsync=False, max_bytes=1024, backups=5) for _ in range(2))
    b.write(_line("b", 0), False)
    for i in range(4):  # about 250 bytes a line: a rotates once, after the 4th line in the file
        a.write(_line("a", i), False)
    assert a.rotations == 1 and b.rotations == 0, "a counts the bytes b wrote into the file too"
    b.write(_line("b", 1), False)  # b's file is fg.jsonl.1 now: b must write to the new fg.jsonl
    a.close()
    b.close()
    old, new = read_jsonl(tmp_path / "fg.jsonl.1"), read_jsonl(path)
    assert [(e["who"], e["i"]) for e in old] == [("b", 0), ("a", 0), ("a", 1), ("a", 2)]
    assert [(e["who"], e["i"]) for e in new] == [("a", 3), ("b", 1)]
    assert max(p.stat().st_size for p in tmp_path.iterdir()) <= 1024


def test_following_a_rotation_never_goes_through_a_planted_symlink(tmp_path):
    path = tmp_path / "fg.jsonl"
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    a, b = (FileSink(str(path), fsync=False, max_bytes=1024, backups=5) for _ in range(2))
    b.write(_line("b", 0), False)
    for i in range(4):
        a.write(_line("a", i), False)
    planted = tmp_path / "planted"
    planted.symlink_to(victim)
    os.replace(planted, path)  # an attacker swaps the new log file for a link to another file
    for sink in (a, b):
        with pytest.raises(OSError):
            sink.write(_line("x", 9), False)
    assert victim.read_text() == "precious\n"
    path.unlink()
    b.write(_line("b", 1), False)  # the link gone: the next event makes a regular file again
    a.close()
    b.close()
    assert not path.is_symlink() and [e["who"] for e in read_jsonl(path)] == ["b"]
    assert victim.read_text() == "precious\n"


def test_a_planted_lock_file_link_is_not_followed_and_rotation_goes_on(tmp_path):
    path = tmp_path / "fg.jsonl"
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "fg.jsonl.lock").symlink_to(victim)
    sink = FileSink(str(path), fsync=False, max_bytes=1024, backups=5)
    for i in range(10):
        sink.write(_line("a", i), False)
    sink.close()
    assert victim.read_text() == "precious\n" and (tmp_path / "fg.jsonl.lock").is_symlink()
    assert sink.rotations >= 2, "without its lock the log still rotates (unlocked, as a lone writer)"
    parts = sorted(tmp_path.glob("fg.jsonl*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    assert [e["i"] for p in parts if not p.is_symlink() for e in read_jsonl(p)] == list(range(10))


# -- the lock file itself: removed mid-run, not wanted, failing for a moment --------------------

# A bare FileSink writer: N numbered lines to the shared path; after its first line (its lock file
# is open then) it says so and waits for the go file.
SINK_WRITER = """
import os, sys, time
from fusionguard.eventlog.sink import FileSink
log, who, n, barrier, max_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
sink = FileSink(log, fsync=False, max_bytes=max_bytes, backups=100000)
pad = "x" * 60
sink.write('{"event": "probe", "who": "%s", "i": 0, "pad": "%s"}' % (who, pad), False)
open(os.path.join(barrier, "ready." + who), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(barrier, "go")) and time.monotonic() < deadline:
    time.sleep(0.005)
for i in range(1, n):
    sink.write('{"event": "probe", "who": "%s", "i": %d, "pad": "%s"}' % (who, i, pad), False)
sink.close()
"""


def _wait_for(path: Path, proc) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.01)


def test_a_lock_file_removed_mid_run_is_locked_again_by_every_process(tmp_path):
    """The reviewer's case: ``<log>.lock`` removed after the first writer opened it, before the
    second started; without noticing, each locks its own file and lines are lost."""
    n, max_bytes = 6000, 8192
    logs, barrier = tmp_path / "logs", tmp_path / "barrier"
    logs.mkdir()
    barrier.mkdir()
    script = tmp_path / "sink_writer.py"
    script.write_text(textwrap.dedent(SINK_WRITER))
    log = logs / "fg.jsonl"
    procs = []
    try:
        for who in ("a", "b"):
            procs.append(
                forkserver.popen(
                    [PY, str(script), str(log), who, str(n), str(barrier), str(max_bytes)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=child_env(),
                    cwd=tmp_path,
                )
            )
            _wait_for(barrier / f"ready.{who}", procs[-1])
            if who == "a":
                (logs / "fg.jsonl.lock").unlink()  # an `rm` of the lock file while "a" holds it open
        (barrier / "go").touch()
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    got: dict = {"a": [], "b": []}
    too_big = []
    for f in logs.iterdir():
        if _PART.match(f.name):
            if f.stat().st_size > max_bytes:
                too_big.append(f.stat().st_size)
            for e in read_jsonl(f):
                got[e["who"]].append(e["i"])
    lost = {who: n - len(set(i)) for who, i in got.items()}
    assert lost == {"a": 0, "b": 0} and not too_big, f"lines lost {lost}; {len(too_big)} files past {max_bytes} bytes"
    assert sorted(got["a"]) == list(range(n)) and sorted(got["b"]) == list(range(n))


def test_default_backups_report_shows_only_the_real_processes(tmp_path, capsys):
    """Default ``log_backups`` (3): the files left may hold none of a process's own header,
    only files another process started; its header copy before its first line there keeps
    ``report`` from inventing a host-less process that "stopped"."""
    n = 300
    logs = _run_writers(tmp_path, 2, n, "events", max_bytes=4096, backups=3, together=True)
    names = sorted(f.name for f in logs.iterdir())
    assert names == ["fg.jsonl", "fg.jsonl.1", "fg.jsonl.2", "fg.jsonl.3", "fg.jsonl.lock"], names
    rc, out, _ = run_cli(capsys, logs, "--format", "json")
    assert rc == 0
    rep = json.loads(out)
    endings = [(e["host"] is not None, e["ending"]) for e in rep["endings"]]
    assert rep["run"]["processes"] == 2 and endings == [(True, "disable"), (True, "disable")], rep["endings"]
    assert rep["crashes"] == []
    for f in logs.glob("fg.jsonl*"):
        if f.suffix == ".lock":
            continue
        seen = set()
        for e in read_jsonl(f):
            if e["event"] == "header":
                seen.add(e["pid"])
            assert e["pid"] in seen, f"{f.name}: a line of pid {e['pid']} before its header (copy)"


ROTATING_ENABLE = """
import sys
import fusionguard
from fusionguard.core.state import STATE
fusionguard.enable(log_path=sys.argv[1], log_max_bytes=1024, keep_all=True)
for i in range(40):
    STATE.log.emit_fields(
        "warning", "flex_call",
        {"layer": "l", "phase": "forward", "path": "dense", "cause": "eager_call", "action": "logged"},
    )
fusionguard.disable()
"""


@pytest.mark.parametrize("mode", ["directory", "file"])
def test_a_lock_file_only_where_several_processes_may_share_the_path(tmp_path, mode):
    logs = tmp_path / "logs"
    logs.mkdir()
    target = str(logs) + os.sep if mode == "directory" else str(logs / "fg.jsonl")
    proc = forkserver.run([PY, "-c", ROTATING_ENABLE, target], capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(f.name for f in logs.iterdir())
    assert any(name.endswith(".jsonl.3") for name in names), names  # it rotated
    locks = [name for name in names if name.endswith(".lock")]
    assert locks == ([] if mode == "directory" else ["fg.jsonl.lock"]), names


EMFILE_THEN_FREE = """
import os, resource, sys
from fusionguard.eventlog.sink import FileSink
path = sys.argv[1]
sink = FileSink(path, fsync=False, max_bytes=4096)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError as exc:
    assert exc.errno == 24, exc  # EMFILE: no descriptor left for the lock file
sink.write('{"event": "probe", "i": 0}', False)  # written unlocked
print("after EMFILE:", os.path.exists(path + ".lock"))
for fd in held:
    os.close(fd)
sink.write('{"event": "probe", "i": 1}', False)
print("after freeing:", os.path.exists(path + ".lock"), sink._lock_fd is not None)
sink.close()
"""


def test_a_passing_failure_to_open_the_lock_file_is_tried_again(tmp_path):
    """EMFILE (or ENOSPC) opening ``<log>.lock`` is a moment: the next write locks; only a
    symlink or a non-regular file there gives the lock up for good (see the planted link test)."""
    path = tmp_path / "fg.jsonl"
    proc = forkserver.run(
        [PY, "-c", EMFILE_THEN_FREE, str(path)], capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["after EMFILE: False", "after freeing: True True"], proc.stdout
    assert [e["i"] for e in read_jsonl(path)] == [0, 1]
