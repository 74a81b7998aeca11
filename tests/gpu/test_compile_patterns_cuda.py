"""Issue 17 on a GPU, in training: a graph break inside a compiled model (a compiler.disable'd
attention: dense; a torch._dynamo.graph_break(): fused) and per-block compile, forward and
backward named per layer with exact counts, and the rows summary() gives (the dense layer's
score-matrix size; compiled layers run no hooks, so no per-layer memory deltas there).

A fresh TORCHINDUCTOR_CACHE_DIR per test: a warm device keeps compiled graphs between calls.

    python -m pytest -q -m gpu tests/gpu/test_compile_patterns_cuda.py
"""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config
from compile_models import Model, tokens
from conftest import flex_events

import fusionguard
from fusionguard.core import state as _state
from fusionguard.report.build import build as build_report_dict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

SHAPE = dict(h=4, d=64)
SEQ = 256


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train(fn, n=2):
    for step in range(n):
        x = tokens(seed=step, device="cuda", requires_grad=True, l=SEQ, dtype=torch.bfloat16, **SHAPE)
        fn(x).float().sum().backward()
    torch.cuda.synchronize()


def rows():
    return {(r["layer"], r["phase"]): r for r in fusionguard.summary()}


def fused_by_layer(phase):
    out = {}
    for e in flex_events("flex_run"):
        if e["phase"] == phase:
            out[e["layer"]] = out.get(e["layer"], 0) + e["flex_calls"]
    return out


def check_report(log, expected):
    fusionguard.disable()
    got = {(r["layer"], r["phase"]): (r["fused"] or 0, r["dense"]) for r in build_report_dict([str(log)])["rows"]}
    assert got == expected


@pytest.mark.parametrize("brk", ["disable", "graph_break"])
def test_graph_broken_model_in_training_names_every_layer(guard, fresh_cache, brk):
    # torch 2.11 segfaults by itself in AOTAutograd's cache save for a compiler.disable'd method
    # on a cold cache (with or without fusionguard): that cache off for this run
    with torch._functorch.config.patch(enable_autograd_cache=False):
        log = guard(keep_all=True)
        torch.manual_seed(0)
        model = Model(brk=brk, **SHAPE).cuda().to(torch.bfloat16)
        compiled = torch.compile(model)
        with fusionguard.watch(model):
            train(compiled)
    dense_1 = brk == "disable"
    counts = _state.STATE.counts
    assert counts["fused_runs_forward"] == counts["fused_runs_backward"] == (2 if dense_1 else 4)
    for phase in ("forward", "backward"):
        assert fused_by_layer(phase) == ({"layers.0.attn": 2} if dense_1 else {"layers.0.attn": 2, "layers.1.attn": 2})
    r = rows()
    assert (r[("layers.0.attn", "forward")]["fused"], r[("layers.0.attn", "backward")]["fused"]) == (2, 2)
    expected = {("layers.0.attn", "forward"): (2, 0), ("layers.0.attn", "backward"): (2, 0)}
    if dense_1:
        assert [(e["layer"], e["phase"]) for e in flex_events()] == [("layers.1.attn", "forward"), ("layers.1.attn", "backward")] * 2
        for phase in ("forward", "backward"):
            row = r[("layers.1.attn", phase)]
            assert row["dense"] == 2 and row["fused"] == 0 and (row["scores_bytes"] or 0) >= 4 * SEQ * SEQ * 2  # B*H*Q*KV
            expected[("layers.1.attn", phase)] = (0, 2)
    else:
        assert flex_events() == []
        for phase in ("forward", "backward"):
            assert r[("layers.1.attn", phase)]["fused"] == 2
            expected[("layers.1.attn", phase)] = (2, 0)
    assert not [k for k in r if k[0] in ("", None)]
    check_report(log, expected)


@pytest.mark.parametrize("watched", [True, False], ids=["watch", "no_watch"])
def test_per_block_compile_in_training_names_every_block(guard, fresh_cache, watched):
    """Also without watch() (issue 28: fusionguard run): the block is found in the model holding
    it, and each backward run takes the names its forward run left on AOTAutograd's ctx."""
    import contextlib
    import gc

    gc.collect()  # (no Model of an earlier test left as garbage: it would make the names partial)
    log = guard(keep_all=True)
    torch.manual_seed(0)
    model = Model(**SHAPE).cuda().to(torch.bfloat16)
    for block in model.layers:
        block.compile()
    with fusionguard.watch(model) if watched else contextlib.nullcontext():
        train(model)
    counts = _state.STATE.counts
    assert counts["fused_runs_forward"] == counts["fused_runs_backward"] == 4
    runs = [(e["layer"], e["phase"]) for e in flex_events("flex_run")]
    assert (
        runs
        == [("layers.0.attn", "forward"), ("layers.1.attn", "forward"), ("layers.1.attn", "backward"), ("layers.0.attn", "backward")] * 2
    )
    bw = [e for e in flex_events("flex_compile") if e["phase"] == "backward"]
    # compiled at the first backward (block 1's): named by its forward run; or, where AOTAutograd
    # compiles it with the forward, by the compiling frame's block
    assert len(bw) == 1 and (bw[0]["layer"], bw[0]["named_from"]) in (
        ("layers.1.attn", "forward_run"),
        ("layers.0.attn", "nn_module_stack"),
    )
    r = rows()
    assert sorted(r) == [(f"layers.{i}.attn", p) for i in (0, 1) for p in ("backward", "forward")]
    assert all(row["fused"] == 2 and row["dense"] == 0 for row in r.values())
    check_report(log, {k: (2, 0) for k in r})


@pytest.mark.parametrize("pattern", ["torch.compile(model)", "compiled function", "model.compile()"])
def test_watch_before_the_compile_keeps_its_hooks_out_of_dynamos_sight_in_training(guard, fresh_cache, pattern):
    """#24: watch(model) entered before the model is compiled (fusionguard cannot know it will
    be): Dynamo compiles it without watch()'s hooks (one frame, no watch_traced), the backward
    compiled at its first run too, and every fused call, forward and backward, is counted and
    named per layer; the hooks are back on the model for its eager calls."""
    from torch._dynamo.testing import CompileCounterWithBackend

    log = guard(keep_all=True)
    torch.manual_seed(0)
    model = Model(**SHAPE).cuda().to(torch.bfloat16)
    counter = CompileCounterWithBackend("inductor")
    with fusionguard.watch(model):
        if pattern == "torch.compile(model)":
            step = torch.compile(model, backend=counter)
        elif pattern == "compiled function":
            step = torch.compile(lambda x: model(x), backend=counter)
        else:
            model.compile(backend=counter)
            step = model
        train(step)
        assert all(len(m._forward_pre_hooks) == 1 for m in (model, model.layers[0], model.layers[0].attn))
    assert counter.frame_count == 1 and fusionguard.events("watch_traced") == []
    counts = _state.STATE.counts
    assert counts["fused_runs_forward"] == counts["fused_runs_backward"] == 4
    for phase in ("forward", "backward"):
        got = fused_by_layer(phase)
        # (a compiled function's graph names the model by its source there, e.g. L['model'])
        assert sorted(got.values()) == [2, 2] and sorted(k.rsplit("layers.", 1)[-1] for k in got) == ["0.attn", "1.attn"], got
    if pattern != "compiled function":
        check_report(log, {(f"layers.{i}.attn", p): (2, 0) for i in (0, 1) for p in ("forward", "backward")})
