"""summary() agrees with ``fusionguard report`` (#24): the calls no layer name reaches are the
``(no layer)`` row in both (a graph compiled before enable(), a compiled flex_attention called
from no module, dense calls outside the watched modules or outside any module); and every
``summary`` event has one shape, which report reads as it reads the older two. Real compiles
on CPU (inference: CPU FlexAttention has no backward)."""

from __future__ import annotations

import json
import sys
import textwrap

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
import torch
from conftest import ROOT, child_env, needs, qkv, read_jsonl, run_cli
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.core.tables import NO_LAYER

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile", "ignore::fusionguard.DenseFallbackWarning")

SUMMARY_FIELDS = {"rows", "all_ranks", "counts"}


def summary_rows(rows):
    """{(layer, phase): (fused, dense, causes)} of summary() rows."""
    return {(r["layer"], r["phase"]): (r["fused"], r["dense"], r["causes"]) for r in rows}


def report_rows(capsys, log):
    """The same of ``fusionguard report LOG --format json``."""
    rc, out, err = run_cli(capsys, log, "--format", "json")
    assert rc in (0, 1), err  # (1: dense calls seen)
    return {(r["layer"], r["phase"]): (r["fused"], r["dense"], r["causes"]) for r in json.loads(out)["rows"]}


def summary_events(log):
    events = [e for e in read_jsonl(log) if e["event"] == "summary"]
    for e in events:
        assert SUMMARY_FIELDS <= set(e) and all("rank" in r for r in e["rows"]), e  # one shape
    return events


_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from torch.nn.attention.flex_attention import flex_attention
    import fusionguard

    before, after, out = sys.argv[1:4]
    q = torch.randn(1, 2, 32, 8)
    flex = torch.compile(flex_attention)
    with torch.no_grad():
        flex(q, q.clone(), q.clone())  # compiled before enable()
    fusionguard.enable(log_path=before)
    with torch.no_grad():
        for _ in range(4):
            flex(q, q.clone(), q.clone())  # 4 fused calls, by a plain function: no layer
    rows = {"before": [dict(r) for r in fusionguard.summary()]}

    def attend(q, k, v):  # a function, no module: its calls have no layer
        return flex_attention(q, k, v)

    fusionguard.enable(log_path=after)  # a new log: its own rows
    attend_c = torch.compile(attend)  # compiled while enabled, without watch()
    with torch.no_grad():
        for _ in range(3):
            attend_c(q, q.clone(), q.clone())
    rows["after"] = [dict(r) for r in fusionguard.summary()]
    json.dump(rows, open(out, "w"))
    fusionguard.disable()
    """
)


@pytest.mark.slow
@needs("graph_text")  # (torch 2.7: a graph compiled before enable() has no record, docs/compatibility.md)
def test_fused_calls_without_a_layer_are_a_summary_row_as_in_the_report(tmp_path, capsys):
    """A graph compiled before enable() runs 4 fused calls; a function compiled after it, called
    from no module, 3: the log, the report and now summary() count them, under ``(no layer)``.
    (A process of its own: graphs of earlier tests would be found by enable() too.)"""
    script, before, after, out = tmp_path / "s.py", tmp_path / "before.jsonl", tmp_path / "after.jsonl", tmp_path / "rows.json"
    script.write_text(_SCRIPT)
    proc = forkserver.run(
        [sys.executable, str(script), str(before), str(after), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=child_env(OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    for name, log, n in (("before", before, 4), ("after", after, 3)):
        expected = {(NO_LAYER, "forward"): (n, 0, {})}
        assert summary_rows(rows[name]) == expected, name
        assert report_rows(capsys, log) == expected, name
        assert [r["rank"] for r in rows[name]] == [0]
        # the summary() event and the one that ends the log: one shape, the same rows
        assert [summary_rows(e["rows"]) for e in summary_events(log)] == [expected, expected], name
    runs = [e for e in read_jsonl(before) if e["event"] == "flex_run"]
    assert [(e["layer"], e["flex_calls"]) for e in runs] == [(None, 1)] * 4


class Attn(torch.nn.Module):
    def forward(self, q, k, v):
        return flex_attention(q, k, v)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()

    def forward(self, q, k, v):
        return self.attn(q, k, v)


@pytest.mark.parametrize("watched", [True, False], ids=["watch", "no-watch"])
def test_dense_calls_outside_any_layer_are_a_summary_row_as_in_the_report(guard, capsys, watched):
    """Dense calls inside the model are its layer's; those made outside it (with watch(): outside
    the watched modules; without: by no module) are the ``(no layer)`` row, in summary() and in
    the report alike; strict mode's blocked call counts in both."""
    log = guard(keep_all=True)
    model = Model()
    q, k, v = qkv()
    with torch.no_grad():
        if watched:
            with fusionguard.watch(model):
                model(q, k, v)
                flex_attention(q, k, v)  # outside the watched modules
                flex_attention(q, k, v)
        else:
            model(q, k, v)
            flex_attention(q, k, v)  # no module makes these
            flex_attention(q, k, v)
        fusionguard.enable(strict=True, log_path=str(log), keep_all=True)
        with pytest.raises(fusionguard.DenseFallbackError):
            flex_attention(q, k, v)
    rows = fusionguard.summary()
    fusionguard.disable()
    layer = "attn"
    expected = {(layer, "forward"): (0, 1, {"eager_call": 1}), (NO_LAYER, "forward"): (0, 3, {"eager_call": 3})}
    assert summary_rows(rows) == expected
    assert [r["layer"] for r in rows] == [layer, NO_LAYER]  # (no layer) last, as in the report
    assert report_rows(capsys, log) == expected
    assert "(no layer)" in str(rows)
    assert [summary_rows(e["rows"]) for e in summary_events(log)] == [expected, expected]


