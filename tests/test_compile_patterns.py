"""Names and exact per-layer counts on the compile patterns real training code uses (issue 17):
graph breaks inside a compiled model, Inductor caches filled by another run (with or without
fusionguard), graphs compiled before ``enable()``, per-block compile. Real compiles on CPU
(inference: CPU FlexAttention has no backward); the training versions are in
tests/gpu/test_compile_patterns_cuda.py, per-block under FSDP2 in tests/test_distributed.py."""

from __future__ import annotations

import json
import sys
import textwrap

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
import torch
from compile_models import Model, tokens
from conftest import ROOT, child_env, flex_events, needs, read_jsonl
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard
from fusionguard import _testing
from fusionguard.core import state as _state
from fusionguard.core.tables import NO_LAYER
from fusionguard.report.build import build as build_report_dict

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def steps(fn, n=2):
    with torch.no_grad():
        for _ in range(n):
            fn(tokens())


def rows():
    """{(layer, phase): (fused, dense)} from summary()."""
    return {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in fusionguard.summary()}


def report_rows(log):
    fusionguard.disable()  # (the summary and shutdown events end the log)
    return {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in build_report_dict([str(log)])["rows"]}


def run_names():
    """The layer of each fused call the flex_run events count, in order (an event per layer of
    a graph run: its ``flex_calls`` are that layer's)."""
    out = []
    for e in flex_events("flex_run"):
        assert e["layers"] == ([e["layer"]] if e["layer"] else None)
        out.extend([e["layer"]] * e["flex_calls"])
    return out


@pytest.mark.parametrize("brk", ["disable", "graph_break"])
def test_graph_break_inside_a_compiled_model_keeps_names_and_counts(guard, dynamo_reset, brk):
    """torch.compile(model) with layer 1's attention behind a graph break: each frame Dynamo
    compiles (a block's forward, the attention's) names its calls relative to its own module,
    and that module is named at run time. ``disable``: layer 1's call runs eagerly, densely."""
    log = guard(keep_all=True)
    model = Model(brk=brk)
    compiled = torch.compile(model)
    with fusionguard.watch(model):
        steps(compiled)
    dense_1 = brk == "disable"
    assert {e["layer"] for e in flex_events("flex_compile")} == ({"layers.0.attn"} if dense_1 else {"layers.0.attn", "layers.1.attn"})
    assert all(e["named_from"] == "nn_module_stack" for e in flex_events("flex_compile"))
    fused = run_names()
    assert sorted(fused) == (["layers.0.attn"] * 2 if dense_1 else ["layers.0.attn"] * 2 + ["layers.1.attn"] * 2)
    assert _state.STATE.counts["fused_runs_forward"] == len(fused)
    assert [e["layer"] for e in flex_events()] == (["layers.1.attn"] * 2 if dense_1 else [])
    expected = {("layers.0.attn", "forward"): (2, 0), ("layers.1.attn", "forward"): (0, 2) if dense_1 else (2, 0)}
    assert rows() == expected
    assert report_rows(log) == expected


def test_per_block_compile_names_each_block(guard, dynamo_reset):
    """torchtitan's pattern: each block compiled in place (``block.compile()``). One graph serves
    both blocks (Dynamo compiled ``Module._call_impl`` once, names relative to the block); each
    run is named by the block running it. disable() puts the graph's own callable back."""
    from fusionguard import torch_internals as ti

    log = guard(keep_all=True)
    model = Model()
    for block in model.layers:
        block.compile()
    with fusionguard.watch(model):
        steps(model)
    assert run_names() == ["layers.0.attn", "layers.1.attn"] * 2
    assert _state.STATE.counts["fused_runs_forward"] == 4
    expected = {("layers.0.attn", "forward"): (2, 0), ("layers.1.attn", "forward"): (2, 0)}
    assert rows() == expected  # (no '' row for the model around the blocks)
    wrapped = [
        (g, g.current_callable.__wrapped__) for g in ti.found_compiled_graphs() if hasattr(g.current_callable, "_fusionguard_records")
    ]
    assert wrapped
    assert report_rows(log) == expected  # (disables)
    assert all(g.current_callable is original for g, original in wrapped)


