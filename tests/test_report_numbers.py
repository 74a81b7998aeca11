"""The numbers of ``fusionguard report`` (#32): any value in any field of any event kind gives a
report or a usage error, never a traceback; totals are exact past the listed examples' cap;
a process's own final counts are taken when rotation dropped its early lines, and the lines
missing from the logs are said."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fusionguard import cli
from fusionguard.eventlog.kinds import KNOWN_EVENTS


def ev(kind, seq, pid=100, rank=0, **fields):
    return {
        "event": kind,
        "level": "info",
        "ts": 1_800_000_000.0 + seq,
        "seq": seq,
        "pid": pid,
        "rank": rank,
        "thread": "MainThread",
        **fields,
    }


def header(pid=100, rank=0, host="node1"):
    return ev(
        "header",
        1,
        pid=pid,
        rank=rank,
        schema=1,
        fusionguard="0.1.0",
        torch="2.13.0",
        triton="3.6.0",
        python="3.11.7",
        hostname=host,
        cuda={"available": False},
        world_size=1,
        local_rank=rank,
    )


def write(path, events):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for e in events:
            fh.write((e if isinstance(e, str) else json.dumps(e)) + "\n")
    return path


def report(capsys, *args):
    rc = cli.main(["report", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


HUGE = 10**400  # valid JSON; above float's range (about 1.8e308)


@pytest.mark.parametrize(
    "kind,field",
    [
        ("flex_call", "predicted_bytes"),
        ("flex_call", "free_bytes"),
        ("mask_build", "estimated_bytes"),
        ("mask_builds", "estimated_bytes_max"),
    ],
)
def test_a_huge_integer_in_a_byte_field_is_never_a_traceback(kind, field, tmp_path, capsys):
    fields = dict(
        layer="a",
        phase="forward",
        path="dense",
        cause="eager_call",
        action="raise",
        blocked_by="oom",
        predicted_bytes=10,
        free_bytes=5,
        estimated_bytes=10,
        estimated_bytes_max=10,
        count=2,
    )
    fields[field] = HUGE
    log = write(tmp_path / "fg.jsonl", [header(), ev(kind, 2, **fields), ev("shutdown", 3, reason="exit")])
    for fmt in ("text", "json", "csv"):
        rc, out, err = report(capsys, log, "--format", fmt, "--html", tmp_path / "r.html")
        assert rc == 0 and "Traceback" not in err, (fmt, err)
        assert page_ok(tmp_path / "r.html")
    rep = json.loads(report(capsys, log, "--format", "json")[1])
    assert any(w.startswith("1 corrupt line skipped") for w in rep["warnings"]), rep["warnings"]


def page_ok(path):
    return path.read_text(encoding="utf-8").rstrip().endswith("</html>")


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: Every field a report reads, of every kind (the aggregation, the renderers, the page).
FIELDS = sorted(
    {
        "event",
        "level",
        "ts",
        "seq",
        "pid",
        "rank",
        "thread",
        "hostname",
        "layer",
        "layers",
        "phase",
        "path",
        "cause",
        "action",
        "allowed",
        "blocked_by",
        "scores_bytes",
        "scores_bytes_max",
        "predicted_bytes",
        "predicted_bytes_max",
        "free_bytes",
        "estimated_bytes",
        "estimated_bytes_max",
        "count",
        "total",
        "flex_calls",
        "of",
        "rows",
        "call_site",
        "cuda",
        "last_flex",
        "message",
        "exc_type",
        "where",
        "diagnosis",
        "frames",
        "counts",
        "causes",
        "alloc_delta",
        "peak_delta",
        "alloc_delta_max",
        "alloc_delta_last",
        "peak_delta_max",
        "peak_delta_last",
        "recompute",
        "reason",
        "schema",
        "template",
        "source",
        "function",
        "file",
        "line",
        "compiles",
        "limit",
        "varies",
        "fix",
        "model",
        "attn_implementation",
        "crash_file",
        "forked_from",
        "world_size",
        "local_rank",
        "fusionguard",
        "torch",
        "triton",
        "python",
        "error",
        "kind",
        "shape",
        "devices",
        "fused",
        "dense",
    }
)

_SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, -1, -(2**70), 2**63, 10**400, -(10**400)])
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e308, -1e308, 5e-324])
    | st.text(max_size=6)
    | st.sampled_from(["dense", "fused", "raise", "oom", "forward"])
)


def _nested(children):
    return st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(FIELDS), children, max_size=3)


_VALUES = st.recursive(_SCALARS, _nested, max_leaves=6)
SITE = {"file": "train.py", "line": 7, "function": "f"}
_ROW = {
    "layer": "a",
    "phase": "forward",
    "fused": 3,
    "dense": 2,
    "causes": {"eager_call": 2},
    "rank": 0,
    "scores_bytes": 10,
    "alloc_delta_max": 5,
    "alloc_delta_last": 4,
    "peak_delta_max": 9,
    "peak_delta_last": 8,
}
#: A plausible event of each kind, each field one the report reads: the property test replaces
#: or removes some of them, so every code path meets every kind of hostile value.
BASE = {
    "flex_call": dict(
        layer="a",
        phase="forward",
        path="dense",
        cause="eager_call",
        action="raise",
        allowed=False,
        blocked_by="oom",
        scores_bytes=100,
        predicted_bytes=200,
        free_bytes=50,
        call_site=SITE,
    ),
    "dense_calls": dict(
        layer="a",
        phase="backward",
        path="dense",
        cause="eager_call",
        action="warn",
        count=5,
        total=15,
        scores_bytes_max=100,
        predicted_bytes_max=300,
    ),
    "flex_run": dict(layer=None, layers=["a", "b"], phase="forward", path="fused", flex_calls=2),
    "fused_calls": dict(
        layer="a",
        phase="forward",
        path="fused",
        of="flex_run",
        count=4,
        total=8,
        flex_calls=4,
        alloc_delta_max=5,
        alloc_delta_last=4,
        peak_delta_max=9,
        peak_delta_last=8,
    ),
    "flex_compile": dict(layer="a", phase="forward", path="fused", template="cpp", source="lowering"),
    "flex_inlined": dict(layer="a", phase="forward"),
    "layer_memory": dict(layer="a", phase="forward", path="fused", alloc_delta=10, peak_delta=20, recompute=False),
    "summary": dict(rows=[_ROW, dict(_ROW, rank=3)], counts={"dense_forward": 2}),
    "shutdown": dict(reason="exit", counts={"dense_forward": 2}),
    "crash": dict(
        exc_type="RuntimeError",
        message="boom\nline 2",
        where="sys.excepthook",
        diagnosis="oom",
        last_flex={"event": "flex_call", "path": "dense", "scores_bytes": 5, "call_site": SITE},
        cuda={"allocated": 1, "reserved": 2, "peak": 3},
        frames=["a.py:1 in f"],
    ),
    "recompile_pressure": dict(file="train.py", line=9, function="f", compiles=4, limit=8, varies="q dim 2", reason="r", fix="x"),
    "no_flex_calls": dict(model="Llama", attn_implementation="sdpa"),
    "mask_build": dict(path="dense", action="raise", estimated_bytes=1000, call_site=SITE, shape=[1, 1, 8, 8], kind="block_mask"),
    "mask_builds": dict(path="dense", action="warn", count=3, estimated_bytes_max=2000, call_site=SITE),
    "header": dict(
        schema=1,
        fusionguard="0.1.0",
        torch="2.13.0",
        triton=None,
        python="3.11",
        hostname="h",
        cuda={"available": True, "count": 1, "devices": ["H200"]},
        world_size=2,
        local_rank=0,
        crash_file="x.crash",
        forked_from=7,
    ),
    "internal_error": dict(where="guard", error="E"),
    "recompile_limit": dict(function="f", reason="r"),
    "graph_break": dict(function="f", reason="r"),
    "compile_error": dict(function="f", error="e"),
}
_HOSTILE = st.sampled_from([None, True, -1, -(2**70), 2**63, 10**400, -(10**400), math.nan, math.inf, -math.inf, 1e308, "x", [], {}])


def _event(kind):
    own = sorted(BASE.get(kind, {})) or FIELDS
    keys = st.sampled_from(own) | st.sampled_from(FIELDS)
    return st.tuples(st.just(kind), st.dictionaries(keys, _HOSTILE | _VALUES, max_size=3), st.sets(st.sampled_from(own), max_size=2))


_EVENT = st.sampled_from(sorted(KNOWN_EVENTS)).flatmap(_event)


def _dumps(e):
    return json.dumps(e, allow_nan=True, default=str)  # big ints exactly, NaN / Infinity as Python writes them


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(_EVENT, min_size=1, max_size=6))
@example([("flex_call", {"predicted_bytes": 10**400}, set())])  # the cases, always tried
@example([("flex_call", {"free_bytes": 10**400}, set())])
@example([("mask_build", {"estimated_bytes": 10**400}, set())])
@example([("mask_builds", {"estimated_bytes_max": 10**400}, set())])
def test_any_value_in_any_field_of_any_kind_is_a_report_or_exit_2(tmp_path, capsys, events):
    """Wrong types, huge, negative, NaN, missing: text, JSON, CSV and HTML never raise, exit 0 or 2."""
    lines = [header()]
    for i, (kind, fields, missing) in enumerate(events):
        e = {"event": kind, "ts": 1_800_000_000.0 + i, "seq": 2 + i, "pid": 100, "rank": 0, **BASE.get(kind, {}), **fields}
        for k in missing:
            e.pop(k, None)
        lines.append(_dumps(e))
    log = write(tmp_path / "fg.jsonl", lines)
    page = tmp_path / "r.html"
    for fmt in ("text", "json", "csv"):
        rc, out, err = report(capsys, log, "--format", fmt, *(("--html", page) if fmt == "text" else ()))
        assert rc in (0, 2) and "Traceback" not in err, err
        out.encode("utf-8")
    assert page_ok(page)


# -- 6. totals past the listed examples' cap ----------------------------------------------------------------


def test_totals_are_exact_past_the_listed_examples_cap(tmp_path, capsys):
    n = 40_000
    events = [header()]
    for i in range(n):
        events.append(ev("recompile_pressure", 2 + 2 * i, file="train.py", line=i, function=f"f{i}", compiles=4, limit=8, reason="r"))
        events.append(ev("no_flex_calls", 3 + 2 * i, model=f"Model{i}", attn_implementation="sdpa"))
    log = write(tmp_path / "fg.jsonl", events)
    rc, out, err = report(capsys, log, "--format", "json")
    rep = json.loads(out)
    assert rep["totals"]["recompile_pressure_frames"] == n and rep["totals"]["no_flex_models"] == n
    assert len(rep["recompile_pressure"]) <= 10_000 and len(rep["no_flex_calls"]) <= 10_000  # the examples are capped
    rc, out, err = report(capsys, log)
    assert "recompile pressure: 40,000 frames at 4 of 8 compiles" in out and "... and 39,990 more frame(s)" in out, out[:2000]
    assert "no FlexAttention: 40,000 watched models" in out and "... and 39,990 more model(s)" in out
    rc, _, err = report(capsys, log, "--fail-on-recompile-pressure")
    assert rc == 1 and "40,000 frames holding FlexAttention" in err


def test_past_the_distinct_key_bound_the_total_is_a_lower_bound_with_a_warning(tmp_path, capsys, monkeypatch):
    from fusionguard.report import aggregate

    monkeypatch.setattr(aggregate, "MAX_DISTINCT", 1000)  # a million in use; 1,000 keeps the test fast
    monkeypatch.setattr(aggregate, "MAX_KEYS", 100)  # (examples listed: 10,000 in use)
    events = [header()] + [ev("recompile_pressure", 2 + i, file="t.py", line=i, function="f", compiles=4, limit=8) for i in range(1500)]
    rep = json.loads(report(capsys, write(tmp_path / "fg.jsonl", events), "--format", "json")[1])
    assert rep["totals"]["recompile_pressure_frames"] == 1000 and rep["totals"]["recompile_pressure_frames_at_least"] is True
    assert any("at least 1,000 recompile-pressure frames" in w for w in rep["warnings"]), rep["warnings"]
    text = report(capsys, write(tmp_path / "fg.jsonl", events))[1]
    assert "recompile pressure: at least 1,000 frames" in text and "... and at least 990 more frame(s)" in text


# -- 5. rotation: the processes' own final counts, and the lines missing --------------------------------

ROTATING_WORKER = """
import sys, warnings
import torch
import fusionguard
from torch.nn.attention.flex_attention import flex_attention
fusionguard.enable(log_path=sys.argv[1], keep_all=True, log_max_bytes=int(sys.argv[3]))
q = torch.randn(1, 1, 8, 4)
if len(sys.argv) > 4:  # a start line: the processes write at the same time, as the issue's did
    import os, pathlib, time
    pathlib.Path(sys.argv[4], f"ready.{os.getpid()}").touch()
    while not os.path.exists(os.path.join(sys.argv[4], "go")):
        time.sleep(0.01)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _ in range(int(sys.argv[2])):
        flex_attention(q, q, q)
