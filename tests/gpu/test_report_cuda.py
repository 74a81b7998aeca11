"""``fusionguard report`` on logs written on a GPU, where one call is seen from several sides:
watched eager layers calling a compiled ``flex_attention`` write a memory record (``layer_memory``)
*and* a graph run (``flex_run``) per call; a model compiled whole runs forward and backward graphs
holding every layer. Each fused call must be counted once, per layer and phase. The two cases
run one after the other in one process, each with its own log: the second log's summary()
rows must not carry the first's (they did: 2x the calls, and memory for the compiled model)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import causal
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard
from fusionguard import _testing
from fusionguard.report.build import build as build_report_dict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


@pytest.fixture(autouse=True)
def _forget():
    """Each case starts from a clean process state (the counts are process-wide)."""
    yield
    fusionguard.disable()
    _testing.reset_for_tests()


HQ, HKV, D, L, DIM, STEPS = 8, 2, 64, 512, 256, 5


class Attention(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.q = nn.Linear(DIM, HQ * D, bias=False)
        self.kv = nn.Linear(DIM, 2 * HKV * D, bias=False)
        self.o = nn.Linear(HQ * D, DIM, bias=False)
        self.attend = attend

    def forward(self, x, mask):
        q = self.q(x).view(1, L, HQ, D).transpose(1, 2)
        k, v = self.kv(x).view(1, L, 2, HKV, D).permute(2, 0, 3, 1, 4)
        out = self.attend(q, k, v, block_mask=mask, enable_gqa=True)
        return x + self.o(out.transpose(1, 2).reshape(1, L, HQ * D))


class Model(nn.Module):
    def __init__(self, attend, n=2):
        super().__init__()
        self.layers = nn.ModuleList(Attention(attend) for _ in range(n))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


def _train(model, runner, mask):
    x = torch.randn(1, L, DIM, device="cuda", dtype=torch.bfloat16)
    for _ in range(STEPS):
        runner(x, mask).float().sum().backward()
    torch.cuda.synchronize()


@pytest.mark.parametrize("how", ["compiled_flex_in_eager_layers", "model_compiled_whole"])
def test_every_fused_call_counted_once_per_layer_and_phase(tmp_path, how):
    torch._dynamo.reset()
    log = tmp_path / f"{how}.jsonl"
    fusionguard.enable(strict=True, log_path=str(log), fused_first=2, fused_every=2)
    try:
        mask = create_block_mask(causal, None, None, L, L, device="cuda")
        if how == "compiled_flex_in_eager_layers":
            model = Model(torch.compile(flex_attention)).cuda().to(torch.bfloat16)
            runner = model
            watched = model
        else:
            model = Model(flex_attention).cuda().to(torch.bfloat16)
            runner = torch.compile(model)
            watched = runner
        with fusionguard.watch(watched):
            _train(model, runner, mask)
        rows = {(r["layer"], r["phase"]): r for r in fusionguard.summary()}
    finally:
        fusionguard.disable()
    rep = build_report_dict([str(log)])
    print(json.dumps({"how": how, "rows": rep["rows"], "summary": {f"{k[0]}|{k[1]}": v for k, v in rows.items()}}, default=str)[:4000])
    want = {(f"layers.{i}", p): STEPS for i in range(2) for p in ("forward", "backward")}
    got = {(r["layer"], r["phase"]): r["fused"] for r in rep["rows"] if r["fused"]}
    assert got == want, got
    assert rep["totals"]["fused_calls"] == 4 * STEPS and rep["totals"]["dense_calls"] == 0
    assert 1 <= rep["totals"]["compiles"] < rep["totals"]["fused_calls"]  # graphs, not calls
    assert {k: r["fused"] for k, r in rows.items()} == want  # summary() agrees
    if how == "model_compiled_whole":  # no hook runs inside the graph: no memory, in either view
        assert all(r["measured"] == 0 for r in rows.values()), rows
        assert all(r["memory_samples"] == 0 for r in rep["rows"]), rep["rows"]
