"""``fusionguard report`` counts exactly and gates correctly: fused calls counted once whatever
mix of records a log holds, compile records apart, allowed dense calls apart, non-logs ignored,
gates that never pass on silence, hostile lines that never raise, regular files only, control
characters escaped, plots that say what is missing."""

from __future__ import annotations

import itertools
import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from compile_models import Two, blocks_compiled_in_place
from conftest import ROOT, qkv, run_cli
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.eventlog.kinds import KNOWN_EVENTS
from fusionguard.report.aggregate import NO_LAYER
from fusionguard.report.build import build as build_report_dict
from fusionguard.report.render import render_csv, render_json, render_text

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

TS0 = 1_800_000_000.0


def ev(kind, seq, pid=100, rank=0, **fields):
    return {"event": kind, "level": "info", "ts": TS0 + seq, "seq": seq, "pid": pid, "rank": rank, "thread": "MainThread", **fields}


def header(pid=100, rank=0):
    return ev(
        "header",
        0,
        pid=pid,
        rank=rank,
        schema=1,
        fusionguard="0.1.0",
        torch="2.13.0",
        triton=None,
        python="3.11.7",
        hostname="node1",
        cuda={"available": False},
        world_size=1,
        local_rank=0,
    )


def write(path, events, raw_lines=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for e in events:
            fh.write(json.dumps(e).encode() + b"\n")
        for line in raw_lines:
            fh.write(line + b"\n")
    return path


def as_json(capsys, *args):
    rc, out, err = run_cli(capsys, *args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


# -- real compiles: what the writer logs for models compiled whole and per block -----------------------


def _gqa():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, 64, 8, generator=g), torch.randn(1, 2, 64, 8, generator=g), torch.randn(1, 2, 64, 8, generator=g)


@pytest.mark.slow
def test_a_model_compiled_whole_and_per_block_counts_each_call_once(guard, capsys, tmp_path, dynamo_reset):
    """Issue 18: a 2-layer model compiled whole, run twice, is 4 fused calls (report said 8, with
    an extra "(no layer)" row); blocks compiled in place: 2 blocks x 2 layers x 2 runs = 8."""
    q, k, v = _gqa()
    # sampled: each layer's first run in full (one flex_run per layer of a graph run), the second
    # as that layer's counter
    log = guard(fused_first=1, fused_every=1)
    model = Two()
    compiled = torch.compile(model)
    with fusionguard.watch(compiled):
        compiled(q, k, v)
        compiled(q, k, v)
    rows = {(r["layer"], r["phase"]): r for r in fusionguard.summary()}
    fusionguard.disable()
    assert {k: r["fused"] for k, r in rows.items()} == {("a", "forward"): 2, ("b", "forward"): 2}
    kinds = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert kinds.count("flex_run") == 2 and kinds.count("fused_calls") == 2
    rep = as_json(capsys, log)
    assert rep["totals"]["fused_calls"] == 4 and rep["totals"]["dense_calls"] == 0
    got = {(r["layer"], r["phase"]): (r["fused"], r["compiles"]) for r in rep["rows"]}
    assert got == {("a", "forward"): (2, 1), ("b", "forward"): (2, 1)}  # no "(no layer)" row
    rc, out, _ = run_cli(capsys, log)
    assert "OK: no dense FlexAttention; 4 fused calls, 2 compiled graphs" in out and NO_LAYER not in out

    torch._dynamo.reset()
    log = tmp_path / "blocks.jsonl"
    guard(log_path=str(log))
    model = blocks_compiled_in_place()
    with fusionguard.watch(model):
        model(q, k, v)
        model(q, k, v)
    fusionguard.disable()
    rep = as_json(capsys, log)
    assert rep["totals"]["fused_calls"] == 8 and rep["totals"]["dense_calls"] == 0
    assert sum(r["fused"] for r in rep["rows"]) == 8
    assert all(r["fused"] or r["compiles"] for r in rep["rows"]), rep["rows"]  # no empty rows


class Via(nn.Module):
    """An attention layer calling ``attend`` (plain or a compiled ``flex_attention``)."""

    def __init__(self, attend):
        super().__init__()
        self.attend = attend

    def forward(self, q, k, v):
        return self.attend(q, k, v, enable_gqa=True)


class Pair(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.layers = nn.ModuleList(Via(attend) for _ in range(2))

    def forward(self, q, k, v):
        for layer in self.layers:
            q = layer(q, k, v)
        return q


@pytest.mark.slow
def test_summary_of_a_second_log_counts_only_its_own_calls(guard, capsys, tmp_path, dynamo_reset):
    """The H200 failure of tests/gpu/test_report_cuda.py, forward-only: watched eager layers
    calling a compiled flex_attention (hooks count each call, graph runs too), then in the same
    process, under a new log, the same layer names in a model compiled whole. summary() said 2x
    the calls (the first log's rows were kept and the second's graph runs added to them), and
    the second log's summary event carried the first log's rows, memory included."""
    q, k, v = _gqa()
    steps = 3
    first = guard(fused_first=2, fused_every=2)
    eager = Pair(torch.compile(flex_attention))
    with fusionguard.watch(eager), torch.no_grad():
        for _ in range(steps):
            eager(q, k, v)
    want = {("layers.0", "forward"): steps, ("layers.1", "forward"): steps}
    assert {(r["layer"], r["phase"]): r["fused"] for r in fusionguard.summary()} == want
    fusionguard.disable()

    torch._dynamo.reset()
    second = tmp_path / "whole.jsonl"
    guard(log_path=str(second), fused_first=2, fused_every=2)
    compiled = torch.compile(Pair(flex_attention))
    with fusionguard.watch(compiled), torch.no_grad():
        for _ in range(steps):
            compiled(q, k, v)
    rows = {(r["layer"], r["phase"]): r for r in fusionguard.summary()}
    assert {key: r["fused"] for key, r in rows.items()} == want
    assert all(r["calls"] == steps and r["measured"] == 0 for r in rows.values()), rows
    # a new log while enabled: the old one ends with its summary, the new one counts from zero
    third = tmp_path / "third.jsonl"
    guard(log_path=str(third), fused_first=2, fused_every=2)
    with fusionguard.watch(compiled), torch.no_grad():
        compiled(q, k, v)
    assert {(r["layer"], r["phase"]): r["fused"] for r in fusionguard.summary()} == {key: 1 for key in want}
    fusionguard.disable()
    assert {(r["layer"], r["phase"]): r["fused"] for r in build_report_dict([str(third)])["rows"]} == {key: 1 for key in want}
    for log in (first, second):  # each log: its own calls, in its events and in its summary event
        assert {(r["layer"], r["phase"]): r["fused"] for r in build_report_dict([str(log)])["rows"]} == want
        summaries = [json.loads(line) for line in log.read_text().splitlines() if '"summary"' in line]
        last = [e for e in summaries if e["event"] == "summary"][-1]
        assert {(r["layer"], r["phase"]): r["fused"] for r in last["rows"]} == want


# -- every mix of compile records, graph runs, counters, rescued calls, layer records and summaries -------


def _mix(has_compile, has_runs, sampled, has_rescued, has_layer_memory, has_summary):
    """One process that ran: a graph holding layers a and b, 3 times (6 calls); 2 rescued calls in
    layer c (each also a run of the rescue's graph); 1 call of watched eager layer d through a
    compiled flex_attention (a graph run and a layer record). 9 fused calls in all."""
    events, seq = [header()], itertools.count(1)
    if has_compile:
        events += [
            ev("flex_compile", next(seq), layer=name, phase="forward", path="fused", template="cpp", source="lowering") for name in "abcd"
        ]
    if has_runs:
        ab = dict(layer=None, layers=["a", "b"], phase="forward", path="fused", flex_calls=2)
        if sampled:  # fused_first=1: one run in full, then a counter (no layer names) for the rest
            events += [
                ev("flex_run", next(seq), **ab),
                ev("fused_calls", next(seq), layer=None, phase="forward", path="fused", of="flex_run", count=2, total=3, flex_calls=4),
            ]
        else:
            events += [ev("flex_run", next(seq), **ab) for _ in range(3)]
        events += [ev("flex_run", next(seq), layer="c", layers=["c"], phase="forward", path="fused", flex_calls=1) for _ in range(2)]
        events += [ev("flex_run", next(seq), layer="d", layers=["d"], phase="forward", path="fused", flex_calls=1)]
    if has_rescued:
        events += [
            dict(ev("flex_call", next(seq), layer="c", phase="forward", path="rescued", cause="eager_call", action="warn"))
            for _ in range(2)
        ]
    if has_layer_memory:
        events += [ev("layer_memory", next(seq), layer="d", phase="forward", path="fused", alloc_delta=10, peak_delta=20)]
    if has_summary:
        rows = [
            {"layer": name, "phase": "forward", "calls": n, "dense": 0, "fused": n, "causes": {}, "rank": 0}
            for name, n in (("a", 3), ("b", 3), ("c", 2), ("d", 1))
        ]
        events += [ev("summary", next(seq), rows=rows)]
    events += [ev("shutdown", next(seq), reason="exit")]
    named = has_runs and (has_summary or not sampled)  # summary rows name calls, never add them
    expected = {
        "a": 3 if named else (1 if has_runs else 0),
        "b": 3 if named else (1 if has_runs else 0),
        "c": 2 if (has_runs or has_rescued) else 0,
        "d": 1 if (has_runs or has_layer_memory) else 0,
        NO_LAYER: 4 if (has_runs and sampled and not has_summary) else 0,
    }
    return events, expected


# sampling applies to graph runs: without runs, "sampled" would repeat the same log
MIXES = [m for m in itertools.product([False, True], repeat=6) if m[1] or not m[2]]


@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "".join("CRSXLY"[i] if b else "-" for i, b in enumerate(m)))
def test_every_mix_of_records_counts_each_fused_call_once(mix, tmp_path):
    has_compile = mix[0]
    events, expected = _mix(*mix)
    path = write(tmp_path / "fg.jsonl", events)
    rep = build_report_dict([str(path)])
    got = {r["layer"]: r["fused"] for r in rep["rows"]}
    want = {k: v for k, v in expected.items() if v}
    assert {k: v for k, v in got.items() if v} == want, (mix, rep["rows"])
    assert rep["totals"]["fused_calls"] == sum(want.values()) <= 9
    assert rep["totals"]["compiles"] == (4 if has_compile else 0)
    assert rep["totals"]["dense_calls"] == 0
    for r in rep["rows"]:  # a compile record is a graph, never a call; no row is all zeros
        assert r["fused"] or r["compiles"] or r["memory_samples"], r


def test_summary_rows_of_an_earlier_log_never_add_calls(tmp_path, capsys):
    """enable(log_path=A) ... enable(log_path=B) in one process: B's summary rows also count A's
    calls. Reading B alone, they must neither add calls nor split B's counters wrongly."""
    events = [
        header(),
        ev("flex_run", 1, layer=None, layers=["a", "b"], phase="forward", path="fused", flex_calls=2),
        ev("fused_calls", 2, layer=None, phase="forward", path="fused", of="flex_run", count=1, total=2, flex_calls=2),
        ev(
            "summary",
            3,
            rows=[{"layer": name, "phase": "forward", "fused": 7, "dense": 4, "causes": {"eager_call": 4}, "rank": 0} for name in "ab"],
        ),
        ev("shutdown", 4, reason="exit"),
    ]
    rep = as_json(capsys, write(tmp_path / "b.jsonl", events))
    got = {r["layer"]: (r["fused"], r["dense"]) for r in rep["rows"]}
    assert got == {"a": (1, 0), "b": (1, 0), NO_LAYER: (2, 0)}
    assert any("summary rows count 12 more forward fused calls than its log leaves unnamed (2)" in w for w in rep["warnings"])


def test_counts_of_two_processes_add_and_a_gathered_summary_never_doubles(tmp_path, capsys):
    """Rank 0 gathered every rank's rows (summary(all_ranks=True)); rank 1's own log is there too:
    its calls count once. Rank 2's log is missing: its gathered row stands in."""
    r0 = [
        header(pid=1, rank=0),
        ev("flex_run", 1, pid=1, rank=0, layer="a", phase="forward", path="fused", flex_calls=1),
        ev(
            "summary",
            2,
            pid=1,
            rank=0,
            rows=[
                {"layer": "a", "phase": "forward", "fused": 1, "dense": 0, "rank": 0},
                {"layer": "a", "phase": "forward", "fused": 1, "dense": 0, "rank": 1},
                {"layer": "a", "phase": "forward", "fused": 5, "dense": 0, "rank": 2},
            ],
        ),
        ev("shutdown", 3, pid=1, rank=0, reason="exit"),
    ]
    r1 = [
        header(pid=2, rank=1),
        ev("flex_run", 1, pid=2, rank=1, layer="a", phase="forward", path="fused", flex_calls=1),
        ev("shutdown", 2, pid=2, rank=1, reason="exit"),
    ]
    write(tmp_path / "logs" / "r0.jsonl", r0)
    write(tmp_path / "logs" / "r1.jsonl", r1)
    rep = as_json(capsys, tmp_path / "logs")
    assert rep["totals"]["fused_calls"] == 1 + 1 + 5


# -- allowed dense calls and the gates ---------------------------------------------------------------


def _quickstart_log(tmp_path):
    """What examples/quickstart.py does, by the real writer: one dense call blocked (strict), one
    deliberate dense reference inside allow_dense()."""
    log = tmp_path / "qs.jsonl"
    fusionguard.enable(strict=True, log_path=str(log))
    try:
        q, k, v = qkv()
        with pytest.raises(fusionguard.DenseFallbackError):
            flex_attention(q, k, v)
        with fusionguard.allow_dense():
            flex_attention(q, k, v)
    finally:
        fusionguard.disable()
    return log


def test_allowed_dense_calls_are_shown_apart_and_never_fail_the_gate(tmp_path, capsys):
    from fusionguard import _testing

    try:
        log = _quickstart_log(tmp_path)
    finally:
        _testing.reset_for_tests()
    rep = as_json(capsys, log)
    t = rep["totals"]
    assert (t["dense_calls"], t["blocked_calls"], t["allowed_dense_calls"]) == (1, 1, 1)  # the demo's "1 caught"
    (row,) = rep["rows"]
    assert (row["dense"], row["allowed"], row["blocked"], row["causes"]) == (1, 1, 1, {"eager_call": 1})
    rc, out, err = run_cli(capsys, log, "--fail-on-dense")
    assert rc == 1 and "DENSE: 1 dense FlexAttention call (1 blocked) in 1 layer/phase pair" in out
    assert "1 allowed dense call" in out and "gate failed: --fail-on-dense: 1 dense FlexAttention call (1 allowed ones not counted)" in err

    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    only_allowed = [e for e in lines if not (e["event"] == "flex_call" and e["action"] == "raise")]
    path = write(tmp_path / "allowed.jsonl", only_allowed)
    rc, out, err = run_cli(capsys, path, "--fail-on-dense")
    assert rc == 0 and "OK: no dense FlexAttention" in out and "1 allowed dense call" in out, out + err
    rep = as_json(capsys, path)
    assert rep["rows"][0]["allowed"] == 1 and rep["rows"][0]["dense"] == 0


def test_a_gate_never_passes_on_silence(tmp_path, capsys):
    """A log where fusionguard saw nothing (a graph compiled before enable()): --fail-on-dense alone
    is green; --expect-fused / --expect-calls N say the run was not what was expected."""
    silent = write(tmp_path / "silent.jsonl", [header(), ev("summary", 1, rows=[]), ev("shutdown", 2, reason="exit")])
    rc, out, _ = run_cli(capsys, silent, "--fail-on-dense")
    assert rc == 0 and "No FlexAttention calls or compiles in the input." in out
    rc, _, err = run_cli(capsys, silent, "--fail-on-dense", "--expect-fused")
    assert rc == 1 and "gate failed: --expect-fused: 0 fused FlexAttention call(s) in the logs, expected at least 1" in err
    three = write(
        tmp_path / "three.jsonl",
        [header()] + [ev("flex_run", s, layer="a", phase="forward", path="fused", flex_calls=1) for s in (1, 2, 3)],
    )
    assert run_cli(capsys, three, "--expect-calls", "3")[0] == 0
    rc, _, err = run_cli(capsys, three, "--expect-calls", "4")
    assert rc == 1 and "--expect-calls 4: 3 fused" in err
    assert run_cli(capsys, three, "--expect-calls", "-1")[0] == 2


# -- inputs that are not fusionguard logs ---------------------------------------------------------------


def test_inputs_that_are_not_logs_exit_2_and_are_listed_beside_real_logs(tmp_path, capsys):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "random.jsonl").write_bytes(os.urandom(4096).replace(b"\n", b"x") + b"\n" + os.urandom(100))
    (junk / "other.jsonl").write_text("".join(json.dumps({"event": "user logged in", "user": i}) + "\n" for i in range(5)))
    (junk / "empty.jsonl").write_bytes(b"")
    for f in sorted(junk.iterdir()):
        for flags in ((), ("--fail-on-dense",)):
            rc, out, err = run_cli(capsys, f, *flags)
            assert rc == 2 and out == "" and "no fusionguard events in the input" in err, (f, err)
    rc, out, err = run_cli(capsys, junk, "--fail-on-dense")
    assert rc == 2 and "other.jsonl: no fusionguard events" in err and "empty.jsonl: empty" in err

    write(
        junk / "real.jsonl",
        [header(), dict(ev("flex_call", 1, phase="forward", path="dense", cause="eager_call", action="warn"), level="warning")],
    )
    rep = as_json(capsys, junk)
    assert rep["run"]["files"] == 1 and rep["totals"]["dense_calls"] == 1
    assert sorted((os.path.basename(i["path"]), i["reason"]) for i in rep["ignored"]) == [
        ("empty.jsonl", "empty"),
        ("other.jsonl", "no fusionguard events"),
        ("random.jsonl", "not JSON lines"),
    ]
    rc, out, _ = run_cli(capsys, junk)
    assert rc == 0 and "ignored 3 inputs that are not a fusionguard log" in out


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifos_and_device_links_are_never_opened(tmp_path):
    """A FIFO or a link to /dev/zero named *.jsonl in a scanned directory hung report: only
    regular files are read (a subprocess with a deadline: a hang fails, never blocks the suite)."""
    logs = tmp_path / "logs"
    write(logs / "real.jsonl", [header(), ev("flex_run", 1, layer="a", phase="forward", path="fused", flex_calls=1)])
    os.mkfifo(logs / "pipe.jsonl")
    os.symlink("/dev/zero", logs / "zero.jsonl")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [sys.executable, "-m", "fusionguard", "report", str(logs), "--format", "json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["totals"]["fused_calls"] == 1
    assert sorted((os.path.basename(i["path"]), i["reason"]) for i in rep["ignored"]) == [
        ("pipe.jsonl", "not a regular file"),
        ("zero.jsonl", "not a regular file"),
    ]
    for name in ("pipe.jsonl", "zero.jsonl"):
        p = subprocess.run(
            [sys.executable, "-m", "fusionguard", "report", str(logs / name)], capture_output=True, text=True, env=env, timeout=60
        )
        assert p.returncode == 2 and "not a regular file" in p.stderr and "Traceback" not in p.stderr
    assert stat.S_ISFIFO(os.stat(logs / "pipe.jsonl").st_mode)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_crash_file_named_by_a_header_that_is_a_fifo_is_never_opened(tmp_path):
    """The header's ``crash_file`` is a path from the log: a FIFO there hung report (open blocks)."""
    os.mkfifo(tmp_path / "pipe")
    direct = write(tmp_path / "a" / "fg.jsonl", [dict(header(), crash_file=str(tmp_path / "pipe"))])
    beside = write(tmp_path / "b" / "fg.jsonl", [dict(header(), crash_file="/nonexistent/fg.crash")])
    os.mkfifo(tmp_path / "b" / "fg.crash")  # a crash file is also looked up beside its log
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for log in (direct, beside):
        p = subprocess.run(
            [sys.executable, "-m", "fusionguard", "report", str(log), "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr
        assert [c["kind"] for c in json.loads(p.stdout)["crashes"]] == ["stopped"]


# -- hostile lines -------------------------------------------------------------------------------------

HOSTILE = [
    b'{"event": "flex_call", "pid": [1], "seq": 5}',
    b'{"event": "flex_call", "rank": [0], "phase": "forward", "path": "dense"}',
    b'{"event": "flex_call", "seq": [5]}',
    b'{"event": "header", "hostname": ["h"], "pid": 100}',
    b'{"event": "header", "hostname": {"a": 1}, "pid": 100}',
    b'{"event": "flex_call", "layer": "\xc2\xb2", "phase": "forward", "path": "dense", "pid": 100, "rank": 0}',
    b'{"event": "flex_call", "layer": "\\ud800", "phase": "forward", "path": "dense"}',
    b'{"event": "flex_call", "cause": "\\udfff x", "phase": "forward", "path": "dense"}',
    b'{"event": "flex_call", "ts": NaN, "phase": "forward", "path": "dense"}',
    b'{"event": "flex_call", "ts": Infinity}',
    b'{"event": "flex_call", "ts": -Infinity}',
    b'{"event": "flex_call", "ts": "yesterday"}',
    b'{"event": "flex_call", "ts": 1e300}',
    b'{"event": "flex_call", "ts": -5}',
    b'{"event": "flex_call", "phase": "forward", "path": "dense", "scores_bytes": "9000"}',
    b'{"event": "flex_call", "phase": "forward", "path": "dense", "scores_bytes": 1e400}',
    b'{"event": "flex_call", "phase": "forward", "path": "dense", "scores_bytes": 123456789012345678901234567890}',
    b'{"event": "dense_calls", "phase": "forward", "path": "dense", "count": "5"}',
    b'{"event": "dense_calls", "phase": "forward", "path": "dense", "count": true}',
    b'{"event": "dense_calls", "phase": "forward", "path": "dense", "count": -5}',
    b'{"event": "flex_run", "phase": "forward", "flex_calls": -1}',
    b'{"event": "summary", "rows": [{"layer": "x", "phase": "forward", "fused": -3, "dense": -1}]}',
    b'{"event": "flex_run", "phase": "forward", "flex_calls": "2", "layers": ["a", "b"]}',
    b'{"event": "flex_run", "phase": "forward", "flex_calls": 2, "layers": "ab"}',
    b'{"event": "flex_run", "phase": "forward", "flex_calls": 2, "layers": [1, 2]}',
    b'{"event": "fused_calls", "of": "flex_run", "count": 3, "flex_calls": [3]}',
    b'{"event": "layer_memory", "layer": "a", "phase": "forward", "path": "fused", "alloc_delta": "1", "peak_delta": NaN}',
    b'{"event": "summary", "rows": [{"layer": 5, "phase": "forward"}]}',
    b'{"event": "summary", "rows": [{"layer": "a", "phase": "forward", "fused": "3"}]}',
    b'{"event": "summary", "rows": [{"layer": "a", "phase": "forward", "causes": ["x"]}]}',
    b'{"event": "summary", "rows": [{"layer": "a", "phase": "forward", "causes": {"x": "1"}}]}',
    b'{"event": "summary", "rows": {"layer": "a"}}',
    b'{"event": "summary", "rows": [1, 2, 3]}',
    b'{"event": "crash", "message": ["boom"], "frames": "x"}',
    b'{"event": "crash", "cuda": {"allocated": "lots"}, "last_flex": {"scores_bytes": "big"}}',
    b'{"event": "crash", "last_flex": [1]}',
    b'{"event": "flex_call", "call_site": {"file": 1, "line": "x"}, "phase": "forward", "path": "dense"}',
    b'{"event": "flex_call", "call_site": "train.py:7", "phase": "forward", "path": "dense"}',
    b'{"event": "header", "cuda": {"devices": [1, 2]}, "hostname": "h"}',
    b'{"event": "header", "world_size": "2"}',
    b'{"event": "shutdown", "counts": {"a": "b"}}',
    b'{"event": 5}',
    b'{"event": null}',
    b'{"event": ["flex_call"]}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    b'"just a string"',
    b"12",
    b"null",
]


def _hostile_log(tmp_path, lines):
    good = [
        header(),
        dict(ev("flex_call", 1, layer="x", phase="forward", path="dense", cause="eager_call", action="warn"), level="warning"),
        ev("flex_run", 2, layer="x", phase="forward", path="fused", flex_calls=1),
    ]
    return write(tmp_path / "fg.jsonl", good + [ev("shutdown", 3, reason="exit")], raw_lines=lines)


def _every_output(capsys, path):
    for fmt in ("text", "json", "csv"):
        rc, out, err = run_cli(capsys, path, "--format", fmt, "--fail-on-dense")
        assert rc == 1 and "Traceback" not in err, err
        out.encode("utf-8")  # printable: no lone surrogate reaches the output
    return build_report_dict([str(path)])


@pytest.mark.parametrize("line", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_line_is_one_corrupt_line_never_a_traceback(line, tmp_path, capsys):
    path = _hostile_log(tmp_path, [line])
    rep = _every_output(capsys, path)
    (f,) = rep["files"]
    ok_layer = line.startswith(b'{"event": "flex_call", "layer": "\xc2\xb2"')  # a fine name, just not ASCII
    assert f["corrupt_lines"] == (0 if ok_layer else 1), line[:80]
    assert rep["totals"]["dense_calls"] == (2 if ok_layer else 1) and rep["totals"]["fused_calls"] == 1


def test_all_hostile_lines_together(tmp_path, capsys):
    rep = _every_output(capsys, _hostile_log(tmp_path, HOSTILE))
    assert rep["files"][0]["corrupt_lines"] == len(HOSTILE) - 1


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FIELDS = [
    "event",
    "pid",
    "rank",
    "seq",
    "ts",
    "hostname",
    "layer",
    "layers",
    "phase",
    "path",
    "cause",
    "action",
    "allowed",
    "scores_bytes",
    "count",
    "total",
    "flex_calls",
    "of",
    "rows",
    "call_site",
    "cuda",
    "last_flex",
    "message",
    "frames",
    "counts",
    "causes",
    "alloc_delta",
    "peak_delta",
    "recompute",
    "reason",
    "schema",
    "template",
]


def _nested(children):  # a def, not a lambda: hypothesis could not see the lambda use its argument
    return st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=4), children, max_size=4)


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    _nested,
    max_leaves=12,
)
_KINDS = st.sampled_from(sorted(KNOWN_EVENTS) + ["odd\x1b[31m"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_KINDS, st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6)), min_size=1, max_size=6))
def test_fuzzed_events_never_raise(tmp_path, events):
    lines = []
    for kind, fields in events:
        e = {**fields, "event": kind} if fields.get("event", kind) is not None else fields
        try:
            lines.append(json.dumps(e, allow_nan=True).encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError):
            continue
    path = _hostile_log(tmp_path, lines)
    rep = build_report_dict([str(path)])
    for render in (render_text, render_json, render_csv):
        render(rep).encode("utf-8")
    assert rep["totals"]["dense_calls"] >= 1