def test_report_reads_every_summary_shape_alike(tmp_path, capsys):
    """Logs written before #24 hold two shapes of ``summary`` (the end of a log: ``counts`` and
    rows without ``rank``; ``summary()``: rows with ``rank`` and ``all_ranks``); the one shape now
    holds all three fields. The report names a graph's unattributed calls from any of them alike."""
    base = {"level": "info", "pid": 7, "rank": 0, "thread": "MainThread"}
    row = {"phase": "forward", "fused": 2, "dense": 0, "causes": {}}
    shapes = {
        "old_end_of_log": {"counts": {"fused_runs_forward": 4}, "rows": [{"layer": n, **row} for n in "ab"]},
        "old_summary_call": {"all_ranks": False, "rows": [{"layer": n, **row, "rank": 0} for n in "ab"]},
        "one_shape": {
            "all_ranks": False,
            "counts": {"fused_runs_forward": 4},
            "rows": [{"layer": n, **row, "rank": 0} for n in "ab"] + [{"layer": NO_LAYER, **row, "fused": 0, "rank": 0}],
        },
    }
    got = {}
    for name, fields in shapes.items():
        events = [
            {"event": "header", "seq": 0, "ts": 1.0, "schema": 1, "hostname": "h", **base},
            # a graph of two layers' calls whose names the run could not tell: unattributed in the log
            {
                "event": "flex_run",
                "seq": 1,
                "ts": 2.0,
                "layer": None,
                "layers": None,
                "phase": "forward",
                "path": "fused",
                "flex_calls": 4,
                **base,
            },
            {"event": "summary", "seq": 2, "ts": 3.0, **fields, **base},
            {"event": "shutdown", "seq": 3, "ts": 4.0, "reason": "exit", **base},
        ]
        log = tmp_path / f"{name}.jsonl"
        log.write_text("".join(json.dumps(e) + "\n" for e in events))
        got[name] = report_rows(capsys, log)
    assert (
        got["old_end_of_log"] == got["old_summary_call"] == got["one_shape"] == {("a", "forward"): (2, 0, {}), ("b", "forward"): (2, 0, {})}
    )


