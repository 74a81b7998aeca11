"""Names without ``watch()`` (issue 28: ``fusionguard run``, an integration that cannot reach the
root model). Dynamo names modules relative to the frame it compiled; without ``watch(model)``
fusionguard finds that frame's module in the model holding it, so the names are the model's own
(``layers.1.attn``), or visibly partial (``Block[1].attn``) when no model holds it, and never
does one row add up two layers' calls. Real compiles on CPU (inference); per-block compile under
FSDP2 in tests/test_distributed.py, a Hugging Face model in tests/test_hf.py."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from compile_models import Block, Model, tokens
from conftest import ROOT, flex_events, read_jsonl

import fusionguard
from fusionguard import _testing
from fusionguard.core import state as _state
from fusionguard.report.build import build as build_report_dict
from fusionguard.watching import paths
from fusionguard.watching.paths import module_path

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def steps(fn, n=2):
    with torch.no_grad():
        for _ in range(n):
            fn(tokens())


def rows():
    return {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in fusionguard.summary()}


def report_rows(log):
    fusionguard.disable()
    return {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in build_report_dict([str(log)])["rows"]}


def run_names():
    out = []
    for e in flex_events("flex_run"):
        out.extend([e["layer"]] * e.get("flex_calls", 1))
    return out


@pytest.fixture
def fresh():
    """No modules of earlier tests left as garbage: they would be found as other models."""
    gc.collect()
    yield
    gc.collect()


def test_per_block_compile_without_watch_names_each_block(guard, dynamo_reset, fresh):
    """torchtitan's pattern, no watch(): one graph serves both blocks, named relative to the block
    (``attn``); each run is named by the block running it, from the model holding it."""
    log = guard(keep_all=True)
    model = Model()
    for block in model.layers:
        block.compile()
    steps(model, 3)
    assert [e["layer"] for e in flex_events("flex_compile")] == ["layers.0.attn"]
    assert run_names() == ["layers.0.attn", "layers.1.attn"] * 3
    assert _state.STATE.counts["fused_runs_forward"] == 6
    expected = {("layers.0.attn", "forward"): (3, 0), ("layers.1.attn", "forward"): (3, 0)}
    assert rows() == expected
    assert report_rows(log) == expected
    assert flex_events("partial_names") == []


def test_dense_calls_without_watch_are_named_by_the_module_running_them(guard, dynamo_reset, fresh):
    """Per-block compile with layer 1's attention in a ``torch.compiler.disable``d method: its
    calls run eagerly, densely, and are named by the attention module whose forward made them."""
    log = guard(keep_all=True)
    model = Model(brk="disable")
    for block in model.layers:
        block.compile()
    with pytest.warns(fusionguard.DenseFallbackWarning, match="forward in layers.1.attn"):
        steps(model)
    assert [e["layer"] for e in flex_events()] == ["layers.1.attn"] * 2
    expected = {("layers.0.attn", "forward"): (2, 0), ("layers.1.attn", "forward"): (0, 2)}
    assert rows() == expected
    assert report_rows(log) == expected


def test_whole_model_compile_without_watch_names_match_named_modules(guard, dynamo_reset, fresh):
    """torch.compile(model): one graph with both layers' calls, named as named_modules() says."""
    log = guard(keep_all=True)
    model = Model()
    steps(torch.compile(model))
    attn = [n for n, m in model.named_modules() if n.endswith("attn")]
    assert sorted(e["layer"] for e in flex_events("flex_compile")) == attn == ["layers.0.attn", "layers.1.attn"]
    assert sorted(run_names()) == sorted(attn * 2)
    expected = {(n, "forward"): (2, 0) for n in attn}
    assert rows() == expected
    assert report_rows(log) == expected


def test_blocks_no_model_holds_get_partial_distinct_names_and_one_note(guard, dynamo_reset, fresh, capsys):
    """Blocks kept in a plain list: no model names them. The names are visibly partial and still
    tell the blocks apart, with one note that watch(model) gives full names."""
    log = guard(keep_all=True)
    blocks = [Block(), Block(), Block()]
    for b in blocks:
        b.compile()

    def run(x):
        for b in blocks:
            x = b(x)
        return x

    steps(run)
    names = ["Block[0].attn", "Block[1].attn", "Block[2].attn"]
    assert run_names() == names * 2
    assert rows() == {(n, "forward"): (2, 0) for n in names}
    notes = flex_events("partial_names")
    assert len(notes) == 1 and notes[0]["fix"] == "fusionguard.watch(model)"
    assert [line for line in capsys.readouterr().err.splitlines() if "partial" in line] == [
        "fusionguard: layer names such as 'Block[0].…' are partial: no single model holding these "
        "modules was found; fusionguard.watch(model) gives full names"
    ]
    assert report_rows(log) == {(n, "forward"): (2, 0) for n in names}


