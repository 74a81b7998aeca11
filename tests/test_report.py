"""``fusionguard report`` on real logs (eager dense calls through the guard) and on fabricated
logs for the events other parts produce (layer_memory, summary, crash), plus the bounded-log
helpers of fusionguard.eventlog.log (fused-event sampler, size-based rotation)."""

from __future__ import annotations

import ast
import csv
import io
import json
import os
import struct
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path

import pytest
from conftest import ROOT, qkv, read_jsonl, run_cli
from torch.nn.attention.flex_attention import flex_attention

from fusionguard import cli
from fusionguard.eventlog.log import EventLog
from fusionguard.eventlog.sampler import Sampler
from fusionguard.report import read as report_read
from fusionguard.report.aggregate import NO_LAYER
from fusionguard.report.build import build as build_report_dict
from fusionguard.report.render import CSV_COLUMNS
from fusionguard.report.reservoir import Reservoir

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

ROW_KEYS = {
    "layer",
    "phase",
    "dense",
    "allowed",
    "fused",
    "compiles",
    "blocked",
    "oom_blocked",
    "inlined",
    "causes",
    "alloc_delta_median",
    "alloc_delta_max",
    "peak_delta_median",
    "peak_delta_max",
    "memory_samples",
    "scores_bytes_max",
    "predicted_bytes_max",
    "templates",
    "first_dense",
    "first_dense_call_site",
    "dense_ranks",
    "fused_ranks",
}
TOP_KEYS = {
    "report_version",
    "run",
    "totals",
    "masks",
    "rows",
    "ranks",
    "disagreements",
    "endings",
    "crashes",
    "files",
    "ignored",
    "warnings",
    "first_events",
    "recompile_pressure",
    "no_flex_calls",
    "oom",
}
SITE = {"file": "train.py", "line": 7, "function": "attention"}


def ev(kind, seq, pid=100, rank=0, ts0=1_800_000_000.0, **fields):
    return {"event": kind, "level": "info", "ts": ts0 + seq, "seq": seq, "pid": pid, "rank": rank, "thread": "MainThread", **fields}


def header(pid=100, rank=0, schema=1, host="node1", **extra):
    cuda = {"available": True, "count": 2, "version": "13.0", "devices": ["NVIDIA H200", "NVIDIA H200"]}
    return ev(
        "header",
        1,
        pid=pid,
        rank=rank,
        schema=schema,
        fusionguard="0.1.0",
        torch="2.13.0",
        triton="3.6.0",
        python="3.11.7",
        hostname=host,
        cuda=cuda,
        world_size=2,
        local_rank=rank,
        **extra,
    )


def write(path, events, tail=b""):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for e in events:
            fh.write(json.dumps(e).encode() + b"\n")
        fh.write(tail)
    return path


