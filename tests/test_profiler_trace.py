"""fusionguard's ranges in a real ``torch.profiler`` trace (#26): recorded on CPU, exported with
``export_chrome_trace``, parsed back; names, counts and nesting around the dense kernels' ops."""

from __future__ import annotations

import json
import timeit
import warnings

import pytest
import torch
from conftest import flex_events, op_call, qkv
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.profiler import ProfilerActivity, profile, record_function

import fusionguard
from fusionguard.core import profiler as profiling

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _trace(prof, tmp_path, name="trace.json"):
    """The exported chrome trace's complete events ("X"), as a list of dicts."""
    path = tmp_path / name
    prof.export_chrome_trace(str(path))
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def _ours(events, prefix="fusionguard: "):
    return [e for e in events if e["name"].startswith(prefix)]


def _inside(outer, events):
    """The events on ``outer``'s thread that lie within its time span (the profiler's nesting)."""
    lo, hi = outer["ts"], outer["ts"] + outer["dur"]
    return [e for e in events if e is not outer and e.get("tid") == outer.get("tid") and lo <= e["ts"] and e["ts"] + e["dur"] <= hi]


class Attn(nn.Module):
    def forward(self, q, k, v):
        return flex_attention(q, k, v)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Attn(), Attn()])

    def forward(self, q, k, v):
        for layer in self.layers:
            q = layer(q, k, v)
        return q


def test_recording_is_the_profilers_state():
    assert profiling.recording() is False
    with profile(activities=[ProfilerActivity.CPU]):
        assert profiling.recording() is True
    assert profiling.recording() is False


def test_eager_dense_calls_are_ranges_around_their_kernels(guard, tmp_path):
    guard(dense_first=1)  # the log keeps the first of each dense call; the trace every call
    model = Model()
    q, k, v = qkv(L=16)
    with fusionguard.watch(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(q, k, v)  # outside the profiler: no range anywhere
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                with record_function("user_step"):
                    model(q, k, v)
    events = _trace(prof, tmp_path)
    ours = _ours(events)
    names = [e["name"] for e in ours]
    size = "2.05 KB"  # 1*2*16*16 fp32 = 2,048 bytes
    assert names == [f"fusionguard: dense forward layers.{i} (eager_call, {size})" for _ in range(3) for i in (0, 1)], names
    # sampled: the log holds fewer full flex_call events than the trace has ranges
    assert len(flex_events()) < len(ours)
    steps = [e for e in events if e["name"] == "user_step"]
    assert len(steps) == 3
    for step in steps:
        assert len([e for e in _inside(step, ours)]) == 2  # each step's two layers, inside the step
    for r in ours:
        inner = {e["name"] for e in _inside(r, events)}
        # the dense kernel's own ops (the score matrix's softmax math) run inside the range
        assert inner & {"aten::exp", "aten::exp2", "aten::softmax", "aten::_softmax"}, (r["name"], inner)
        assert not _ours(_inside(r, events)), "ranges do not nest in each other"


def test_dense_backward_and_blocked_calls_are_in_the_trace(guard, tmp_path):
    guard()
    q, k, v = qkv(L=16, requires_grad=True)
    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU]) as prof:
        warnings.simplefilter("ignore")
        out = op_call(q, k, v)[0]  # the operator: on CPU the only way to a dense backward
        out.sum().backward()
    names = [e["name"] for e in _ours(_trace(prof, tmp_path))]
    assert any(n.startswith("fusionguard: dense forward unnamed (") for n in names), names
    back = [n for n in names if n.startswith("fusionguard: dense backward")]
    assert back and back[0].endswith(", 2.05 KB)"), names

    fusionguard.disable()
    guard(strict=True)
    q, k, v = qkv(L=16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(fusionguard.DenseFallbackError):
            flex_attention(q, k, v)
    events = _trace(prof, tmp_path, "blocked.json")
    blocked = _ours(events)
    assert [e["name"] for e in blocked] == ["fusionguard: dense forward unnamed blocked (eager_call, 2.05 KB)"]
    assert not {e["name"] for e in _inside(blocked[0], events)} & {"aten::exp", "aten::exp2", "aten::softmax"}  # nothing ran


def test_hostile_layer_names_are_escaped_and_bounded():
    name = profiling.dense_name(
        {"phase": "forward", "layer": "a\x1b[31m\n" + "x" * 1000, "cause": "eager", "scores_bytes": 10**9, "action": "warn"}
    )
    assert "\x1b" not in name and "\n" not in name and len(name) <= profiling.MAX_NAME
    fused = profiling.fused_name([("forward", tuple(f"layers.{i}" for i in range(40)))])
    assert fused.startswith("fusionguard: fused forward layers.0, layers.1") and "+32 more" in fused and "(40 flex calls)" in fused
    assert profiling.fused_name([("backward", (None,))]) == "fusionguard: fused backward unnamed (1 flex call)"


@pytest.mark.slow
def test_compiled_graph_runs_are_ranges_with_no_recompile(guard, tmp_path, dynamo_reset, dynamo_config):
    """Inductor-compiled flex_attention (fused on CPU): one range per graph run, every run (the
    log samples them), inside Inductor's own graph-call range; no graph break, no recompile."""
    guard(fused_first=1)
    dynamo_config(error_on_recompile=True)
    compiled = torch.compile(flex_attention, fullgraph=True)
    q, k, v = qkv(L=128, D=16)
    compiled(q, k, v)  # compile outside the profiler
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            compiled(q, k, v)
    compiled(q, k, v)  # after: same graph, no recompile (error_on_recompile)
    events = _trace(prof, tmp_path)
    ours = _ours(events)
    assert [e["name"] for e in ours] == ["fusionguard: fused forward unnamed (1 flex call)"] * 4
    assert len([e for e in fusionguard.events() if e["event"] == "flex_run"]) < 4 + 2  # the log sampled
    graph_calls = [e for e in events if "CompiledFxGraph" in e["name"]]
    if graph_calls:  # Inductor's own range around the graph call, where this release has it
        assert all(any(r in _inside(g, events) for g in graph_calls) for r in ours)
    assert not [e for e in events if e["name"].startswith("fusionguard: dense")]


def test_idle_check_is_cheap():
    """No profiler: the wrappers' only new work is this check (about 0.06 us, against about
    13 us for an idle record_function); bounded loosely for a shared machine."""
    n = 20000
    per_call = min(timeit.repeat(profiling.recording, number=n, repeat=5)) / n
    assert per_call < 2e-6, per_call
