"""One compiled call per Triton kernel family on a CUDA GPU (#35: a row per backend in
docs/compatibility.md): ``kernel_options={"BACKEND": ...}`` picks the template, fusionguard's
``flex_compile`` record names it, each run is counted, nothing runs dense. FLASH has its own file
(tests/gpu/test_flash_cuda.py: it needs flash-attn-4).

Skipped without CUDA; run on the device machine."""

from __future__ import annotations

import pytest
import torch
from conftest import flex_events
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard
from fusionguard.core import state as _state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.mark.parametrize("backend, q_len, template", [("TRITON", 512, "triton"), ("TRITON_DECODE", 8, "triton_decode")])
def test_triton_families_are_fused_and_named(guard, dynamo_reset, backend, q_len, template):
    guard(strict=True)
    kv_len = 2048
    mask = create_block_mask(lambda b, h, q, kv: kv <= q + kv_len - q_len, None, None, q_len, kv_len, device="cuda")
    fn = torch.compile(flex_attention)
    with torch.no_grad():
        for seed in range(3):
            g = torch.Generator(device="cuda").manual_seed(seed)
            q = torch.randn(1, 8, q_len, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(1, 2, kv_len, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            out = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options={"BACKEND": backend})
    torch.cuda.synchronize()
    compiles = [e for e in fusionguard.events() if e["event"] == "flex_compile"]
    assert [(c["phase"], c["path"], c["template"]) for c in compiles] == [("forward", "fused", template)], compiles
    assert flex_events() == []
    assert _state.STATE.counts.get("fused_runs_forward") == 3
    fusionguard.disable()
    ref = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)  # dense, unguarded: the reference
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
