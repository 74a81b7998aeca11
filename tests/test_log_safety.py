"""The log file in shared directories and on full disks: real symlinks, FIFOs, devices, modes,
a real full tmpfs; secrets in argv; the smaller holes (path switch, message bugs, SIGTERM after
a disable() from a thread)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import warnings

import pytest
from conftest import qkv, read_jsonl, run_cli
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import _testing
from fusionguard.core import state as _state
from fusionguard.dense import guard as guard_mod
from fusionguard.eventlog import crash
from fusionguard.eventlog.redact import REDACTED, redact_argv
from fusionguard.eventlog.sink import FileSink

# -- what the log is opened on ----------------------------------------------------------------------


def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    link = tmp_path / "fusionguard.jsonl"
    link.symlink_to(victim)
    fusionguard.enable(log_path=str(link))
    try:
        assert fusionguard.is_enabled()
        flex_attention(*qkv())
        assert fusionguard.events("flex_call"), "events are kept in memory"
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
    assert victim.read_text() == "secret\n"
    err = capsys.readouterr().err
    assert "cannot open log file" in err and "kept in memory only" in err


def test_fifos_and_devices_are_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(OSError):  # no reader: O_NONBLOCK makes the open fail (ENXIO), not hang
        FileSink(str(fifo))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError, match="not a regular file"):
            FileSink(str(fifo))
        fusionguard.enable(log_path=str(fifo))  # with a reader: opened, seen, refused
        assert fusionguard.is_enabled() and _state.STATE.log.sink is None
        fusionguard.disable()
        _testing.reset_for_tests()
    finally:
        os.close(reader)
    with pytest.raises(OSError, match="not a regular file"):
        FileSink(os.devnull)
    assert "not a regular file" in capsys.readouterr().err


def test_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FUSIONGUARD_LOG", "~/logs/fg.jsonl")
    monkeypatch.chdir(tmp_path)
    fusionguard.enable()
    try:
        assert _state.STATE.config.log_path == str(tmp_path / "home" / "logs" / "fg.jsonl")
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
    assert read_jsonl(tmp_path / "home" / "logs" / "fg.jsonl")[0]["event"] == "header"
    assert not (tmp_path / "~").exists()


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_files_are_owner_only_unless_widened_existing_keep_theirs(tmp_path):
    old = os.umask(0o022)
    try:
        fusionguard.enable(log_path=str(tmp_path / "a.jsonl"))
        assert _mode(tmp_path / "a.jsonl") == 0o600
        fusionguard.enable(log_path=str(tmp_path / "b.jsonl"), log_mode=0o640)
        assert _mode(tmp_path / "b.jsonl") == 0o640
        existing = tmp_path / "c.jsonl"
        existing.write_text("")
        existing.chmod(0o644)
        fusionguard.enable(log_path=str(existing))
        assert _mode(existing) == 0o644
        with pytest.raises(ValueError):
            fusionguard.enable(log_path=str(existing), log_mode=0o044)
    finally:
        os.umask(old)
        fusionguard.disable()
        _testing.reset_for_tests()


def test_secret_looking_argv_values_are_redacted():
    argv = [
        "train.py",
        "--hf-token=hf_abcdefghijklmnopqrstuvwxyz012345",
        "--api-key",
        "sk-proj-0123456789abcdefABCDEF",
        "--password=hunter2",
        "--lr",
        "3e-4",
        "--layers",
        "32",
        "wandb.api_key=abc123",
        "--auth",
        "Bearer xyz",
        "--data",
        "s3://AKIAABCDEFGHIJKLMNOP@bucket/x",
        "ghp_0123456789abcdefghijABCDEFGHIJ",
        "https://user:pw@host/repo",
        "--dropout",
        "-0.1",
        "--no-key-cache",
    ]
    out = redact_argv(argv)
    assert out == [
        "train.py",
        f"--hf-token={REDACTED}",
        "--api-key",
        REDACTED,
        f"--password={REDACTED}",
        "--lr",
        "3e-4",
        "--layers",
        "32",
        f"wandb.api_key={REDACTED}",
        "--auth",
        REDACTED,
        "--data",
        f"s3://{REDACTED}@bucket/x",
        REDACTED,
        f"https://user:{REDACTED}@host/repo",
        "--dropout",
        "-0.1",
        "--no-key-cache",
    ]


def test_the_header_holds_the_redacted_argv(guard, monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py", "--hf_token", "hf_abcdefghijklmnopqrstuvwxyz012345", "--lr", "3e-4"])
    log = guard()
    fusionguard.disable()
    text = log.read_text()
    assert "hf_abcdefghij" not in text
    assert read_jsonl(log)[0]["argv"] == ["train.py", "--hf_token", REDACTED, "--lr", "3e-4"]


# -- a full disk: a real 64 KB tmpfs ------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI and the dev machines run as root)")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # a descriptor still open


def _fill(mnt, free):
    """Leave ``free`` bytes of the 64 KB tmpfs (its pages are 4 KB)."""
    filler = mnt / "filler"
    filler.write_bytes(b"\0" * (64 * 1024 - free))
    return filler


@pytest.mark.parametrize("max_bytes", [None, 1 << 20], ids=["append", "rotating"])
def test_a_fragment_left_by_enospc_is_closed_before_the_next_event(small_tmpfs, max_bytes):
    filler = _fill(small_tmpfs, 4096)
    sink = FileSink(str(small_tmpfs / "fg.jsonl"), fsync=False, max_bytes=max_bytes)

    def line(i):
        return json.dumps({"i": i, "pad": "x" * (999 - len(json.dumps({"i": i, "pad": ""})))})

    written, failed = [], 0
    for i in range(6):  # 1000-byte lines: 4 fit in the last 4 KB page, the 5th is cut short
        try:
            sink.write(line(i), durable=False)
            written.append(i)
        except OSError:
            failed += 1
    assert failed and sink._torn, "the short write left part of a line in the file"
    filler.unlink()  # space is back
    sink.write(json.dumps({"i": "after"}), durable=False)
    sink.close()
    chunks = [c for c in (small_tmpfs / "fg.jsonl").read_bytes().split(b"\n") if c]
    good, fragments = [], []
    for chunk in chunks:
        try:
            good.append(json.loads(chunk)["i"])
        except ValueError:
            fragments.append(chunk)
    assert good == written + ["after"], "the first event after the full disk is whole"
    assert len(fragments) == 1 and line(len(written)).encode().startswith(fragments[0]), "one fragment, closed off"


def test_full_disk_messages_say_what_happens(small_tmpfs, capsys):
    filler = _fill(small_tmpfs, 8192)
    log = small_tmpfs / "fg.jsonl"
    fusionguard.enable(log_path=str(log))
    try:
        for i in range(30):
            _state.STATE.log.emit("warning", "probe", i=i, pad="y" * 500)
        err = capsys.readouterr().err
        assert "cannot write the log" in err and "each new event tries the file again" in err
        assert "kept in memory only" not in err
        filler.unlink()
        _state.STATE.log.emit("warning", "probe", i="after")
        err = capsys.readouterr().err
        assert "writing the log" in err and "again" in err
        assert len(fusionguard.events("probe")) == 31, "every event is in memory"
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
    lines = log.read_text().splitlines()
    events = []
    for x in lines:
        try:
            events.append(json.loads(x))
        except ValueError:
            pass
    assert len(lines) - len(events) <= 1, "at most the one fragment, on a line of its own"
    assert [e["i"] for e in events if e["event"] == "probe"][-1] == "after"
    assert events[-1]["event"] == "shutdown"


# -- the smaller holes ----------------------------------------------------------------------------------


def test_switching_log_path_ends_the_old_file_with_a_shutdown(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    fusionguard.enable(log_path=str(a))
    fusionguard.enable(log_path=str(b))
    fusionguard.disable()
    _testing.reset_for_tests()
    last = read_jsonl(a)[-1]
    assert last["event"] == "shutdown" and last["reason"] == "log_path changed" and last["next_log"] == str(b)
    rc, out, _ = run_cli(capsys, a, "--format", "json")
    assert [e["ending"] for e in json.loads(out)["endings"]] == ["log_path changed"]


@pytest.mark.parametrize("strict", [False, True])
def test_a_bug_in_the_message_never_reaches_the_call(guard, monkeypatch, strict):
    def broken(event):
        raise KeyError("bug in the message")

    monkeypatch.setattr(guard_mod, "format_message", broken)
    monkeypatch.setattr(guard_mod, "message", broken)
    guard(strict=strict)
    q, k, v = qkv()
    out = flex_attention(q, k, v)  # fail open: the dense call runs, neither raised nor warned
    assert out.shape == q.shape
    (err,) = fusionguard.events("internal_error")
    assert err["where"] == "dense forward check" and "bug in the message" in err["error"]


def test_sigterm_after_a_disable_from_a_thread_passes_through_then_goes(tmp_path):
    got = []

    def mine(signum, frame):
        got.append(signum)

    before = signal.signal(signal.SIGTERM, mine)
    try:
        fusionguard.enable(log_path=str(tmp_path / "fg.jsonl"))
        assert signal.getsignal(signal.SIGTERM) is crash._on_sigterm
        t = threading.Thread(target=fusionguard.disable)
        t.start()
        t.join(30)
        assert signal.getsignal(signal.SIGTERM) is crash._on_sigterm, "a thread cannot touch signals"
        signal.raise_signal(signal.SIGTERM)  # a pass-through now: straight to the previous handler
        assert got == [signal.SIGTERM]
        assert not [e for e in read_jsonl(tmp_path / "fg.jsonl") if e.get("reason") == "sigterm"]
        fusionguard.disable()  # main thread: ours goes, the previous handler is back, exactly
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
        _testing.reset_for_tests()


def test_hydra_append_and_force_overrides_are_redacted_too():
    argv = ["train.py", "+db.password=hunter2", "++wandb.api_key=abc123", "+trainer.max_epochs=3"]
    assert redact_argv(argv) == ["train.py", f"+db.password={REDACTED}", f"++wandb.api_key={REDACTED}", "+trainer.max_epochs=3"]


def test_switching_log_path_writes_the_old_file_s_pending_counts_before_its_shutdown(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    fusionguard.enable(log_path=str(a), dense_first=1, flush_interval=0)
    q, k, v = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            flex_attention(q, k, v)
    fusionguard.enable(log_path=str(b), dense_first=1, flush_interval=0)
    fusionguard.disable()
    _testing.reset_for_tests()
    assert read_jsonl(a)[-1]["event"] == "shutdown"
    rc, out, _ = run_cli(capsys, a, "--format", "json")
    rep = json.loads(out)
    assert rep["totals"]["dense_calls"] == 5 and [e["ending"] for e in rep["endings"]] == ["log_path changed"]


def test_guarded_swallows_and_logs_an_exception_but_lets_the_intended_ones_through(guard):
    """#33: the one shape of fusionguard's own error handling. An Exception is logged once per
    (where, type) and swallowed (the decorator returns its fallback); KeyboardInterrupt and the types
    in ``passes`` (the strict-mode error) propagate untouched."""
    guard()
    ran = []
    with _state.guarded("probe block"):
        raise ValueError("a bug")
    ran.append("after")

    @_state.guarded("probe call", fallback=(None, None))
    def call(kind: type) -> tuple:
        raise kind("boom")

    assert call(KeyError) == (None, None) and call(KeyError) == (None, None) and call.__name__ == "call"
    with pytest.raises(KeyboardInterrupt):
        call(KeyboardInterrupt)
    with pytest.raises(fusionguard.DenseFallbackError):
        with _state.guarded("probe pass", passes=(fusionguard.DenseFallbackError,)):
            raise fusionguard.DenseFallbackError("strict")
    with pytest.raises(KeyboardInterrupt):
        with _state.guarded("probe interrupt"):
            raise KeyboardInterrupt
    assert ran == ["after"]
    assert [(e["where"], e["error"]) for e in fusionguard.events("internal_error")] == [
        ("probe block", "ValueError: a bug"),
        ("probe call", "KeyError: 'boom'"),
    ]