def test_allowed_calls_are_a_column_of_their_own_not_dense(guard, capsys):
    """A dense call inside ``allow_dense()`` is ``allowed`` in summary(), never ``dense`` (and
    not ``fused``): the rule of a session's counts, ``fusionguard report`` and its HTML page."""
    log = guard(keep_all=True)
    model = Model()
    q, k, v = qkv()
    with torch.no_grad(), fusionguard.track(model) as fg:
        with fusionguard.allow_dense():
            model(q, k, v)
        model(q, k, v)
    rows = fusionguard.summary()
    fusionguard.disable()
    got = {(r["layer"], r["phase"]): (r["calls"], r["dense"], r["allowed"], r["fused"], r["causes"]) for r in rows}
    assert got == {("attn", "forward"): (2, 1, 1, 0, {"eager_call": 1})}
    assert [(r["dense"], r["allowed"], r["fused"]) for r in fg.counts().rows] == [(1, 1, 0)]  # a session's rule
    assert str(rows).splitlines()[0].split()[:6] == ["layer", "phase", "calls", "dense", "allowed", "fused"]
    assert str(rows).splitlines()[2].split()[:6] == ["attn", "forward", "2", "1", "1", "0"]
    rc, out, err = run_cli(capsys, log, "--format", "json")
    rep = json.loads(out)
    (row,) = rep["rows"]
    assert (row["dense"], row["allowed"], row["fused"], row["causes"]) == (1, 1, 0, {"eager_call": 1})
    assert rep["warnings"] == []  # the summary event's rows (an ``allowed`` count each) read, not skipped as corrupt
    page = log.with_suffix(".html")
    assert run_cli(capsys, log, "--html", str(page))[0] == 0
    html = page.read_text()
    assert 'data-col="dense" data-value="1"' in html and 'data-col="allowed" data-value="1"' in html
    summary_event = summary_events(log)[-1]["rows"]
    assert [(r["dense"], r["allowed"]) for r in summary_event] == [(1, 1)]