def causal(b, h, q, kv):
    return q >= kv


def local(b, h, q, kv):
    return q - kv < 8


class MaskedAttention(nn.Module):
    """Hugging Face's pattern: every layer calls one process-wide compiled flex_attention."""

    flex = None

    def __init__(self, mask_mod):
        super().__init__()
        self.mask_mod = mask_mod

    def forward(self, q):
        mask = create_block_mask(self.mask_mod, None, None, q.shape[2], q.shape[2], device="cpu")
        return MaskedAttention.flex(q, q.clone(), q.clone(), block_mask=mask)  # (2.8 refuses one buffer for q, k, v)


class Masked(nn.Module):
    def __init__(self, *masks):
        super().__init__()
        self.layers = nn.ModuleList(MaskedAttention(m) for m in masks)

    def forward(self, q):
        for layer in self.layers:
            q = layer(q)
        return q


def test_a_cache_hit_is_named_by_the_layer_running_it_now(guard, dynamo_reset, tmp_path, monkeypatch):
    """A graph compiled (and cached) while another model's layers.0 ran it, served from the
    cache to this model's layers.1: its record names layers.1, not the stored layers.0."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    log = guard(keep_all=True)
    MaskedAttention.flex = torch.compile(flex_attention)
    q = torch.randn(1, 2, 32, 8)
    other = Masked(local)
    with fusionguard.watch(other), torch.no_grad():
        other(q)
    torch._dynamo.reset()  # as in a new process: Dynamo compiles again, Inductor's caches answer
    model = Masked(causal, local)
    with fusionguard.watch(model), torch.no_grad():
        model(q)
        model(q)
    records = [(e["layer"], e["source"]) for e in flex_events("flex_compile")]
    assert records == [("layers.0", "lowering"), ("layers.0", "lowering"), ("layers.1", "cache")]
    assert [e["layer"] for e in flex_events("flex_run")] == ["layers.0"] + ["layers.0", "layers.1"] * 2
    expected = {("layers.0", "forward"): (3, 0), ("layers.1", "forward"): (2, 0)}  # (other's layers.0 too)
    assert rows() == expected
    assert report_rows(log) == expected


@needs("graph_text")
def test_a_cache_filled_without_fusionguard_is_named_from_this_compile(guard, dynamo_reset, tmp_path, monkeypatch):
    """Yesterday's job filled Inductor's caches without fusionguard (no sidecar): the names come
    from the FX graph Dynamo traces in this process (it always does; only Inductor's work is
    cached), so no cache key changes and no extra compile."""
    import gc

    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    with torch.no_grad():  # fusionguard not enabled yet: as in a process without it
        torch.compile(Model())(tokens())
    assert not (cache / "fusionguard").exists()
    torch._dynamo.reset()  # Dynamo compiles again; Inductor's and AOTAutograd's caches answer
    gc.collect()
    log = guard(keep_all=True)
    model = Model()
    compiled = torch.compile(model)
    with fusionguard.watch(model):
        steps(compiled)
    records = flex_events("flex_compile")
    assert [(e["layer"], e["source"], e["named_from"]) for e in records] == [
        ("layers.0.attn", "cache", "nn_module_stack"),
        ("layers.1.attn", "cache", "nn_module_stack"),
    ]
    assert run_names() == ["layers.0.attn", "layers.1.attn"] * 2
    assert [e["graph_calls"] for e in flex_events("flex_run")] == [2] * 4  # one graph, two layers' calls
    expected = {("layers.0.attn", "forward"): (2, 0), ("layers.1.attn", "forward"): (2, 0)}
    assert rows() == expected
    assert report_rows(log) == expected


_BEFORE = textwrap.dedent(
    """
    import json, sys, time, torch
    sys.path[:0] = [{root!r}, {tests!r}]
    import fusionguard
    from fusionguard.core import state as _state
    from compile_models import Model, tokens
    from torch.nn.attention.flex_attention import flex_attention

    class Attend(torch.nn.Module):  # eager layers calling one compiled flex_attention
        def forward(self, q):
            return flex(q, q.clone(), q.clone())

    def per_block(model):
        for block in model.layers:
            block.compile()
        return model

    flex = torch.compile(flex_attention)
    q = torch.randn(1, 2, 32, 8)
    with torch.no_grad():  # an eval copy, a warm-up: compiled before enable()
        torch.compile(Model())(tokens())
        per_block(Model())(tokens())
        flex(q, q.clone(), q.clone())
    fusionguard.enable(log_path=sys.argv[1], keep_all=True)
    model, blocks, layers = Model(), per_block(Model()), torch.nn.ModuleList([Attend(), Attend()])
    compiled = torch.compile(model)  # Dynamo reuses the graphs compiled above
    with fusionguard.watch(model, blocks, layers), torch.no_grad():
        for _ in range(2):
            compiled(tokens())
            blocks(tokens())
            for layer in layers:
                layer(q)
    json.dump({{"counts": dict(_state.STATE.counts), "rows": list(fusionguard.summary())}}, open(sys.argv[2], "w"), default=str)
    fusionguard.disable()
    """
)


@needs("graph_text")
def test_graphs_compiled_before_enable_are_found_and_counted(tmp_path):
    """enable() finds the compiled graphs living in the process: each is recorded at its first
    run and counted from then on. They carry no module paths: a graph is named by the watched
    module whose frame runs it (a block of a per-block compile: the block), or by the hooked
    layer running it (a compiled flex_attention); a graph of several layers' calls under the
    model itself cannot be: ``unseen_graphs`` in the header, with the fix. (A process of its
    own: earlier tests' graphs would be found too.)"""
    script, log, out = tmp_path / "before.py", tmp_path / "fg.jsonl", tmp_path / "out.json"
    script.write_text(_BEFORE.format(root=str(ROOT), tests=str(ROOT / "tests")))
    proc = forkserver.run([sys.executable, str(script), str(log), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_jsonl(log)
    header = events[0]
    assert header["event"] == "header" and header["unseen_graphs"] == 1
    assert "fusionguard.enable() before the first torch.compile" in header["unseen_graphs_fix"]
    (found,) = [e for e in events if e["event"] == "compiled_before_enable"]
    assert found["graphs"] == 3 and found["counted"] == 3 and found["unseen_graphs"] == 1
    assert found["search_ms"] < 1000
    records = sorted((e["layer"] or "", e["source"], e["named_from"]) for e in events if e["event"] == "flex_compile")
    assert records == [("", "before_enable", None)] * 2 + [("0", "before_enable", "first_run"), ("layers.0", "before_enable", "first_run")]
    runs = [(e["layer"], e["flex_calls"]) for e in events if e["event"] == "flex_run"]
    expected_runs = [(None, 2)] * 2 + [("layers.0", 1), ("layers.1", 1)] * 2 + [("0", 1), ("1", 1)] * 2
    assert sorted(runs, key=str) == sorted(expected_runs, key=str)
    result = json.loads(out.read_text())
    assert result["counts"]["fused_runs_forward"] == 3 * 2 * 2
    # the model's graph's 4 calls stay unnamed: summary() counts them under "(no layer)", as the report does (#24)
    assert {(r["layer"], r["fused"]) for r in result["rows"]} == {("0", 2), ("1", 2), ("layers.0", 2), ("layers.1", 2), (NO_LAYER, 4)}
    assert {(r["layer"], r["fused"]) for r in build_report_dict([str(log)])["rows"] if r["fused"]} == {
        (r["layer"], r["fused"]) for r in result["rows"]
    }


def test_a_compiled_model_keeps_its_names_over_disable_and_enable(tmp_path, dynamo_reset):
    """#33: a notebook runs ``with fusionguard.track(model):`` twice on one compiled model; the
    first session's end disables fusionguard (it made the enable()), the second enables again,
    and Dynamo runs the graph it already compiled. That graph, found living at the second
    ``enable()``, kept the names it was compiled with: the second session's rows are named as
    the first's (they were ``(no layer)``), and its log's records too."""
    model = Model()
    compiled = torch.compile(model)
    sessions = []
    for i in range(2):
        log = tmp_path / f"fg{i}.jsonl"
        with fusionguard.track(model, log_path=str(log)) as fg:
            steps(compiled)
        assert not fusionguard.is_enabled()
        sessions.append((fg.counts(), read_jsonl(log)))
    (first, _), (second, events) = sessions
    named = [(r["layer"], r["phase"], r["fused"]) for r in first.rows]
    assert named == [("layers.0.attn", "forward", 2), ("layers.1.attn", "forward", 2)]
    assert [(r["layer"], r["phase"], r["fused"]) for r in second.rows] == named
    records = [(e["layer"], e["source"], e["named_from"]) for e in events if e["event"] == "flex_compile"]
    assert records == [("layers.0.attn", "before_enable", "nn_module_stack"), ("layers.1.attn", "before_enable", "nn_module_stack")]
    _testing.reset_for_tests()


def test_a_compiled_flex_attention_is_counted_by_a_second_session(dynamo_reset):
    """#33 (hostile7): on torch 2.7 a second session counted no call of ``torch.compile(flex_attention)``
    compiled under the first ("the model never ran flex" while it ran fused): 2.7 keeps no graph
    text, and its CPU template's code never names flex_attention, so the living graph went unfound
    at the second ``enable()``. A graph an earlier ``enable()`` counted is found by that record."""
    flex = torch.compile(flex_attention)
    q = torch.randn(1, 2, 16, 16)
    counted = []
    for _ in range(2):
        with torch.no_grad(), fusionguard.track(None, log_path=False) as fg:
            flex(q, q.clone(), q.clone())
            flex(q, q.clone(), q.clone())
        counted.append((fg.counts().fused, fg.counts().dense))
    assert counted == [(2, 0), (2, 0)]
    _testing.reset_for_tests()


_HEDGE = textwrap.dedent(
    """
    import json, torch, fusionguard

    lin = torch.nn.Linear(8, 8)

    def said():
        with torch.no_grad(), fusionguard.track(lin, log_path=False) as fg:
            lin(torch.randn(2, 8))
            return fg.verdict("v").text

    first = said()  # nothing compiled yet
    with torch.no_grad():
        torch.compile(lin)(torch.randn(2, 8))  # Inductor compiles a graph between the sessions
    print(json.dumps([first, said()]))
    """
)


def test_the_never_ran_flex_hedge_needs_a_graph_compiled(tmp_path):
    """#33 (hostile8): on torch 2.7 "graphs compiled before enable() are not seen on this torch"
    was said in a program that never compiled anything: the hedge asked whether Inductor's
    ``CompiledFxGraph`` module was loaded, and ``enable()`` itself loads it. It is said once
    Inductor has compiled (or loaded) a graph, and only on a torch that cannot see one (2.7)."""
    proc = forkserver.run(  # (a process of its own where nothing was compiled; its interpreter's start is not the point)
        [sys.executable, "-c", _HEDGE], capture_output=True, text=True, timeout=600, env=child_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    hedge = "graphs compiled before enable() are not seen on this torch"
    assert first == "fusionguard: v: no FlexAttention call: the model never ran flex"
    assert (hedge in second) is (torch.__version__ < "2.8"), second