def test_module_path_follows_wrappers_and_models_made_later(fresh):
    """torch.compile's wrapper adds no name (as under watch()); a model created after the first
    lookup is found by a new scan; two live models of one class get partial roots, and so do
    modules met after the scans' budget is spent."""
    _testing.reset_for_tests()
    model = Model()
    wrapped = torch.compile(model)  # an OptimizedModule holding model as _orig_mod
    assert module_path(model.layers[1].attn) == "layers.1.attn"
    assert module_path(model) == ""
    assert module_path(wrapped) == ""
    assert module_path(object()) is None
    scans = _state.STATE.caches.module_paths.scans
    assert module_path(model.layers[0]) == "layers.0"  # known: no new scan
    assert _state.STATE.caches.module_paths.scans == scans
    other = Model()
    assert module_path(other.layers[0].attn) == "Model[0].layers.0.attn"  # two Models: partial
    assert module_path(model.layers[0].attn) == "layers.0.attn"  # named before: kept
    _state.STATE.caches.module_paths.scans = paths.MAX_SCANS  # (a program that made modules forever)
    late = Model()
    assert module_path(late.layers[1]) == "Block[0]"  # no scan: partial, still its own
    assert module_path(late.layers[1].attn) == "Block[0].attn"
    assert module_path(late.layers[0]) == "Block[1]"
    del wrapped, other, late
    _testing.reset_for_tests()


def test_two_models_of_different_classes_never_share_rows(fresh):
    """A policy and a reward model (different classes, the same layer paths) alive together:
    the first named keeps the root names, the other is named partially; never one name for both."""
    _testing.reset_for_tests()

    class Reward(Model):
        pass

    policy, reward = Model(), Reward()
    assert module_path(policy.layers[0].attn) == "layers.0.attn"
    assert module_path(reward.layers[0].attn) == "Reward[0].layers.0.attn"
    assert module_path(reward.layers[1].attn) == "Reward[0].layers.1.attn"
    del policy
    gc.collect()
    newer = Reward()  # the rooted model is gone: a later one may take the root again
    assert module_path(newer.layers[0].attn) in ("layers.0.attn", "Reward[1].layers.0.attn")
    assert module_path(newer.layers[0].attn) != module_path(reward.layers[0].attn)
    del reward, newer
    _testing.reset_for_tests()


_RUN = textwrap.dedent(
    """
    import json, sys, torch
    sys.path[:0] = [{tests!r}]
    from compile_models import Block, Model, tokens

    model = Model()
    for block in model.layers:  # per-block compile
        block.compile()
    loose = [Block(), Block()]  # blocks no model holds
    for b in loose:
        b.compile()
    with torch.no_grad():
        for _ in range(3):
            model(tokens())
            x = tokens()
            for b in loose:
                x = b(x)
    import fusionguard
    json.dump(list(fusionguard.summary()), open(sys.argv[1], "w"), default=str)
    """
)


def test_under_fusionguard_run_every_pattern_is_named_per_layer(tmp_path):
    """A script that knows nothing of fusionguard, under ``fusionguard run``: a model
    compiled per block and blocks no model holds (whole-model compile: tests/test_hf.py). The
    summary and the report have one row per layer, with that layer's calls."""
    script, logs, out = tmp_path / "train.py", tmp_path / "logs", tmp_path / "rows.json"
    script.write_text(_RUN.format(tests=str(ROOT / "tests")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSIONGUARD")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "fusionguard", "run", "--log", f"{logs}/", "--", sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = {r["layer"]: (r["fused"], r["dense"]) for r in json.loads(out.read_text())}
    expected = {n: (3, 0) for n in ("layers.0.attn", "layers.1.attn", "Block[0].attn", "Block[1].attn")}
    assert summary == expected
    rep = build_report_dict([str(logs)])
    assert {r["layer"]: (r["fused"], r["dense"]) for r in rep["rows"]} == expected
    assert [w for w in rep["warnings"] if "partial" in w or "unknown" in w] == [
        "some layer names are partial (Class[i]...: the model holding them was not known); fusionguard.watch(model) gives full names"
    ]
    (log,) = logs.glob("*.jsonl")
    assert sum(e["event"] == "partial_names" for e in read_jsonl(log)) == 1
    assert "are partial" in proc.stderr
