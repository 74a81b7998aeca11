"""Recompile pressure on a CUDA GPU (#25 part 1): a training step compiled with Inductor,
``dynamic=False``, a new sequence length each step. The warning comes at half the limit while
every call is still fused; at the limit the forward and the backward go dense, named
``recompile_limit``; with Dynamo's logs silenced too.

Skipped (and so not counted as passing) on machines without CUDA; run on the device machine."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import flex_events, read_jsonl, recompile_limit
from torch.nn.attention.flex_attention import flex_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def train_step(q, k, v):
    out = flex_attention(q, k, v, enable_gqa=True)
    out.float().square().sum().backward()
    return out


def qkv(L, HQ=4, HKV=2, D=64):
    def mk(h):
        return torch.randn(1, h, L, D, device="cuda", dtype=torch.bfloat16).requires_grad_()

    return mk(HQ), mk(HKV), mk(HKV)


@pytest.mark.parametrize("silenced", [False, True])
def test_pressure_comes_while_fused_and_the_limit_after(guard, dynamo_reset, silenced):
    log = guard()
    if silenced:
        torch._logging.set_logs(dynamo=logging.ERROR)
    try:
        with torch._dynamo.config.patch(**recompile_limit(4)), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = torch.compile(train_step, dynamic=False)
            for L in (256, 384, 512, 640, 768):
                compiled(*qkv(L))
                torch.cuda.synchronize()
    finally:
        if silenced:
            torch._logging.set_logs()
    events = read_jsonl(log)
    kinds = [e["event"] for e in events]
    (pressure,) = [e for e in events if e["event"] == "recompile_pressure"]
    assert (
        pressure["function"] == "train_step" and pressure["compiles"] == 3 and pressure["limit"] == 4
    )  # (#32: the 3rd compile shows the churn)
    assert pressure["varies"] in ("q dim 2 varies", "k dim 2 varies", "v dim 2 varies")
    told = [w for w in caught if "recompile pressure" in str(w.message)]
    assert len(told) == 1 and told[0].filename == __file__
    # before it: fused only; after the 4 lengths that compiled, the 5th runs dense, both phases
    first_dense = kinds.index("flex_call")
    assert kinds.index("recompile_pressure") < kinds.index("recompile_limit") < first_dense
    assert {(e["phase"], e["cause"]) for e in flex_events()} == {("forward", "recompile_limit"), ("backward", "recompile_limit")}