def as_json(capsys, *args):
    rc, out, err = run_cli(capsys, *args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


# -- a real log ----------------------------------------------------------------------------------


def test_report_on_a_real_log_of_eager_dense_calls(guard, capsys):
    log = guard()
    q, k, v = qkv(L=16, KV=24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first_line = sys._getframe().f_lineno + 1
        flex_attention(q, k, v)
        flex_attention(q, k, v)
    import fusionguard

    fusionguard.disable()

    rc, out, _ = run_cli(capsys, log)
    assert rc == 0
    assert "DENSE: 2 dense FlexAttention calls in 1 layer/phase pair; causes: eager_call×2" in out
    assert "ended:    disable (rank 0)" in out and "CRASH" not in out and "STOPPED" not in out
    site = f"{__file__}:{first_line} in test_report_on_a_real_log_of_eager_dense_calls"
    table = out.split("first dense call site", 1)[1]
    assert "(no layer)" in table and "forward" in table and "eager_call×2" in table and site in table

    rep = as_json(capsys, log)
    assert set(rep) == TOP_KEYS
    (row,) = rep["rows"]
    assert set(row) == ROW_KEYS
    assert (row["layer"], row["phase"], row["dense"], row["fused"], row["allowed"]) == ("(no layer)", "forward", 2, 0, 0)
    assert row["causes"] == {"eager_call": 2} and row["scores_bytes_max"] == 1 * 2 * 16 * 24 * 4
    assert row["first_dense_call_site"] == site
    assert rep["run"]["versions"][0]["torch"].startswith("2.")
    assert rep["endings"][0]["ending"] == "disable"

    rc, out, _ = run_cli(capsys, log, "--format", "csv")
    rows = list(csv.reader(io.StringIO(out)))
    assert tuple(rows[0]) == CSV_COLUMNS
    got = dict(zip(rows[0], rows[1]))
    assert got["dense"] == "2" and got["causes"] == "eager_call=2" and got["first_dense_call_site"] == site

    assert cli.main(["report", str(log), "--fail-on-dense"]) == 1
    capsys.readouterr()


# -- per layer, memory, ranks --------------------------------------------------------------------


def _two_ranks(tmp_path):
    r0 = [
        header(pid=100, rank=0),
        *[
            ev("layer_memory", 2 + i, layer="layers.0.attn", phase="forward", path="fused", alloc_delta=a, peak_delta=p)
            for i, (a, p) in enumerate([(100, 1_000), (300, 9_000), (200, 2_000)])
        ],
        ev("layer_memory", 5, layer="layers.0.attn", phase="backward", path="fused", alloc_delta=-50, peak_delta=4_000),
        ev("flex_compile", 6, layer="layers.1.attn", phase="forward", path="fused", template="triton"),
        ev("layer_memory", 7, layer="layers.1.attn", phase="forward", path="fused", alloc_delta=10, peak_delta=20),
        ev("shutdown", 8, reason="exit", counts={}),
    ]
    r1 = [
        header(pid=200, rank=1),
        ev("layer_memory", 2, pid=200, rank=1, layer="layers.0.attn", phase="forward", path="fused", alloc_delta=400, peak_delta=3_000),
        dict(
            ev(
                "flex_call",
                3,
                pid=200,
                rank=1,
                layer="layers.1.attn",
                phase="forward",
                path="dense",
                cause="recompile_limit",
                call_site=SITE,
                scores_bytes=301_989_888,
                action="warn",
            ),
            level="warning",
        ),
        ev(
            "layer_memory",
            4,
            pid=200,
            rank=1,
            layer="layers.1.attn",
            phase="forward",
            path="dense",
            alloc_delta=5_000_000,
            peak_delta=310_000_000,
        ),
        ev("shutdown", 5, pid=200, rank=1, reason="sigterm", counts={}),
    ]
    write(tmp_path / "run" / "a" / "fusionguard.rank0.jsonl", r0)
    write(tmp_path / "run" / "b" / "fusionguard.rank1.jsonl", r1)
    return tmp_path / "run"


def test_per_layer_memory_causes_and_rank_disagreement(tmp_path, capsys):
    run = _two_ranks(tmp_path)
    rep = as_json(capsys, run)  # a directory: both files, found recursively
    assert rep["run"]["files"] == 2 and rep["run"]["ranks"] == [0, 1] and rep["run"]["world_size"] == 2
    assert rep["run"]["devices"] == {"node1": ["NVIDIA H200", "NVIDIA H200"]}
    assert rep["run"]["duration_s"] == 7.0
    rows = {(r["layer"], r["phase"]): r for r in rep["rows"]}
    assert list(rows) == [("layers.0.attn", "forward"), ("layers.0.attn", "backward"), ("layers.1.attn", "forward")]
    f0 = rows[("layers.0.attn", "forward")]
    assert (f0["dense"], f0["fused"], f0["compiles"]) == (0, 4, 0)
    assert (f0["alloc_delta_median"], f0["alloc_delta_max"]) == (250, 400)  # 100 200 300 400
    assert (f0["peak_delta_median"], f0["peak_delta_max"]) == (2_500, 9_000)
    assert f0["fused_ranks"] == [0, 1] and f0["dense_ranks"] == []
    f1 = rows[("layers.1.attn", "forward")]
    assert (f1["dense"], f1["fused"], f1["compiles"]) == (1, 1, 1)
    assert f1["causes"] == {"recompile_limit": 1} and f1["templates"] == ["triton"]
    assert f1["first_dense_call_site"] == "train.py:7 in attention" and f1["first_dense"]["rank"] == 1
    assert f1["peak_delta_max"] == 310_000_000
    assert rep["disagreements"] == [{"layer": "layers.1.attn", "phase": "forward", "dense_ranks": [1], "fused_ranks": [0]}]
    assert rep["ranks"] == [
        {"rank": 0, "dense_calls": 0, "dense": []},
        {"rank": 1, "dense_calls": 1, "dense": [{"layer": "layers.1.attn", "phase": "forward", "dense": 1}]},
    ]
    assert sorted(e["ending"] for e in rep["endings"]) == ["exit", "sigterm"]
    assert rep["crashes"] == []

    rc, out, _ = run_cli(capsys, run)
    assert "ranks 0-1 of world size 2" in out and "node1: 2× NVIDIA H200" in out
    assert "rank 1: 1 dense: layers.1.attn forward ×1" in out and "rank 0: no dense" in out
    assert "layers.1.attn forward: dense on rank 1, fused on rank 0" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("layers.0.attn  forward"))
    assert "250 B / 400 B" in line and "2.50 KB / 9.00 KB" in line


def test_plot_is_a_png_of_plausible_size(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _two_ranks(tmp_path)
    png = tmp_path / "layers.png"
    rc, out, err = run_cli(capsys, run, "--plot", png)
    assert rc == 0 and "plot written to" in err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert 700 <= width <= 4000 and 400 <= height <= 1000
    assert 15_000 < len(data) < 1_000_000


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    run = _two_ranks(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    png = tmp_path / "x.png"
    rc, out, err = run_cli(capsys, run, "--plot", png)
    assert rc == 2 and out == ""
    assert "--plot needs matplotlib" in err and "pip install 'fusionguard[plot]'" in err
    assert not png.exists()


# -- summary rows and sampled counters -------------------------------------------------------------


def test_summary_rows_and_fused_call_counters(tmp_path, capsys):
    events = [
        header(),
        ev("layer_memory", 2, layer="layers.0", phase="forward", path="fused", alloc_delta=1, peak_delta=10),
        ev(
            "fused_calls",
            3,
            layer="layers.0",
            phase="forward",
            path="fused",
            of="layer_memory",
            count=999,
            total=1000,
            alloc_delta_max=7,
            alloc_delta_last=2,
            peak_delta_max=77,
            peak_delta_last=20,
        ),
        # a row for calls this log does not hold
        ev(
            "summary",
            4,
            rows=[
                {
                    "layer": "layers.5",
                    "phase": "backward",
                    "calls": 40,
                    "dense": 40,
                    "fused": 0,
                    "causes": {"eager_call": 40},
                    "alloc_delta_last": 5,
                    "alloc_delta_max": 6,
                    "peak_delta_last": 8e9,
                    "peak_delta_max": 9e9,
                    "scores_bytes": 2_700_000_000,
                    "rank": 0,
                },
                {"layer": "layers.0", "phase": "forward", "calls": 1000, "dense": 0, "fused": 1000, "causes": {}, "rank": 0},
                {"layer": "layers.0", "phase": "forward", "calls": 10, "dense": 10, "fused": 0, "causes": {"graph_break": 10}, "rank": 3},
            ],
        ),
        ev("shutdown", 5, reason="exit"),
    ]
    rep = as_json(capsys, write(tmp_path / "fg.jsonl", events))
    rows = {(r["layer"], r["phase"]): r for r in rep["rows"]}
    l0 = rows[("layers.0", "forward")]
    assert l0["fused"] == 1000 and l0["dense"] == 10  # rank 3's gathered row counts
    assert l0["alloc_delta_max"] == 7 and l0["peak_delta_max"] == 77
    assert l0["dense_ranks"] == [3] and l0["fused_ranks"] == [0]
    # the process's own rows add no call its events do not hold (counters are flushed before a
    # summary; rows may also count an earlier log of the process): only their memory figures
    l5 = rows[("layers.5", "backward")]
    assert (l5["dense"], l5["causes"], l5["peak_delta_max"], l5["scores_bytes_max"]) == (0, {}, 9e9, None)
    assert {e["rank"]: e["ending"] for e in rep["endings"]} == {0: "exit", 3: "summary only"}


# -- how the run ended ---------------------------------------------------------------------------


def test_crash_section_shows_the_events_before_the_crash(tmp_path, capsys):
    events = [header()] + [
        dict(
            ev("flex_call", s, layer=f"layers.{s}", phase="backward", path="dense", cause="eager_call", scores_bytes=2_700_000_000),
            level="warning",
        )
        for s in range(2, 16)
    ]
    crash = dict(
        ev(
            "crash",
            16,
            exc_type="torch.OutOfMemoryError",
            message="CUDA out of memory. Tried to allocate 2.70 GiB\nmore",
            where="sys.excepthook",
            diagnosis="OOM inside dense backward of layers.15; the dense score matrix is 2.70 GB in fp32",
            last_flex={
                "event": "flex_call",
                "layer": "layers.15",
                "phase": "backward",
                "path": "dense",
                "cause": "eager_call",
                "scores_bytes": 2_700_000_000,
            },
            cuda={"device": 0, "allocated": 120_000_000_000, "reserved": 130_000_000_000, "peak": 139_000_000_000},
            frames=["train.py:40 in step"],
        ),
        level="error",
    )
    events += [crash, ev("summary", 17, rows=[]), ev("shutdown", 18, reason="exit")]
    rep = as_json(capsys, write(tmp_path / "fg.jsonl", events))
    (c,) = rep["crashes"]
    assert c["kind"] == "crash" and c["crash"]["exc_type"] == "torch.OutOfMemoryError"
    assert [e["seq"] for e in c["last_events"]] == list(range(6, 16))
    assert rep["endings"][0]["ending"] == "crash"

    rc, out, _ = run_cli(capsys, tmp_path / "fg.jsonl")
    section = out.split("CRASH rank 0 (pid 100 on node1)", 1)[1]
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.70 GiB\n" in section
    assert "diagnosis: OOM inside dense backward of layers.15" in section
    assert "CUDA memory: allocated 120.00 GB, reserved 130.00 GB, peak 139.00 GB" in section
    lines = section.split("before the crash", 1)[1].splitlines()[1:]
    assert len(lines) == 10
    assert lines[0].split()[:3] == ["-10.000s", "seq", "6"] and "layers.6 backward" in lines[0]
    assert lines[-1].split()[:3] == ["-1.000s", "seq", "15"]


def test_a_worker_thread_crash_does_not_end_the_run(tmp_path, capsys):
    events = [
        header(),
        dict(
            ev(
                "crash",
                2,
                thread="loader-3",
                where="threading.excepthook",
                exc_type="KeyError",
                message="'img'",
                diagnosis="KeyError; no FlexAttention event was recorded before it",
            ),
            level="error",
        ),
        ev("shutdown", 3, reason="exit"),
    ]
    rep = as_json(capsys, write(tmp_path / "fg.jsonl", events))
    assert rep["endings"][0]["ending"] == "exit after thread crash"
    assert [c["kind"] for c in rep["crashes"]] == ["crash"]
    rc, out, _ = run_cli(capsys, tmp_path / "fg.jsonl")
    assert "ended:    exit after thread crash (rank 0)" in out
    assert "CRASH rank 0 (pid 100 on node1) in thread loader-3" in out and "KeyError: 'img'" in out


def test_a_log_that_just_stops(tmp_path, capsys):
    events = [header()] + [ev("flex_compile", s, layer="l", phase="forward", path="fused", template="cpp") for s in range(2, 9)]
    rc, out, _ = run_cli(capsys, write(tmp_path / "fg.jsonl", events), "--last", "3")
    assert rc == 0 and "ended:    stopped (rank 0)" in out
    assert "STOPPED rank 0 (pid 100 on node1): the log ends at" in out and "without a shutdown event" in out
    lines = out.split("last events (time relative to the last event):", 1)[1].strip().splitlines()
    assert [ln.split()[2] for ln in lines] == ["6", "7", "8"]
    assert "OK: no dense FlexAttention" in out


# -- malformed input ---------------------------------------------------------------------------------


def test_torn_corrupt_foreign_and_unknown_lines_are_counted_never_fatal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report_read, "MAX_LINE", 512)
    path = tmp_path / "fg.jsonl"
    good = [header(), dict(ev("flex_call", 2, phase="forward", path="dense", cause="eager_call"), level="warning")]
    with open(path, "wb") as fh:
        for e in good:
            fh.write(json.dumps(e).encode() + b"\n")
        fh.write(b'{"event": "flex_call", "pha\n')  # line 3: a torn line that a restart closed
        fh.write(b"\n   \n")  # blank lines: nothing
        fh.write(b"[1, 2]\n")  # line 6: JSON, not an event
        fh.write(b"\xff\xfe not utf-8\n")  # line 7
        fh.write(b'{"event": "x", "pad": "' + b"a" * 2000 + b'"}\n')  # line 8: longer than MAX_LINE
        fh.write(json.dumps(ev("from_the_future", 9, shiny=True)).encode() + b"\n")
        fh.write(
            json.dumps(dict(ev("flex_call", 10, phase="backward", path="dense", cause="eager_call"), level="warning")).encode() + b"\n"
        )
        fh.write(b'{"event": "flex_call", "seq": 11, "ph')  # torn last line: the crash
    rep = as_json(capsys, path)
    (f,) = rep["files"]
    assert (f["corrupt_lines"], f["first_corrupt_lines"], f["torn_last_line"], f["oversized_lines"]) == (4, [3, 6, 7, 8], True, 1)
    assert f["events"] == 4 and rep["totals"]["dense_calls"] == 2
    w = " | ".join(rep["warnings"])
    assert "4 corrupt lines skipped (fg.jsonl:3, fg.jsonl:6, fg.jsonl:7, fg.jsonl:8)" in w
    assert "torn last line" in w and "unknown event kinds ignored: from_the_future (1)" in w
    rc, out, _ = run_cli(capsys, path)
    assert rc == 0 and "warning:  4 corrupt lines skipped" in out and "STOPPED" in out


def test_mixed_schema_versions(tmp_path, capsys):
    write(tmp_path / "d" / "a.jsonl", [header(pid=1), dict(ev("flex_call", 2, pid=1, phase="forward", path="dense", cause="eager_call"))])
    write(
        tmp_path / "d" / "b.jsonl",
        [
            header(pid=2, schema=2, new_field={"x": 1}),
            dict(ev("flex_call", 2, pid=2, phase="forward", path="dense", cause="graph_break", extra=[1])),
        ],
    )
    write(tmp_path / "d" / "c.jsonl", [dict(ev("flex_call", 5, pid=3, phase="forward", path="dense", cause="eager_call"))])  # no header
    rep = as_json(capsys, tmp_path / "d")
    assert rep["run"]["schemas"] == {"1": 1, "2": 1, "none": 1}
    w = " | ".join(rep["warnings"])
    assert "mixed schema versions: 1 (1 file), 2 (1 file), none (1 file)" in w
    assert "schema 2 is newer than this report understands (1)" in w
    assert rep["rows"][0]["dense"] == 3 and rep["rows"][0]["causes"] == {"eager_call": 2, "graph_break": 1}


def test_empty_file_empty_directory_missing_path(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    rc, out, err = run_cli(capsys, empty, "--fail-on-dense")
    assert rc == 2 and out == "" and "no fusionguard events in the input" in err and "empty.jsonl: empty" in err

    (tmp_path / "nologs").mkdir()
    (tmp_path / "nologs" / "notes.txt").write_text("hi")
    rc, out, err = run_cli(capsys, tmp_path / "nologs")
    assert rc == 2 and out == "" and f"{tmp_path / 'nologs'}: no fusionguard logs (*.jsonl) in this directory" in err

    rc, out, err = run_cli(capsys, tmp_path / "missing.jsonl")
    assert rc == 2 and "no such file or directory" in err

    assert cli.main(["report"]) == 2  # argparse: PATH is required
    assert cli.main([]) == 2
    capsys.readouterr()


# -- bounded logs: sampler and rotation (fusionguard.eventlog.log) ---------------------------------------------


def test_sampler_keeps_first_events_then_counters_and_loses_no_call(tmp_path, capsys):
    path = tmp_path / "fg.jsonl"
    log = EventLog()
    log.sampler = Sampler(first=3, every=100)
    log.open(str(path), fsync=False)
    log.emit("info", "header", schema=1, hostname="h")
    for i in range(500):
        for layer in ("layers.0", "layers.1"):
            peak = 10_000 if (layer, i) == ("layers.1", 250) else i  # the spike is in a dropped event
            log.emit("info", "layer_memory", layer=layer, phase="forward", path="fused", alloc_delta=i, peak_delta=peak)
    log.emit("warning", "flex_call", layer="layers.0", phase="forward", path="dense", cause="eager_call")
    log.emit("info", "flex_compile", layer="layers.0", phase="forward", path="fused", template="cpp")
    log.emit("info", "layer_memory", layer="layers.0", phase="forward", path="dense", alloc_delta=1, peak_delta=1)
    log.emit("info", "shutdown", reason="exit")  # flushes the pending counters first
    log.close()
    events = read_jsonl(path)
    kinds = [e["event"] for e in events]
    assert kinds.count("layer_memory") == 3 * 2 + 1 and kinds.count("flex_call") == 1 and kinds.count("flex_compile") == 1
    counters = [e for e in events if e["event"] == "fused_calls"]
    assert [c["count"] for c in counters if c["layer"] == "layers.1"] == [100, 100, 100, 100, 97]
    assert max(c["peak_delta_max"] for c in counters if c["layer"] == "layers.1") == 10_000
    assert kinds.index("shutdown") == len(kinds) - 1
    rep = as_json(capsys, path)
    rows = {(r["layer"], r["phase"]): r for r in rep["rows"]}
    assert rows[("layers.1", "forward")]["fused"] == 500
    assert rows[("layers.1", "forward")]["peak_delta_max"] == 10_000
    assert rows[("layers.0", "forward")]["dense"] == 1

    keep = tmp_path / "all.jsonl"
    log = EventLog()
    log.sampler = Sampler(keep_all=True)
    log.open(str(keep), fsync=False)
    for i in range(300):
        log.emit("info", "layer_memory", layer="l", phase="forward", path="fused", alloc_delta=i, peak_delta=i)
    log.close()
    assert len(read_jsonl(keep)) == 300


def test_size_rotation_keeps_backups_and_report_reads_them_in_order(tmp_path, capsys):
    path = tmp_path / "logs" / "fg.jsonl"
    log = EventLog()
    log.open(str(path), fsync=False, max_bytes=4000, backups=2)
    log.emit("info", "header", schema=1, hostname="h", fusionguard="0.1.0", torch="2.13.0", triton=None, python="3")
    for i in range(300):
        log.emit("warning", "flex_call", layer=f"layers.{i % 4}", phase="forward", path="dense", cause="eager_call")
    log.emit("info", "shutdown", reason="disable")
    rotations = log.sink.rotations
    log.close()
    parts = sorted(p.name for p in path.parent.iterdir())
    assert parts == ["fg.jsonl", "fg.jsonl.1", "fg.jsonl.2", "fg.jsonl.lock"] and rotations > 3
    kept = []
    for name in ("fg.jsonl.2", "fg.jsonl.1", "fg.jsonl"):
        p = path.parent / name
        assert p.stat().st_size <= 4000
        events = read_jsonl(p)
        assert events[0]["event"] == "header"
        if name != "fg.jsonl.2":
            assert events[0]["rotated"] is True
        kept += [e for e in events if e["event"] != "header"]
    seqs = [e["seq"] for e in kept]
    assert seqs == sorted(seqs) and seqs[-1] == 302, "oldest part first, nothing out of order"
    rep = as_json(capsys, path)  # the file alone: its rotated parts are named, not read
    assert len(rep["files"]) == 1
    assert "fg.jsonl has rotated parts (fg.jsonl.1 ...) that were not read: pass its directory" in rep["warnings"][0]
    rep = as_json(capsys, path.parent)
    assert [f["path"].rsplit("/", 1)[1] for f in rep["files"]] == ["fg.jsonl.2", "fg.jsonl.1", "fg.jsonl"]
    assert rep["totals"]["dense_calls"] == len(kept) - 1
    assert rep["endings"][0]["ending"] == "disable"


# -- bounded memory, entry points ------------------------------------------------------------------


def test_reading_is_streaming_and_bounded(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        for s in range(30_000):
            e = ev(
                "layer_memory", s, layer=f"layers.{s % 8}", phase="forward", path="fused", alloc_delta=s, peak_delta=s * 2, pad="x" * 150
            )
            fh.write(json.dumps(e) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        rep = build_report_dict([str(path)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rep["totals"]["fused_calls"] == 30_000
    assert rep["rows"][0]["alloc_delta_max"] == 29_992 and rep["rows"][0]["memory_samples"] == 3_750
    assert peak < size / 3 and peak < 3_000_000, (peak, size)
    r = Reservoir(cap=100)
    for x in range(10_000):
        r.add(x)
    assert len(r.sample) == 100 and r.max == 9_999 and 2_500 < r.median() < 7_500


def test_python_dash_m_and_console_script(tmp_path):
    path = write(tmp_path / "fg.jsonl", [header(), dict(ev("flex_call", 2, phase="forward", path="dense", cause="eager_call"))])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [sys.executable, "-m", "fusionguard", "report", str(path), "--format", "csv"], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == ",".join(CSV_COLUMNS)
    script = Path(sys.executable).parent / "fusionguard"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    p = subprocess.run([str(script), "report", str(path), "--fail-on-dense"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 1 and "DENSE: 1 dense FlexAttention call in 1 layer/phase pair" in p.stdout


REPORT_MODULES = ("read", "aggregate", "build", "render", "chart", "plot", "html")
# Each module imported first and alone: the package's __init__ (which imports them all, in order)
# is replaced by a bare package, so a module needing one that needs it back fails here.
_IMPORT_ALONE = """
import importlib, os, sys, types
import fusionguard
pkg = types.ModuleType("fusionguard.report")
pkg.__path__ = [os.path.join(os.path.dirname(fusionguard.__file__), "report")]
sys.modules["fusionguard.report"] = pkg
importlib.import_module("fusionguard.report." + sys.argv[1])
print(sorted(m for m in ("fusionguard.report." + n for n in %r) if m in sys.modules))
print([m for m in ("torch", "matplotlib") if m in sys.modules])
""" % (REPORT_MODULES,)


def test_each_report_module_imports_alone_and_none_imports_torch():
    """No import cycle inside fusionguard.report: each module imports in a fresh interpreter
    with only the modules before it (read < aggregate < build < render < chart < plot < html); the whole
    package too, and none of it imports torch or matplotlib (``fusionguard report`` starts fast)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs = {name: [sys.executable, "-c", _IMPORT_ALONE, name] for name in REPORT_MODULES}
    runs["(package)"] = [
        sys.executable,
        "-c",
        "import sys, fusionguard.report; print([m for m in ('torch', 'matplotlib') if m in sys.modules])",
    ]
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for name, cmd in runs.items()}
    for i, name in enumerate(REPORT_MODULES):
        out, err = procs[name].communicate(timeout=120)
        assert procs[name].returncode == 0, f"fusionguard.report.{name} does not import alone:\n{err}"
        loaded, heavy = (ast.literal_eval(line) for line in out.splitlines())
        below = {f"fusionguard.report.{m}" for m in REPORT_MODULES[: i + 1]}
        assert f"fusionguard.report.{name}" in loaded and set(loaded) <= below, (name, loaded)
        assert heavy == [], (name, heavy)
    out, err = procs["(package)"].communicate(timeout=120)
    assert procs["(package)"].returncode == 0 and out.strip() == "[]", (out, err)


@pytest.mark.slow
def test_fused_runs_of_a_compiled_flex_are_counted_exactly(guard, capsys, dynamo_reset):
    """Per-call evidence from compiled graphs (flex_run, sampled into counters) reaches the report."""
    import torch

    log = guard(fused_first=2, fused_every=5)
    q, k, v = qkv(L=64, HQ=4, HKV=2)
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, enable_gqa=True))
    for _ in range(15):
        fn(q, k, v)
    from fusionguard import disable

    disable()
    rep = as_json(capsys, log)
    assert not [w for w in rep["warnings"] if "unknown event kinds" in w]
    (row,) = [r for r in rep["rows"] if r["phase"] == "forward"]
    assert row["fused"] == 15 and row["dense"] == 0 and row["compiles"] == 1


def test_graph_runs_and_layer_records_of_the_same_calls_are_not_added(tmp_path, capsys):
    events = [
        header(),
        # one graph holding two layers' calls, run 3 times: 2 kept, then a counter for 1 run
        ev("flex_run", 2, layer=None, layers=["a", "b"], phase="forward", path="fused", flex_calls=2),
        ev("flex_run", 3, layer=None, layers=["a", "b"], phase="forward", path="fused", flex_calls=2),
        ev("fused_calls", 4, layer=None, phase="forward", path="fused", of="flex_run", count=1, total=3, flex_calls=2),
        # a watched eager layer calling a compiled flex: its layer_memory and its flex_run are one call
        ev("layer_memory", 5, layer="c", phase="forward", path="fused", alloc_delta=1, peak_delta=2),
        ev("flex_run", 6, layer="c", phase="forward", path="fused", flex_calls=1),
        ev("flex_call", 7, layer="d", phase="forward", path="rescued", cause="eager_call"),
    ]
    rep = as_json(capsys, write(tmp_path / "fg.jsonl", events))
    rows = {(r["layer"], r["phase"]): r for r in rep["rows"]}
    # the kept runs name one call per layer; the counter names none
    assert rows[("a", "forward")]["fused"] == 2 and rows[("b", "forward")]["fused"] == 2
    assert rows[(NO_LAYER, "forward")]["fused"] == 2
    assert rows[("c", "forward")]["fused"] == 1
    assert rows[("d", "forward")]["fused"] == 1 and rows[("d", "forward")]["dense"] == 0
    assert rep["totals"]["fused_calls"] == 6 + 1 + 1


def test_repeated_dense_calls_are_sampled_and_counted_exactly(guard, capsys):
    """A loop running one dense call: the first dense_first events in full, the rest in
    dense_calls counters; summary(), the report and the counters agree on every call."""
    import fusionguard

    log = guard(dense_first=3, dense_every=10, flush_interval=0)  # exact counter cadence: no timed flush
    q, k, v = qkv()
    for _ in range(25):
        flex_attention(q, k, v)  # one call site, layer, phase, cause and action
    flex_attention(q, k, v)  # another call site: its own first event
    rows = fusionguard.summary()  # flushes the pending counter first
    fusionguard.disable()
    events = read_jsonl(log)
    full = [e for e in events if e["event"] == "flex_call"]
    counters = [e for e in events if e["event"] == "dense_calls"]
    assert len(full) == 4 and len({e["call_site"]["line"] for e in full}) == 2
    assert [(c["count"], c["total"]) for c in counters] == [(10, 13), (10, 23), (2, 25)]
    first = full[0]
    for c in counters:
        assert c["level"] == "warning" and c["path"] == "dense" and c["of"] == "flex_call"
        assert (c["cause"], c["action"], c["call_site"]) == (first["cause"], first["action"], first["call_site"])
        assert c["scores_bytes_max"] == first["scores_bytes"]
    summary_event = [e for e in events if e["event"] == "summary"][-1]
    assert events.index(counters[-1]) < events.index(summary_event), "counters flushed before the summary"
    rep = as_json(capsys, log)
    assert [r["dense"] for r in rep["rows"]] == [26]
    assert rep["rows"][0]["causes"] == {"eager_call": 26}
    # no layer (no module made the calls): summary() has the row the report has (#24)
    assert [(r["layer"], r["phase"], r["dense"], r["causes"]) for r in rows] == [(NO_LAYER, "forward", 26, {"eager_call": 26})]
    assert summary_event["rows"] == list(rows)


def test_keep_all_and_blocked_calls_are_never_sampled(guard):
    import fusionguard
    from fusionguard.errors import DenseFallbackError

    guard(dense_first=1, keep_all=True)
    q, k, v = qkv()
    for _ in range(5):
        flex_attention(q, k, v)
    assert len(fusionguard.events("flex_call")) == 5
    fusionguard.disable()
    guard(strict=True, dense_first=1)
    for _ in range(3):
        with pytest.raises(DenseFallbackError):
            flex_attention(q, k, v)
    blocked = [e for e in fusionguard.events("flex_call") if e["action"] == "raise"]
    assert len(blocked) == 3


def test_sampled_forwards_never_lend_a_counter_seq_to_their_backward(guard):
    """A dense forward folded into a counter has no event of its own: its backward's
    forward_seq is null, never the seq of the counter line that replaced it."""
    from conftest import op_call

    import fusionguard

    guard(dense_first=2, dense_every=1)  # from the third call of a site on, each call is a counter
    outs = []
    for i in range(3):
        q, k, v = qkv(requires_grad=True, seed=i)
        outs.append(op_call(q, k, v)[0])
    outs[-1].sum().backward()  # the first backward of its site: logged in full
    events = fusionguard.events()
    (counter,) = [e for e in events if e["event"] == "dense_calls"]
    (backward,) = [e for e in events if e["event"] == "flex_call" and e["phase"] == "backward"]
    assert counter["phase"] == "forward" and backward["forward_seq"] is None


def test_the_overflow_bucket_names_no_cause_or_site():
    log = EventLog()
    log.sampler = Sampler(dense_first=1, dense_every=0, max_keys=1)
    site = {"file": "x.py", "line": 1, "function": "f"}
    for cause, line in (("eager_call", 1), ("recompile_limit", 2), ("graph_break", 3), ("graph_break", 3)):
        log.emit(
            "warning",
            "flex_call",
            path="dense",
            phase="forward",
            layer=None,
            cause=cause,
            action="warn",
            call_site=dict(site, line=line),
            traced=False,
        )
    log.flush_sampler()
    (counter,) = [e for e in log.memory if e["event"] == "dense_calls"]
    assert counter["layer"] == "(other)" and counter["count"] == 2
    assert counter["cause"] is None and counter["call_site"] is None


def test_rank_is_read_again_once_torchrun_sets_it(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    log = EventLog()
    assert log.emit("info", "x")["rank"] == 0
    monkeypatch.setenv("RANK", "3")
    assert log.emit("info", "x")["rank"] == 3


# -- #27 part 5: what people read is true ------------------------------------------------------------


def _report_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "fusionguard", "report", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_plot_in_a_format_matplotlib_cannot_write_exits_2_with_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    run = _two_ranks(tmp_path)
    p = _report_cli(run, "--plot", "p.txt", cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith("fusionguard report: --plot p.txt: matplotlib cannot write a .txt file; use one of ") and ".png" in line
    assert not (tmp_path / "p.txt").exists()


def test_plot_says_the_file_it_wrote(tmp_path):
    pytest.importorskip("matplotlib")
    run = _two_ranks(tmp_path)
    (tmp_path / "plots").mkdir()
    for arg, written in (
        ("plots", "plots/fusionguard.png"),
        ("plots/", "plots/fusionguard.png"),
        ("layers", "layers.png"),
        ("chart.svg", "chart.svg"),
    ):
        p = _report_cli(run, "--plot", arg, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        (line,) = [x for x in p.stderr.splitlines() if "plot written to" in x]
        assert line.startswith(f"fusionguard report: plot written to {os.path.join(*written.split('/'))}"), (arg, line)
        head = (tmp_path / written).read_bytes()[:64]
        assert head.startswith(b"\x89PNG") if written.endswith(".png") else b"<svg" in (tmp_path / written).read_bytes()[:2000], arg
    assert not (tmp_path / "plots.png").exists()


def test_the_devices_line_of_512_hosts_is_counted_by_kind_and_json_keeps_every_host(tmp_path, capsys):
    for i in range(512):
        names = ["NVIDIA H200"] * 8 if i < 510 else ["NVIDIA A100-SXM4-80GB"] * 4
        cuda = {"available": True, "count": len(names), "version": "13.0", "devices": names}
        write(
            tmp_path / "logs" / f"r{i}.jsonl",
            [{**header(pid=1000 + i, rank=i, host=f"gpu-node-{i:04d}.cluster.example.com"), "cuda": cuda, "world_size": 512}],
        )
    rc, out, err = run_cli(capsys, tmp_path / "logs")
    assert rc == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("  devices:")]
    assert line == "  devices:  4,080× NVIDIA H200, 8× NVIDIA A100-SXM4-80GB on 512 hosts (per host: --format json)"
    rep = as_json(capsys, tmp_path / "logs")
    assert len(rep["run"]["devices"]) == 512 and rep["run"]["devices"]["gpu-node-0511.cluster.example.com"] == ["NVIDIA A100-SXM4-80GB"] * 4
    # a few hosts: each one, as before
    rc, out, _ = run_cli(capsys, *[tmp_path / "logs" / f"r{i}.jsonl" for i in (0, 511)])
    assert (
        "  devices:  gpu-node-0000.cluster.example.com: 8× NVIDIA H200; gpu-node-0511.cluster.example.com: 4× NVIDIA A100-SXM4-80GB" in out
    )


# -- #25 part 4: the prediction and the oom mode's blocks -------------------------------------------


def test_the_dense_prediction_of_a_real_call_is_kept_per_row(guard, capsys):
    """A real dense call in the oom mode (CPU: nothing known not to fit, so it warns and runs):
    its ``predicted_bytes`` is the row's ``predicted_bytes_max``; nothing counts as oom-blocked."""
    log = guard(mode="oom")
    q, k, v = qkv(L=16, KV=24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_attention(q, k, v)
    import fusionguard

    (e,) = fusionguard.events("flex_call")
    fusionguard.disable()
    rep = as_json(capsys, log)
    (row,) = rep["rows"]
    assert row["predicted_bytes_max"] == e["predicted_bytes"] > row["scores_bytes_max"]
    assert rep["totals"]["predicted_bytes_max"] == e["predicted_bytes"]
    assert (row["oom_blocked"], rep["totals"]["oom_blocked_calls"], rep["oom"]["blocked"]) == (0, 0, 0)
    rc, out, _ = run_cli(capsys, log)
    assert rc == 0 and "oom mode" not in out


def test_a_call_the_oom_mode_blocked_reads_apart_from_a_strict_block(tmp_path, capsys):
    """CPU has no free_bytes: the oom-blocked call is a log line as a CUDA run writes it."""
    dense = dict(
        phase="backward", path="dense", cause="eager_call", action="raise", allowed=False, call_site=SITE, scores_bytes=4_000_000_000
    )
    log = write(
        tmp_path / "fg.jsonl",
        [
            header(),
            ev("flex_call", 2, layer="layers.0", **{**dense, "phase": "forward"}, predicted_bytes=3_000_000_000, free_bytes=None),  # strict
            ev("flex_call", 3, layer="layers.1", **dense, predicted_bytes=9_100_000_000, free_bytes=4_000_000_000, blocked_by="oom"),
            ev("flex_call", 4, layer="layers.1", **dense, predicted_bytes=7_000_000_000, free_bytes=5_000_000_000, blocked_by="oom"),
            ev(
                "dense_calls",
                5,
                layer="layers.1",
                phase="backward",
                path="dense",
                cause="eager_call",
                action="warn",
                count=3,
                total=4,
                predicted_bytes_max=9_900_000_000,
                scores_bytes_max=4_000_000_000,
            ),
            ev("shutdown", 6, reason="exit"),
        ],
    )
    rep = as_json(capsys, log)
    t = rep["totals"]
    assert (t["blocked_calls"], t["oom_blocked_calls"], t["predicted_bytes_max"]) == (3, 2, 9_900_000_000)
    rows = {(r["layer"], r["phase"]): r for r in rep["rows"]}
    assert (rows[("layers.0", "forward")]["oom_blocked"], rows[("layers.1", "backward")]["oom_blocked"]) == (0, 2)
    assert rows[("layers.1", "backward")]["predicted_bytes_max"] == 9_900_000_000  # the sampled counter's max too
    assert rep["oom"] == {
        "blocked": 2,
        "needed_bytes": 9_100_000_000,
        "free_bytes": 4_000_000_000,
        "layer": "layers.1",
        "phase": "backward",
        "call_site": "train.py:7 in attention",
    }
    rc, out, _ = run_cli(capsys, log)
    assert rc == 0
    assert "DENSE: 6 dense FlexAttention calls (3 blocked)" in out
    assert (
        "oom mode: 2 dense call(s) blocked, predicted not to fit (needed 9.10 GB, the device could give 4.00 GB; "
        "layers.1 backward at train.py:7 in attention)"
    ) in out