# -- what reaches the terminal, the files written ------------------------------------------------------------


def test_control_characters_from_a_log_are_escaped_in_text(tmp_path, capsys):
    evil = "\x1b]0;pwned\x07\x1b[2J"
    events = [
        header(),
        dict(
            ev(
                "flex_call",
                1,
                layer="layers.0" + evil,
                phase="forward\nDENSE: 0",
                path="dense",
                cause="eager_call" + evil,
                call_site={"file": "t\x1b[31m.py", "line": 1, "function": "f\u202e"},
                action="warn",
            ),
            level="warning",
        ),
        dict(ev("crash", 2, exc_type="E\x1b", message="boom\x9b1m\nsecond line", where="sys.excepthook"), level="error"),
    ]
    rc, out, _ = run_cli(capsys, write(tmp_path / "fg.jsonl", events))
    assert rc == 0
    assert not any(c in out for c in ("\x1b", "\x07", "\x9b", "\u202e")), repr(out)
    assert "layers.0\\x1b]0;pwned\\x07\\x1b[2J" in out and "forward\\x0aDENSE: 0" in out
    assert "E\\x1b: boom\\x9b1m" in out and "second line" not in out
    assert len([ln for ln in out.splitlines() if ln.startswith("DENSE")]) == 1


def test_unwritable_output_and_plot_paths_are_clean_errors(tmp_path, capsys):
    path = write(tmp_path / "fg.jsonl", [header(), ev("flex_run", 1, layer="a", phase="forward", path="fused", flex_calls=1)])
    rc, out, err = run_cli(capsys, path, "-o", tmp_path / "no" / "such" / "dir" / "r.txt")
    assert rc == 2 and "cannot write -o" in err and "Traceback" not in err
    pytest.importorskip("matplotlib")
    rc, out, err = run_cli(capsys, path, "--plot", tmp_path / "no" / "such" / "p.png")
    assert rc == 2 and "cannot write --plot" in err


