"""Issue 26 on a GPU, in training: fusionguard's ranges in a CUDA ``torch.profiler`` trace.
Eager (dense) forward and backward: one range per layer and phase, and the CUDA kernels the dense
math launches are launched from inside them (by correlation id); compiled (fused): one range per
graph run, forward and backward, naming the layers, around the fused Triton kernels' launches.

    python -m pytest -q -m gpu tests/gpu/test_profiler_cuda.py
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.profiler import ProfilerActivity, profile

import fusionguard
from fusionguard import _testing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


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


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    fusionguard.enable(log_path=False)
    yield
    fusionguard.disable()
    _testing.reset_for_tests()
    torch._dynamo.reset()


def _traced(model, tmp_path, name):
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(q, k, v).sum().backward()  # warm-up / compile outside the profiler
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                model(q, k, v).sum().backward()
            torch.cuda.synchronize()
    path = tmp_path / f"{name}.json"
    prof.export_chrome_trace(str(path))
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def _kernels_inside(r, events):
    """The GPU kernels launched from inside range ``r`` (same thread, by correlation id)."""
    lo, hi = r["ts"], r["ts"] + r["dur"]
    corr = {
        (e.get("args") or {}).get("correlation")
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("tid") == r.get("tid") and lo <= e["ts"] <= hi
    }
    corr.discard(None)
    return [e for e in events if e.get("cat") == "kernel" and (e.get("args") or {}).get("correlation") in corr]


def test_dense_forward_and_backward_ranges_hold_their_kernels(fresh, tmp_path):
    model = Model().cuda()
    with fusionguard.watch(model, memory=False):
        events = _traced(model, tmp_path, "dense")
    ours = [
        e for e in events if e["name"].startswith("fusionguard: ") and e.get("cat") == "user_annotation"
    ]  # (CUDA traces mirror each as gpu_user_annotation)
    names = sorted({e["name"] for e in ours})
    size = "1.05 MB"  # 1*4*256*256 fp32
    assert names == sorted(f"fusionguard: dense {p} layers.{i} (eager_call, {size})" for p in ("forward", "backward") for i in (0, 1)), (
        names
    )
    assert len(ours) == 8  # 2 steps x 2 layers x 2 phases: every call, sampled ones too
    for r in ours:
        assert _kernels_inside(r, events), r["name"]


def test_fused_graph_runs_are_ranges_naming_their_layers(fresh, tmp_path):
    model = Model().cuda()
    compiled = torch.compile(model)
    with fusionguard.watch(model, memory=False):
        events = _traced(compiled, tmp_path, "fused")
    ours = [
        e for e in events if e["name"].startswith("fusionguard: ") and e.get("cat") == "user_annotation"
    ]  # (CUDA traces mirror each as gpu_user_annotation)
    names = [e["name"] for e in ours]
    for phase in ("forward", "backward"):  # (a backward names its calls last to first)
        runs = [n for n in names if n.startswith(f"fusionguard: fused {phase} ")]
        assert len(runs) == 2, names
        assert all("layers.0" in n and "layers.1" in n and n.endswith("(2 flex calls)") for n in runs), names
    assert not [n for n in names if "dense" in n]
    for r in ours:
        assert any("flex" in k["name"] or "triton" in k["name"] for k in _kernels_inside(r, events)), r["name"]