if len(sys.argv) > 5:  # a finish line: no summary (written at exit) before every process's calls are done
    pathlib.Path(sys.argv[4], f"done.{os.getpid()}").touch()
    deadline = time.monotonic() + 240
    while len(list(pathlib.Path(sys.argv[4]).glob("done.*"))) < int(sys.argv[5]) and time.monotonic() < deadline:
        time.sleep(0.01)
"""


def test_after_rotation_each_process_counts_its_own_calls_and_the_missing_lines_are_said(tmp_path, capsys):
    """The issue's run, smaller: processes sharing one rotating log (default 3 backups) with every
    dense call logged; rotation prunes the oldest lines. Each process's own summary says how many
    calls it made; its seq gaps are the pruned parts of the same path, so the report takes them
    and says how many lines are missing (text, JSON, HTML)."""
    import subprocess
    import sys

    import forkserver  # (processes of their own, not fresh interpreters: tests/forkserver.py)
    from conftest import child_env

    procs, calls = 2, 150
    log = tmp_path / "logs" / "fg.jsonl"
    log.parent.mkdir()
    start = tmp_path / "start"
    start.mkdir()
    ps = [
        forkserver.popen(
            [sys.executable, "-c", ROTATING_WORKER, str(log), str(calls), "16384", str(start), str(procs)],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(procs)
    ]
    # (together, and each writes its summary only once all are done: a process whose summary came
    # before another's last ~64 KB of lines would have it pruned by that one's rotation, and no log
    # could say it existed; CI's load did that twice, once with the start line alone)
    import time

    deadline = time.monotonic() + 240
    while len(list(start.glob("ready.*"))) < procs and time.monotonic() < deadline and all(p.poll() is None for p in ps):
        time.sleep(0.05)
    (start / "go").touch()
    for p in ps:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    assert (tmp_path / "logs" / "fg.jsonl.3").exists()
    rep = json.loads(report(capsys, log.parent, "--format", "json")[1])
    assert rep["totals"]["dense_calls"] == procs * calls, rep["totals"]
    missing = rep["run"]["missing_lines"]
    assert missing > 0 and sum(e["missing_lines"] for e in rep["endings"]) == missing
    said = [w for w in rep["warnings"] if "missing" in w]
    assert said and f"{missing:,} log lines missing" in said[0] and "own final counts" in said[0], rep["warnings"]
    text = report(capsys, log.parent)[1]
    assert f"DENSE: {procs * calls:,} dense FlexAttention calls" in text and f"{missing:,} log lines missing" in text
    page = tmp_path / "r.html"
    report(capsys, log.parent, "--html", page)
    assert f"{missing:,} log lines missing" in page.read_text(encoding="utf-8")


def test_a_gap_that_rotation_does_not_explain_is_said_and_the_summary_adds_nothing(tmp_path, capsys):
    """A line lost in the middle (a failed write) of a log that never rotated: the summary rows
    could count calls of an earlier log of the same process, so they add nothing; the gap is said."""
    row = {"layer": "a", "phase": "forward", "fused": 0, "dense": 9, "causes": {"eager_call": 9}, "rank": 0}
    events = [header()] + [
        dict(ev("flex_call", s, layer="a", phase="forward", path="dense", cause="eager_call", action="warn"), level="warning")
        for s in (2, 3, 5, 6)
    ]
    events += [ev("summary", 7, rows=[row]), ev("shutdown", 8, reason="exit")]
    rep = json.loads(report(capsys, write(tmp_path / "fg.jsonl", events), "--format", "json")[1])
    assert rep["totals"]["dense_calls"] == 4 and rep["run"]["missing_lines"] == 1
    assert any("1 log line missing" in w and "no final summary covers them" in w for w in rep["warnings"]), rep["warnings"]


def test_a_notebooks_enable_cycles_over_several_log_paths_are_not_missing_lines(tmp_path, capsys):
    """One process, ``enable()`` / ``disable()`` cycles switching log paths (a notebook): its seq
    runs on across them, so each file has gaps before its headers; they went to the other file
    (or to none: ``log_path=False``), nothing is missing. A lost line inside a session still is."""

    def session(first, calls):
        out = [dict(header(), seq=first)]
        out += [
            dict(
                ev("flex_call", first + i + 1, layer="a", phase="forward", path="dense", cause="eager_call", action="warn"), level="warning"
            )
            for i in range(calls)
        ]
        return out + [ev("summary", first + calls + 1, rows=[]), ev("shutdown", first + calls + 2, reason="disable")]

    a = session(1, 2) + session(13, 2)  # 1-5 and 13-17 in a.jsonl
    b = session(6, 1)  # 6-9 in b.jsonl; 10-12: a log_path=False session
    write(tmp_path / "a.jsonl", a)
    write(tmp_path / "b.jsonl", b)
    rep = json.loads(report(capsys, tmp_path, "--format", "json")[1])
    assert rep["run"]["missing_lines"] == 0 and not any("missing" in w for w in rep["warnings"]), rep["warnings"]
    assert rep["totals"]["dense_calls"] == 5
    rep = json.loads(report(capsys, tmp_path / "b.jsonl", "--format", "json")[1])
    assert rep["run"]["missing_lines"] == 0, rep["warnings"]
    write(tmp_path / "a.jsonl", [e for e in a if e["seq"] != 15])  # a failed write inside a session
    rep = json.loads(report(capsys, tmp_path, "--format", "json")[1])
    assert rep["run"]["missing_lines"] == 1 and any("1 log line missing" in w for w in rep["warnings"]), rep["warnings"]


def test_a_rotated_logs_summary_gives_its_causes_their_own_final_counts(tmp_path, capsys):
    """A log whose early lines rotation pruned (its part starts with the header's copy): the
    process's summary row is its own final count, causes and largest score matrix included (10
    eager calls, 3 lines left; a cause the lines outnumber keeps their count)."""
    causes = {"eager_call": 10, "graph_break": 1}
    row = {"layer": "a", "phase": "forward", "fused": 0, "dense": 10, "causes": causes, "rank": 0, "scores_bytes": 8192}
    events = [dict(header(), rotated=True)] + [  # (the copy keeps the header's seq, 1)
        dict(ev("flex_call", s, layer="a", phase="forward", path="dense", cause="eager_call", action="warn"), level="warning")
        for s in (51, 52, 53)
    ]
    events[-1].update(cause="graph_break", scores_bytes=1024)
    events[-2]["cause"] = "graph_break"
    events += [ev("summary", 54, rows=[row]), ev("shutdown", 55, reason="exit")]
    rep = json.loads(report(capsys, write(tmp_path / "fg.jsonl", events), "--format", "json")[1])
    (got,) = [r for r in rep["rows"] if r["layer"] == "a"]
    assert (got["dense"], got["causes"], got["scores_bytes_max"]) == (10, {"eager_call": 10, "graph_break": 2}, 8192), got
    assert rep["run"]["missing_lines"] == 50 and rep["endings"][0]["own_final_counts"] is True, rep[
        "endings"
    ]  # (1-50: the header line too)


def test_compiles_without_a_template_and_fused_counts_without_memory_are_counted(tmp_path, capsys):
    """A ``flex_compile`` naming no template (an older log, a backend without one) and ``fused_calls``
    counters with no memory figures (CPU): counted, with no template and no memory invented."""
    events = [header(), ev("flex_compile", 2, layer="a", phase="forward", path="fused")]
    events += [ev("fused_calls", 3, layer="a", phase="forward", count=4), ev("shutdown", 4, reason="exit")]
    rep = json.loads(report(capsys, write(tmp_path / "fg.jsonl", events), "--format", "json")[1])
    (got,) = [r for r in rep["rows"] if r["layer"] == "a"]
    assert (got["compiles"], got["fused"], got["dense"]) == (1, 4, 0), got
    assert not got["templates"] and got["peak_delta_max"] is None and got["alloc_delta_max"] is None, got