class Other(torch.nn.Module):
    """Another model, its layer named otherwise (``inner.attn``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Model()

    def forward(self, q, k, v):
        return self.inner(q, k, v)


def test_fused_calls_named_outside_the_watched_model_are_no_layer_in_summary_as_in_the_session(guard):
    """A compiled model that is not watched, run beside a watched one: its fused calls carry its
    own names (``inner.attn``), outside the watched layers. The session counts them under
    ``(no layer)``, and summary() does too (no hook of the watched model counted them)."""
    guard()
    model, other = Model(), torch.compile(Other())
    q, k, v = qkv()
    with torch.no_grad(), fusionguard.track(model) as session:
        model(q, k, v)  # dense: the watched layer's
        other(q, k, v)  # fused, twice
        other(q, k, v)
        mine = {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in session.counts().rows}
        process = {k: v[:2] for k, v in summary_rows(fusionguard.summary()).items()}
    assert mine == process == {("attn", "forward"): (0, 1), (NO_LAYER, "forward"): (2, 0)}


def test_a_compiled_copy_of_the_watched_architecture_is_not_the_watched_model(guard):
    """A compiled model of the watched model's own architecture (a teacher, an EMA, a reference
    copy), not watched, runs while the watched model never does: its calls carry the watched
    names (``attn``), yet its frame's module is known and lies outside the watched model, so they
    are ``(no layer)`` in the session and in summary(), and the verdict does not say fused (#33)."""
    guard()
    model, copy = Model(), torch.compile(Model())
    q, k, v = qkv()
    with torch.no_grad(), fusionguard.track(model) as session:
        copy(q, k, v)
        copy(q, k, v)
        counts = session.counts()
        mine = {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in counts.rows}
        process = {k: v[:2] for k, v in summary_rows(fusionguard.summary()).items()}
        verdict = session.verdict("step 1", counts)
    assert mine == process == {(NO_LAYER, "forward"): (2, 0)}
    assert "fused 1/1" not in verdict.text


class Holder(torch.nn.Module):
    """A watched module that is no attention layer (its hooks count no call), calling a compiled
    container of attention layers that is not one of its submodules."""

    def __init__(self, blocks) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.__dict__["blocks"] = blocks  # used, not registered

    def forward(self, q, k, v):
        return self.blocks(self.lin(q), k, v)


class Blocks(torch.nn.Sequential):
    def forward(self, q, k, v):
        for block in self:
            q = block(q, k, v)
        return q


def test_fused_calls_under_a_hooked_module_that_counts_no_call_stay_in_summary(guard):
    """#33: the compiled container's fused calls are named outside the watched model
    (``holder.0``); the watched module running them (``holder``) is hooked but no attention layer:
    its hooks count no call, so summary() keeps them under ``(no layer)``, as the session does."""
    guard()
    blocks = torch.compile(Blocks(Attn(), Attn()))
    model = torch.nn.Sequential()
    model.holder = Holder(blocks)
    q, k, v = qkv()
    with torch.no_grad(), fusionguard.track(model) as session:
        model.holder(q, k, v)
        model.holder(q, k, v)
        mine = sum(r["fused"] for r in session.counts().rows)
        process = sum(r["fused"] for r in fusionguard.summary())
    assert mine == process == 4


class CompiledFlexAttn(torch.nn.Module):
    """Hugging Face's way: an eager layer calling a compiled ``flex_attention`` (one for all)."""

    flex = None

    def forward(self, q, k, v):
        return type(self).flex(q, k, v)


class CompiledFlexModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([CompiledFlexAttn(), CompiledFlexAttn()])

    def forward(self, q, k, v):
        for layer in self.layers:
            q = layer(q, k, v)
        return q


def test_the_watched_forward_is_found_after_many_calls_from_outside_it(guard):
    """#33: under a watch without hooks (the Trainer's ``torch_compile``) the compiled
    flex_attention's calls are named by the watched forward calling them; a reference model of
    the same class calling it first, many times, does not stop that for good."""
    guard()
    CompiledFlexAttn.flex = torch.compile(flex_attention)
    model, reference = CompiledFlexModel(), CompiledFlexModel()
    q, k, v = qkv()
    with torch.no_grad(), fusionguard.track(model, hooks=False) as session:
        for _ in range(6):  # 12 calls from outside the watched forwards
            reference(q, k, v)
        session.step()
        model(q, k, v)
        rows = {(r["layer"], r["fused"]) for r in session.step().rows}
    assert rows == {("layers.0", 1), ("layers.1", 1)}


class TeacherAttn(torch.nn.Module):
    """Another architecture calling the same compiled ``flex_attention``: a teacher nobody watches."""

    def forward(self, q, k, v):
        return CompiledFlexAttn.flex(q, k, v)


class Teacher(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = TeacherAttn()

    def forward(self, q, k, v):
        return self.attn(q, k, v)


def _frames_tested(call):
    """How many frames the fused path tests for a watched forward that called a compiled function
    (``_match`` calls of its finder) while ``call`` runs."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_match" and type(frame.f_locals.get("self")).__name__ == "_WatchedForward":
            seen.append(1)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return len(seen)


def test_an_unwatched_caller_of_a_compiled_flex_attention_costs_no_stack_walk(guard):
    """#33: every run of a compiled flex_attention called from an unwatched eager model (a teacher)
    walked the stack for a watched forward, for ever: needed only while a watched module has no
    hooks (``hooks=False``), and then a miss is cheap after its first walk; the watched model's
    calls are named all the same."""
    guard()
    CompiledFlexAttn.flex = torch.compile(flex_attention)
    model, teacher = CompiledFlexModel(), Teacher()
    q, k, v = qkv()
    with torch.no_grad():
        with fusionguard.track(model) as session:  # hooks on: they name the watched layers
            teacher(q, k, v)
            assert _frames_tested(lambda: teacher(q, k, v)) == 0
            session.step()
            model(q, k, v)
            hooked = {(r["layer"], r["fused"]) for r in session.step().rows}
        with fusionguard.track(model, hooks=False) as session:
            for _ in range(3):
                teacher(q, k, v)
            assert _frames_tested(lambda: teacher(q, k, v)) == 0
            session.step()
            model(q, k, v)
            hookless = {(r["layer"], r["fused"]) for r in session.step().rows}
    assert hooked == hookless == {("layers.0", 1), ("layers.1", 1)}


class TopCallModel(CompiledFlexModel):
    """The model's own forward calls the compiled flex_attention after its layers, and once eagerly."""

    def forward(self, q, k, v):
        q = super().forward(q, k, v)
        return CompiledFlexAttn.flex(q, k, v) + flex_attention(q, k, v)  # (fused, then dense: no layer's, both)


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "no-hooks"])
def test_a_compiled_flex_attention_called_by_the_watched_model_itself_is_no_layer(guard, hooks):
    """#33 (hostile7): the compiled function's graph is compiled inside ``layers.0`` (its first
    caller), so its compile-time name is ``layers.0``; the hooked root's own call after its layers
    kept that name (layers.0 fused 2 per run, no ``(no layer)`` row). It is no layer's, as the
    root's dense call is, and the verdict says so."""
    guard()
    torch._dynamo.reset()  # (compiled here, under layers.0: torch 2.7 cannot see a graph compiled before enable())
    CompiledFlexAttn.flex = torch.compile(flex_attention)
    model = TopCallModel()
    q, k, v = qkv(L=24)  # (a shape of its own: compiled here, under layers.0)
    with torch.no_grad(), fusionguard.track(model, hooks=hooks, log_path=False) as session:
        model(q, k, v)
        step = session.step()
    rows = {r["layer"]: (r["fused"], r["dense"]) for r in step.rows}
    assert rows == {"layers.0": (1, 0), "layers.1": (1, 0), NO_LAYER: (1, 1)}
    assert "1 fused FlexAttention call(s) outside any watched layer" in session.verdict("step", step).text