def test_plot_draws_dollar_signs_and_says_when_there_is_no_memory_data(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    events = [
        header(),
        dict(
            ev(
                "flex_call", 1, layer="layers.$x$.attn", phase="forward", path="dense", cause="cost_$5_^{", action="warn", scores_bytes=1000
            ),
            level="warning",
        ),
        ev("layer_memory", 2, layer="layers.$x$.attn", phase="forward", path="dense", alloc_delta=5, peak_delta=1_000_000),
    ]
    png = tmp_path / "mem.png"
    rc, out, err = run_cli(capsys, write(tmp_path / "gpu.jsonl", events), "--plot", png)
    assert rc == 0 and "plot written to" in err and "no memory data" not in err and png.stat().st_size > 10_000

    cpu = [header()] + [ev("flex_run", s, layer=f"layers.{s}.$a$", phase="forward", path="fused", flex_calls=1) for s in range(1, 4)]
    png = tmp_path / "cpu.png"
    rc, out, err = run_cli(capsys, write(tmp_path / "cpu.jsonl", cpu), "--plot", png)
    assert rc == 0 and "no memory data in the log" in err and "calls per layer plotted instead" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_terminal_without_utf8_gets_escapes_not_a_traceback(tmp_path):
    path = write(
        tmp_path / "fg.jsonl",
        [header(), dict(ev("flex_call", 1, layer="ü", phase="forward", path="dense", cause="eager_call", action="warn"), level="warning")],
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONIOENCODING="ascii")
    p = subprocess.run([sys.executable, "-m", "fusionguard", "report", str(path)], capture_output=True, env=env, timeout=60)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr
    assert b"eager_call\\xd71" in p.stdout and b"\\xfc" in p.stdout


@pytest.mark.parametrize("schema", ["\u00b2", "9" * 5000, "-1", " 1"])
def test_a_header_schema_that_is_not_a_plain_number_is_reported_never_a_traceback(schema, tmp_path, capsys):
    """``str.isdigit()`` is true for "²" (and int() of 5,000 digits raises): the schema check
    took either for a number and raised out of build()."""
    path = write(
        tmp_path / "fg.jsonl", [dict(header(), schema=schema), ev("flex_run", 1, layer="a", phase="forward", path="fused", flex_calls=1)]
    )
    rep = as_json(capsys, path)
    assert rep["totals"]["fused_calls"] == 1
    assert not any("newer than this report" in w for w in rep["warnings"])


def test_a_rank_known_only_after_enable_is_one_process_not_a_stopped_one(guard, monkeypatch, capsys):
    """mp.spawn / init_process_group(rank=3) after enable(): the real writer stamps rank 0 until
    the process group is up, rank 3 after. That is one process that exited cleanly, not a rank 0
    that "stopped without a shutdown" beside a rank 3."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    log = guard(strict=False)
    q, k, v = qkv()
    with pytest.warns(fusionguard.DenseFallbackWarning):
        flex_attention(q, k, v)
    dist.init_process_group("fake", rank=3, world_size=4, store=FakeStore())
    try:
        with pytest.warns(fusionguard.DenseFallbackWarning):
            flex_attention(q, k, v)
        fusionguard.disable()
    finally:
        dist.destroy_process_group()
    assert {json.loads(line)["rank"] for line in log.read_text().splitlines()} == {0, 3}  # what the writer does
    rep = as_json(capsys, log)
    assert rep["run"]["processes"] == 1 and rep["run"]["ranks"] == [3]
    assert [(e["rank"], e["ending"]) for e in rep["endings"]] == [(3, "disable")] and rep["crashes"] == []
    assert rep["totals"]["dense_calls"] == 2

    # a new header under the same pid is a new process (containers: pid 1 in every run), kept apart
    lines = log.read_text().splitlines()
    again = [dict(json.loads(line), rank=5) for line in lines if json.loads(line)["event"] == "header"]
    two = write(log.parent / "two.jsonl", [json.loads(lines[0]), json.loads(lines[1])] + again)
    rep = as_json(capsys, two)
    assert rep["run"]["processes"] == 2


def test_csv_and_json_never_send_control_characters_to_a_terminal(tmp_path, capsys):
    """``--format csv`` wrote a layer's ESC sequences as they were; JSON left C1 controls and
    bidirectional overrides raw. JSON escapes them (the decoded data is unchanged), CSV shows them
    as text reports do."""
    evil = "layers.0\x1b[2J\x9b1m\u202e\x7f"
    path = write(
        tmp_path / "fg.jsonl",
        [header(), dict(ev("flex_call", 1, layer=evil, phase="forward", path="dense", cause="eager_call", action="warn"), level="warning")],
    )
    for fmt in ("csv", "json"):
        rc, out, _ = run_cli(capsys, path, "--format", fmt)
        assert rc == 0 and not any(c in out for c in ("\x1b", "\x9b", "\u202e", "\x7f")), (fmt, repr(out))
    assert json.loads(run_cli(capsys, path, "--format", "json")[1])["rows"][0]["layer"] == evil
    assert "layers.0\\x1b[2J\\x9b1m\\u202e\\x7f" in run_cli(capsys, path, "--format", "csv")[1]


def test_a_directory_without_logs_beside_real_logs_is_listed_not_fatal(tmp_path, capsys):
    """``fusionguard report runs/rank*/`` where one rank died before writing: the others are
    reported and the empty directory is listed as ignored (exit 2 only when no input holds an event)."""
    write(tmp_path / "rank0" / "fg.jsonl", [header(), ev("flex_run", 1, layer="a", phase="forward", path="fused", flex_calls=1)])
    (tmp_path / "rank1").mkdir()
    rc, out, err = run_cli(capsys, tmp_path / "rank0", tmp_path / "rank1", "--expect-fused", "--format", "json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["totals"]["fused_calls"] == 1
    assert rep["ignored"] == [{"path": str(tmp_path / "rank1"), "reason": "no fusionguard logs (*.jsonl) in this directory"}]
    rc, out, err = run_cli(capsys, tmp_path / "rank1")
    assert rc == 2 and out == "" and "rank1: no fusionguard logs (*.jsonl) in this directory" in err
