"""Recompile pressure (#25 part 1): a frame holding FlexAttention that Dynamo keeps recompiling is
said before the recompile limit turns it dense, also with Dynamo's logs silenced. Real Dynamo,
``backend="aot_eager"`` (what is counted is Dynamo's compiles, whatever the backend)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from conftest import flex_events, needs, qkv, read_jsonl, run_cli
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.dense.pressure import threshold

pytestmark = needs("pressure")


def attend(q, k, v):
    return flex_attention(q, k, v)


def _calls(compiled, lengths):
    """Run ``compiled`` once per length; the warnings each call issued."""
    issued = []
    for L in lengths:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(*qkv(L=L))
        issued.append([w for w in caught if "recompile pressure" in str(w.message)])
    return issued


def test_threshold_is_half_the_limit_and_below_it():
    assert threshold(8, None) == 4
    assert threshold(9, None) == 5
    assert threshold(3, None) == 2
    assert threshold(8, 20) == 7  # always below the limit
    assert threshold(8, 3) == 3
    assert threshold(1, None) is None  # nothing to warn before
    assert threshold(2, None) is None  # the second compile is already the last one allowed
    assert threshold(8, 0) is None  # switched off


@pytest.mark.parametrize("bad", [1, -1, 2.5, "4", True])
def test_bad_recompile_warn_at_is_refused(bad):
    with pytest.raises(ValueError, match="recompile_warn_at"):
        fusionguard.enable(log_path=False, recompile_warn_at=bad)
    assert not fusionguard.is_enabled()


def test_pressure_arrives_before_the_limit_with_dynamos_logs_silenced(guard, dynamo_reset, dynamo_config, dynamo_silenced, capsys):
    dynamo_config(recompile_limit=4)
    log = guard()
    compiled = torch.compile(attend, backend="aot_eager", dynamic=False)
    issued = _calls(compiled, [16, 24, 32, 40, 48, 56])
    # half of 4 is 2, but the second compile shows one new length only: the third (the same guard
    # failing again with a new value: churn) warns, once, at the line that called the compiled function
    assert [len(w) for w in issued] == [0, 0, 1, 0, 0, 0]
    warning = issued[2][0]
    assert warning.filename == __file__ and "compiled(*qkv(L=L))" in open(__file__).read().splitlines()[warning.lineno - 1]
    assert issubclass(warning.category, fusionguard.DenseFallbackWarning)
    text = str(warning.message)
    assert "attend" in text and "3 of 4" in text and re.search(r"\(([qkv]) dim 2 varies\).*mark_dynamic\(\1, 2\)", text)

    (event,) = flex_events("recompile_pressure")
    assert event["function"] == "attend" and event["file"] == __file__
    assert event["compiles"] == 3 and event["limit"] == 4 and event["warn_at"] == 2
    # (Dynamo names the first guard that failed: q, k and v all change)
    assert re.fullmatch(r"tensor '[qkv]' size mismatch at index 2. expected 24, actual 32", event["reason"])
    assert re.fullmatch("[qkv] dim 2 varies", event["varies"])
    assert "dynamic=True" in event["fix"] and "bucket" in event["fix"]
    assert event["call_site"]["file"] == __file__

    # the limit is hit at the 5th length: named from Dynamo's metrics although its log said nothing
    kinds = [e["event"] for e in read_jsonl(log)]
    limit_calls = [e for e in flex_events() if e["cause"] == "recompile_limit"]
    assert limit_calls, [e["cause"] for e in flex_events()]
    assert "size mismatch" in limit_calls[0]["evidence"]["reason"]
    assert kinds.count("recompile_pressure") == 1 and kinds.count("recompile_limit") == 1
    first_dense_by_limit = next(i for i, e in enumerate(read_jsonl(log)) if e.get("cause") == "recompile_limit")
    assert kinds.index("recompile_pressure") < kinds.index("recompile_limit") < first_dense_by_limit

    # report: a line of its own; --fail-on-recompile-pressure fails on it
    rc, out, err = run_cli(capsys, log)
    assert rc == 0, err
    assert re.search(r"^recompile pressure: 1 frame at 3 of 4 compiles \([qkv] dim 2 varies\)$", out, re.M), out
    assert "fix: mark the dim dynamic" in out
    rc, out, err = run_cli(capsys, log, "--fail-on-recompile-pressure")
    assert rc == 1 and "--fail-on-recompile-pressure: 1 frame" in err + out


def test_report_gates_on_pressure_alone(tmp_path, capsys):
    """A log with pressure and no dense call: --fail-on-dense passes, the new gate fails."""
    import json

    lines = [
        {"event": "header", "level": "info", "ts": 1.0, "seq": 1, "pid": 1, "rank": 0, "schema": 1, "hostname": "h"},
        {
            "event": "flex_compile",
            "level": "info",
            "ts": 2.0,
            "seq": 2,
            "pid": 1,
            "rank": 0,
            "path": "fused",
            "phase": "forward",
            "template": "cpp",
        },
        {
            "event": "recompile_pressure",
            "level": "warning",
            "ts": 3.0,
            "seq": 3,
            "pid": 1,
            "rank": 0,
            "function": "step",
            "file": "train.py",
            "line": 12,
            "compiles": 4,
            "limit": 8,
            "varies": "q dim 2 varies",
            "reason": "x",
            "fix": "mark it",
        },
        {
            "event": "recompile_pressure",
            "level": "warning",
            "ts": 4.0,
            "seq": 4,
            "pid": 1,
            "rank": 0,
            "function": "block",
            "file": "model.py",
            "line": 40,
            "compiles": 5,
            "limit": 8,
            "varies": "n varies",
        },
        {
            "event": "recompile_pressure",
            "level": "warning",
            "ts": 5.0,
            "seq": 5,
            "pid": 1,
            "rank": 0,
            "function": ["hostile"],
            "file": 3,
            "line": "x",
            "compiles": "many",
            "limit": None,
            "varies": {"a": 1},
        },
    ]
    log = tmp_path / "fg.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, out, err = run_cli(capsys, log, "--fail-on-dense")
    assert rc == 0, err
    assert "recompile pressure: 2 frames up to 5 of 8 compiles (n varies; q dim 2 varies)" in out
    assert "1 corrupt line skipped" in out  # the hostile one
    rc, out, err = run_cli(capsys, log, "--fail-on-recompile-pressure")
    assert rc == 1
    rc, out, err = run_cli(capsys, log, "--format", "json")
    rep = json.loads(out)
    assert rep["totals"]["recompile_pressure_frames"] == 2 and rep["recompile_pressure"][0]["compiles"] == 5


def test_closure_value_names_the_function_and_its_fix(guard, dynamo_reset):
    guard(recompile_warn_at=3)

    def make_score(w):
        return lambda score, b, h, q_idx, kv_idx: score + w

    def step(q, score_mod):
        return flex_attention(q, q, q, score_mod=score_mod)

    compiled = torch.compile(step, backend="aot_eager", dynamic=False)
    q = qkv()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for w in (1.0, 2.0, 3.0, 4.0):
            compiled(q, make_score(w))
    (event,) = flex_events("recompile_pressure")
    assert event["compiles"] == 3 and event["function"] == "step"
    assert "__closure__" in event["reason"] and event["varies"] == "a value score_mod closes over varies"
    assert "define mask_mod / score_mod once" in event["fix"]


def test_python_scalar_names_the_value(guard, dynamo_reset):
    guard(recompile_warn_at=2)

    def step(q, w):
        return flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score * w)

    compiled = torch.compile(step, backend="aot_eager", dynamic=False)
    q = qkv()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for w in (1, 2, 3):  # (an int: torch 2.15 makes a changing float a SymFloat, which flex refuses)
            compiled(q, w)  # (dynamic=False: automatic dynamic would make w a symbol, no churn)
    (event,) = flex_events("recompile_pressure")
    assert event["varies"] == "w varies" and "as a tensor" in event["fix"]


def test_after_a_dynamo_reset_the_count_starts_over(guard, dynamo_reset, dynamo_config):
    dynamo_config(recompile_limit=4)
    guard()
    compiled = torch.compile(attend, backend="aot_eager", dynamic=False)
    assert [len(w) for w in _calls(compiled, [16, 24, 32, 40])] == [0, 0, 1, 0]
    torch._dynamo.reset()
    assert [len(w) for w in _calls(compiled, [16, 24, 32])] == [0, 0, 1]
    assert [e["compiles"] for e in flex_events("recompile_pressure")] == [3, 3]


def test_frames_without_flex_are_not_counted(guard, dynamo_reset, dynamo_config):
    dynamo_config(recompile_limit=4)
    guard()
    compiled = torch.compile(lambda x: x * 2, backend="aot_eager", dynamic=False)
    for n in range(2, 6):
        compiled(torch.ones(n))
    assert flex_events("recompile_pressure") == []


def test_off_and_with_a_limit_of_one(guard, dynamo_reset, dynamo_config):
    """``recompile_warn_at=0``: never. A recompile limit of 1: nothing to warn before (the first
    compile is the last); the limit itself is still named at the dense call it causes."""
    dynamo_config(recompile_limit=8)
    guard(recompile_warn_at=0)
    compiled = torch.compile(attend, backend="aot_eager", dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for L in (16, 24, 32, 40, 48):
            compiled(*qkv(L=L))
    assert flex_events("recompile_pressure") == []

    torch._dynamo.reset()
    dynamo_config(recompile_limit=1)
    guard()  # the default threshold: half the limit, always below it
    compiled = torch.compile(attend, backend="aot_eager", dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for L in (16, 24):
            compiled(*qkv(L=L))
    assert flex_events("recompile_pressure") == []
    causes = [e["cause"] for e in flex_events()]  # (aot_eager runs flex dense: non_inductor_backend)
    assert "recompile_limit" in causes, f"the second length hit the limit of 1 and ran eagerly: {causes}"


def test_a_warning_turned_error_never_reaches_dynamo(guard, dynamo_reset, dynamo_config):
    """``-W error``: the warning is not raised into Dynamo's compile; the event is logged."""
    dynamo_config(recompile_limit=4)
    guard()
    compiled = torch.compile(attend, backend="aot_eager", dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", message="fusionguard: recompile pressure")
        for L in (16, 24, 32):
            assert compiled(*qkv(L=L)).shape[-2] == L
    assert len(flex_events("recompile_pressure")) == 1
    assert not flex_events("internal_error")


def test_disable_removes_the_seams(guard):
    from fusionguard import torch_internals as ti

    cls, name = ti.flex_trace_method()
    original = vars(cls)[name]
    guard()
    assert vars(cls)[name] is not original
    fusionguard.disable()
    assert vars(cls)[name] is original


# -- churn, not modes (#32 point 8) ---------------------------------------------------------------


class _Block(torch.nn.Module):
    def forward(self, x):
        if self.training:
            x = x * 0.5
        return flex_attention(x, x, x)


def _batches(n, full=4, last=3):
    for i in range(n):
        yield qkv(B=full if i < n - 1 else last, L=16)[0]


def test_the_standard_loop_compiles_four_times_and_never_warns(guard, dynamo_reset, dynamo_config):
    """Training, its last partial batch, no_grad evaluation, inference_mode: 4 compiles (grad mode,
    dispatch keys, the training flag, one partial batch), then none; over 3 epochs no warning."""
    dynamo_config(recompile_limit=8)
    guard()
    model = torch.compile(_Block(), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _epoch in range(3):
            model.train()
            for x in _batches(4):
                model(x)
            model.eval()
            with torch.no_grad():
                for x in _batches(2):
                    model(x)
            with torch.inference_mode():
                for x in _batches(2):
                    model(x)
    from fusionguard import torch_internals as ti

    assert len(ti.cache_entries(_Block.forward.__code__)) == 4, "the loop's own compiles"
    assert flex_events("recompile_pressure") == []
    assert not [w for w in caught if "recompile pressure" in str(w.message)]


def test_a_captured_float_that_changes_every_call_warns_before_the_limit(guard, dynamo_reset, dynamo_config):
    """A float the score_mod closes over, new on every call, with ``dynamic=False`` (under the
    default automatic dynamic shapes torch 2.13 makes it a symbol at the second compile, and the
    recompiles stop): a compile per call; the warning comes before the limit."""
    dynamo_config(recompile_limit=8)
    guard()
    scale = [1.0]

    def step(q):
        s = scale[0]
        return flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score * s)

    compiled = torch.compile(step, backend="aot_eager", dynamic=False)
    q = qkv()[0]
    issued = []
    for i in range(10):
        scale[0] = 1.0 + i / 8
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(q)
        issued.append(len([w for w in caught if "recompile pressure" in str(w.message)]))
    events = flex_events("recompile_pressure")
    assert len(events) == 1 and sum(issued) == 1, issued
    assert events[0]["compiles"] < 8, "warned before the limit"
    limit_calls = [e for e in flex_events() if e["cause"] == "recompile_limit"]
    assert limit_calls, "the float kept recompiling up to the limit"


def test_a_length_that_varies_on_every_call_warns_at_half_the_limit(guard, dynamo_reset, dynamo_config):
    dynamo_config(recompile_limit=8)
    guard()
    compiled = torch.compile(attend, backend="aot_eager", dynamic=False)
    issued = _calls(compiled, [16, 24, 32, 40, 48, 56])
    assert [len(w) for w in issued] == [0, 0, 0, 1, 0, 0]
    (event,) = flex_events("recompile_pressure")
    assert event["compiles"] == 4 and event["warn_at"] == 4


# -- an error filter: the warning arrives as the exception, at the user's call (#32 point 9) -------


def test_under_an_error_filter_the_warning_is_raised_at_the_first_run_and_the_graph_stays(guard, dynamo_reset, dynamo_config):
    """``filterwarnings("error", category=DenseFallbackWarning)`` (pytest's ``filterwarnings =
    error``): the warning is noted while Dynamo traces and issued at the first run of that
    compile's graph (Inductor), so the user gets ``DenseFallbackWarning`` itself at their line;
    Dynamo never sees it, so the cache entry stays and the next call of that length runs it."""
    from fusionguard import torch_internals as ti

    dynamo_config(recompile_limit=4)
    guard()
    compiled = torch.compile(attend, dynamic=False)  # Inductor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", category=fusionguard.DenseFallbackWarning)
        compiled(*qkv(L=16))
        compiled(*qkv(L=24))
        with pytest.raises(fusionguard.DenseFallbackWarning, match="recompile pressure") as info:
            compiled(*qkv(L=32))  # the third compile churns: the warning, as the filter asks
        assert compiled(*qkv(L=32)).shape[-2] == 32  # its graph was kept: no new compile
    assert len(ti.cache_entries(attend.__code__)) == 3
    assert "attend" in str(info.value) and "3 of 4" in str(info.value)
    assert info.traceback[-1].path.name != "pressure.py"
    assert len(flex_events("recompile_pressure")) == 1
    assert not flex_events("internal_error")
    assert {e["path"] for e in flex_events("flex_compile")} == {"fused"}
    assert flex_events() == [], "nothing ran dense"