class StackWithOwnCall(torch.nn.Module):
    """A container (not the root) whose own forward calls the compiled flex_attention between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([CompiledFlexAttn(), CompiledFlexAttn()])

    def forward(self, q, k, v):
        q = self.layers[0](q, k, v)
        q = CompiledFlexAttn.flex(q, k, v)  # the container's own call
        return self.layers[1](q, k, v)


def test_a_compiled_flex_attention_called_by_a_hooked_container_is_the_containers(guard):
    """#33 (hostile8): the compiled function's graph is compiled inside ``stack.layers.0`` (its
    first caller); the hooked container ``stack`` calling it between its layers was counted as
    ``stack.layers.0`` (the compile-time name, "more specific" than the running ``stack``). A
    function graph has no module path of its own: it is named by what runs it now, as a dense
    call there is (and as ``hooks=False`` names it)."""
    guard()
    torch._dynamo.reset()  # (compiled here, under stack.layers.0)
    CompiledFlexAttn.flex = torch.compile(flex_attention)
    model = torch.nn.Module()
    model.stack = StackWithOwnCall()
    q, k, v = qkv(L=24)
    with torch.no_grad(), fusionguard.track(model, log_path=False) as session:
        model.stack(q, k, v)
        rows = {r["layer"]: r["fused"] for r in session.step().rows}
    assert rows == {"stack": 1, "stack.layers.0": 1, "stack.layers.1": 1}


class TopOnlyModel(CompiledFlexModel):
    """The model's own forward calls the compiled flex_attention after its layers."""

    def forward(self, q, k, v):
        return CompiledFlexAttn.flex(super().forward(q, k, v), k, v)


def test_a_compiled_flex_attention_called_by_a_model_without_hooks_is_no_layer(guard):
    """#33 (hostile8): the graph is compiled inside ``layers.0`` of a hooked model (its first
    caller). Its later calls by a model watched with ``hooks=False`` itself (beside the hooked
    session, or in a later ``track(model, hooks=False)`` of the same model) kept that name:
    layers.0 counted them, no ``(no layer)`` row. They are no layer's, as a dense call there is."""
    guard()
    torch._dynamo.reset()  # (compiled here, under a hooked layers.0)
    CompiledFlexAttn.flex = torch.compile(flex_attention)
    a, b = TopOnlyModel(), TopOnlyModel()
    q, k, v = qkv(L=24)
    want = {"layers.0": 2, "layers.1": 2, NO_LAYER: 2}
    with torch.no_grad():
        with fusionguard.track(a, log_path=False) as hooked, fusionguard.track(b, hooks=False, log_path=False):
            a(q, k, v)
            b(q, k, v)
            beside = {r["layer"]: r["fused"] for r in hooked.step().rows}
        with fusionguard.track(a, hooks=False, log_path=False) as session:  # a later cell, same model
            a(q, k, v)
            a(q, k, v)
            after = {r["layer"]: r["fused"] for r in session.step().rows}
    assert (beside, after) == (want, want)
