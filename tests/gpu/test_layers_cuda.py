"""watch(model) on a GPU: per-layer peak deltas against an independent measurement of each layer
alone, at the seed scenario's size, eager (dense) and with compiled flex_attention (fused)."""

from __future__ import annotations

import pytest
import torch
from conftest import causal
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

HQ, HKV, D, Q, KV, DIM = 32, 8, 128, 2048, 10240, 1024
_compiled_flex = torch.compile(flex_attention)


class Attention(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.q = nn.Linear(DIM, HQ * D, bias=False)
        self.o = nn.Linear(HQ * D, DIM, bias=False)
        self.attend = attend

    def forward(self, x, kv, mask):
        q = self.q(x).view(1, Q, HQ, D).transpose(1, 2)
        k, v = kv
        out = self.attend(q, k, v, block_mask=mask, enable_gqa=True)
        return x + self.o(out.transpose(1, 2).reshape(1, Q, HQ * D))


class Model(nn.Module):
    def __init__(self, attend, n=4):
        super().__init__()
        self.layers = nn.ModuleList(Attention(attend) for _ in range(n))

    def forward(self, x, kv, mask):
        for layer in self.layers:
            x = layer(x, kv, mask)
        return x


def independent(layer, x, kv, mask):
    """Peak above the start of this layer alone, forward then backward."""
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = layer(x, kv, mask)
    torch.cuda.synchronize()
    fwd = torch.cuda.max_memory_allocated() - base
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out.backward(grad)
    torch.cuda.synchronize()
    return fwd, torch.cuda.max_memory_allocated() - base, out.detach()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_layer_peaks_match_an_independent_measurement(guard, mode):
    torch.manual_seed(0)
    attend = flex_attention if mode == "eager" else _compiled_flex
    model = Model(attend).cuda().to(torch.bfloat16)
    x = torch.randn(1, Q, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, HKV, KV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, HKV, KV, D, device="cuda", dtype=torch.bfloat16)
    mask = create_block_mask(causal, None, None, Q, KV, device="cuda")
    guard()
    with fusionguard.watch(model, layers=[Attention]):
        for _ in range(2):  # the second step is the measured one (first: compiles, grads appear)
            model.zero_grad(set_to_none=True)
            out = model(x, (k, v), mask)
            out.backward(torch.randn_like(out))
    rows = {(r["layer"], r["phase"]): r for r in fusionguard.summary()}
    fusionguard.disable()
    h = x
    report = []
    for i, layer in enumerate(model.layers):
        fwd, bwd, h = independent(layer, h, (k, v), mask)
        for phase, ref in (("forward", fwd), ("backward", bwd)):
            row = rows[(f"layers.{i}", phase)]
            report.append((mode, i, phase, row["peak_delta_last"], ref, row["alloc_delta_last"]))
    print(
        "\n".join(
            f"{m} layers.{i} {p}: fusionguard peak {g / 1e9:.4f} GB (alloc {a / 1e9:.4f}), alone {r / 1e9:.4f} GB"
            for m, i, p, g, r, a in report
        )
    )
    for m, i, phase, got, ref, _ in report:
        assert got is not None
        assert abs(got - ref) <= max(0.05 * ref, 2 << 20), (m, i, phase, got, ref)
    if mode == "eager":
        assert rows[("layers.0", "backward")]["dense"] >= 1
    else:
        assert rows[("layers.0", "forward")]["dense"] == 0
