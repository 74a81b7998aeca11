"""Attention that never reaches FlexAttention (#25 part 3): under ``watch(model)``, the first
forward of the model that completes without any FlexAttention call writes one ``no_flex_calls``
event and one warning, once per model; also through ``torch.compile``, where watch() puts no
hooks inside the model. Real modules, real Dynamo (``aot_eager``; one Inductor case)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import flex_events, qkv
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

import fusionguard

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class SdpaAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class FlexAttention(nn.Module):
    def forward(self, q, k, v):
        return flex_attention(q, k, v)


class Net(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn
        self.proj = nn.Linear(8, 8)

    def forward(self, q, k, v):
        return self.proj(self.attn(q, k, v))


def told():
    return flex_events("no_flex_calls")


def _run(model, steps=3, call=None):
    """``steps`` forwards; the no-FlexAttention warnings they issued."""
    call = call or model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            call(*qkv())
    return [w for w in caught if "without any FlexAttention call" in str(w.message)]


def test_sdpa_model_is_told_once_at_the_users_line(guard):
    guard()
    model = Net(SdpaAttention())
    with fusionguard.watch(model):
        issued = _run(model)
    assert len(issued) == 1 and len(told()) == 1
    (w,) = issued
    assert w.filename == __file__ and issubclass(w.category, RuntimeWarning)
    assert "Net" in str(w.message) and "expect_flex=False" in str(w.message)
    (e,) = told()
    assert e["model"] == "Net" and e["module"] == __name__ and e["attn_implementation"] is None and e["level"] == "warning"
    with fusionguard.watch(model):  # once per model, also in a later watch()
        assert _run(model) == []
    other = Net(SdpaAttention())
    with fusionguard.watch(other):  # another model: told too
        assert len(_run(other)) == 1


def test_flex_model_and_expect_flex_false_are_silent(guard):
    guard()
    flex_model, sdpa_model = Net(FlexAttention()), Net(SdpaAttention())
    with fusionguard.watch(flex_model), fusionguard.watch(sdpa_model, expect_flex=False):
        assert _run(flex_model) == [] and _run(sdpa_model) == []
    assert told() == []
    assert flex_events()  # the flex model's calls were seen (dense: eager)


def test_a_forward_that_raises_is_not_a_completed_forward(guard):
    guard()

    class Failing(nn.Module):
        def forward(self, q, k, v):
            raise ValueError("bad batch")

    model = Failing()
    with fusionguard.watch(model):
        with pytest.raises(ValueError, match="bad batch"):
            model(*qkv())
    assert told() == []


def test_bad_expect_flex_is_a_clear_error():
    with pytest.raises(TypeError, match="expect_flex"):
        fusionguard.watch(Net(SdpaAttention()), expect_flex="no")


@pytest.mark.parametrize("how", ["watch_the_wrapper", "watch_the_model_beside_its_wrapper"])
def test_through_torch_compile(guard, dynamo_reset, how):
    """watch's hooks are not inside a compiled model: its wrapper's hooks (outside the graph)
    check each forward; a compiled model that does call FlexAttention is not told."""
    guard()
    sdpa, flex = Net(SdpaAttention()), Net(FlexAttention())
    compiled_sdpa = torch.compile(sdpa, backend="aot_eager")
    compiled_flex = torch.compile(flex, backend="aot_eager")
    watched = (compiled_sdpa, compiled_flex) if how == "watch_the_wrapper" else (sdpa, flex)
    with fusionguard.watch(*watched):
        issued = _run(compiled_sdpa) + _run(compiled_flex)
    assert len(issued) == 1
    (e,) = told()
    assert e["model"] == "Net"
    assert not sdpa._forward_pre_hooks and not sdpa.attn._forward_pre_hooks  # nothing put inside


@pytest.mark.slow
def test_fused_calls_under_inductor_count_as_flex_calls(guard, dynamo_reset):
    guard()
    model = Net(FlexAttention())
    compiled = torch.compile(model)
    with fusionguard.watch(compiled):
        assert _run(compiled, steps=2) == []
    assert told() == [] and not flex_events()  # fused: no dense call, and not taken for "no FlexAttention"


def test_hugging_face_model_names_attn_implementation(guard):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    guard()
    with warnings.catch_warnings(record=True) as caught, fusionguard.watch(model):
        warnings.simplefilter("always")
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 8)))
    (e,) = told()
    assert e["model"] == "LlamaForCausalLM" and e["attn_implementation"] == "sdpa"
    (w,) = [w for w in caught if "without any FlexAttention call" in str(w.message)]
    assert "config._attn_implementation is 'sdpa'" in str(w.message) and 'attn_implementation="flex_attention"' in str(w.message)
    assert w.filename == __file__
