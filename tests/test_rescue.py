"""Rescue mode on CPU: an eager flex_attention call runs Inductor's fused C++ kernel instead of
the dense one; what the user asked to keep dense stays dense."""

from __future__ import annotations

import pytest
import torch
from conftest import PUBLIC, flex_events, lacks, needs, qkv
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.core import state as _state

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def shapes(L):
    return qkv(L=L, HQ=4, HKV=2)


@needs("rescue")
def test_eager_call_is_rescued_to_the_fused_kernel(guard, math_spy, dynamo_reset):
    guard(strict=True, rescue=True)  # strict: would raise if anything ran dense
    q, k, v = shapes(64)
    out = flex_attention(q, k, v, enable_gqa=True)
    assert math_spy == [], "the dense math ran although the call was rescued"
    with fusionguard.allow_dense():
        ref = flex_attention(q, k, v, enable_gqa=True)  # allowed: stays dense, our reference
    assert len(math_spy) == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (rescued,) = [e for e in flex_events() if e["path"] == "rescued"]
    assert rescued["cause"] == "eager_call" and rescued["q_shape"] == [1, 4, 64, 8]
    fused = flex_events("flex_compile")
    assert fused and fused[0]["template"] == "cpp"
    assert _state.STATE.counts.get("rescue_compiles", 0) <= 1


@needs("rescue")
def test_new_lengths_do_not_recompile_every_time(guard, dynamo_reset):
    guard(rescue=True)
    for L in (32, 48, 80, 96, 112):
        q, k, v = shapes(L)
        flex_attention(q, k, v, enable_gqa=True)
    rescued = [e for e in flex_events() if e["path"] == "rescued"]
    assert len(rescued) == 5
    compiles = sum(1 for e in rescued if e["compiled"])
    assert compiles <= 2, compiles  # automatic dynamic shapes: one static, one dynamic compile
    assert not [e for e in flex_events() if e["path"] == "dense"]


@needs("rescue")
def test_what_the_user_kept_dense_stays_dense(guard, math_spy, dynamo_reset, monkeypatch):
    guard(rescue=True)
    q, k, v = shapes(64)

    @torch.compiler.disable
    def disabled():
        return flex_attention(q, k, v, enable_gqa=True)

    with fusionguard.allow_dense():
        flex_attention(q, k, v, enable_gqa=True)
    disabled()
    torch.compile(lambda q, k, v: flex_attention(q, k, v, enable_gqa=True), backend="aot_eager")(q, k, v)
    paths = [(e["path"], e["cause"]) for e in flex_events()]
    assert paths == [
        ("dense", "eager_call"),
        ("dense", "eager_call"),
        ("dense", "non_inductor_backend"),
    ]
    assert len(math_spy) == 3


@needs("rescue", "debug_flag")
def test_the_debug_flag_stays_dense(guard, math_spy, monkeypatch):
    guard(rescue=True)
    monkeypatch.setattr(PUBLIC, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    flex_attention(*shapes(64), enable_gqa=True)
    assert [(e["path"], e["cause"]) for e in flex_events()] == [("dense", "debug_flag")]
    assert len(math_spy) == 1


def test_rescue_off_by_default(guard, math_spy):
    guard()
    with pytest.warns(fusionguard.DenseFallbackWarning):
        flex_attention(*shapes(64), enable_gqa=True)
    assert len(math_spy) == 1


@needs("rescue")
def test_recompile_limit_slide_is_rescued_with_few_compiles(guard, dynamo_reset, dynamo_config):
    """The seed's failure: dynamic=False, a new length per step, the recompile limit hit."""
    dynamo_config(recompile_limit=1)
    guard(strict=True, rescue=True)

    def attention(q, k, v):
        return flex_attention(q, k, v, enable_gqa=True)

    attn = torch.compile(attention, dynamic=False)
    for L in (64, 48, 80, 96, 112):
        attn(*shapes(L))
    rescued = [e for e in flex_events() if e["path"] == "rescued"]
    assert {e["cause"] for e in rescued} == {"recompile_limit"} and len(rescued) == 4
    assert sum(1 for e in rescued if e["compiled"]) <= 2
    assert any(e["event"] == "recompile_limit" for e in fusionguard.events())


@needs("rescue")
def test_a_failed_rescue_runs_dense_guarded_and_says_so(guard, dynamo_reset, monkeypatch):

    def broken_inductor(gm, example_inputs):
        raise RuntimeError("inductor exploded")

    monkeypatch.setitem(_state.STATE.caches.backends, "inductor", broken_inductor)
    guard(rescue=True)
    q, k, v = shapes(64)
    with pytest.warns(fusionguard.DenseFallbackWarning):
        out = flex_attention(q, k, v, enable_gqa=True)
    assert out.shape == q.shape
    assert [e["path"] for e in flex_events()] == ["dense"]
    assert "inductor exploded" in fusionguard.events("rescue_failed")[0]["error"]


def test_a_release_without_the_rescue_seam_says_so_in_one_line(guard, capfd):
    """Where torch lacks setup_compilation_env, enable() names what is unavailable, once, and
    not_patched records it; the rest of the guard is installed either way."""
    guard(rescue=True)
    err = capfd.readouterr().err
    missing = lacks("rescue")
    lines = [line for line in err.splitlines() if "rescue" in line]
    if missing:
        assert lines == [f"fusionguard: {missing}"]
        assert _state.STATE.not_patched["rescue (setup_compilation_env)"] == missing
    else:
        assert lines == [] and "rescue (setup_compilation_env)" not in _state.STATE.not_patched
    assert "not guarded" not in err
    assert "flex_attention.CompositeExplicitAutograd" in _state.STATE.patches.names()
