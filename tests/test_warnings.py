"""Warnings follow Python's rules, and only where they help: warn mode goes through the warnings
machinery (the user's filters decide, ``error`` included); a dense path the user asked for (the
debug flag, like ``allow_dense()``) is logged without a warning; ``watch_traced`` points at the
user's line."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from conftest import PUBLIC, flex_events, needs, qkv
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

import fusionguard

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def test_warn_mode_honours_the_warning_filters(guard):
    """Warn mode never raises unless the user's filters say error (``-W error``)."""
    guard(strict=False)
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        flex_attention(q, k, v)
    (w,) = [w for w in caught if issubclass(w.category, fusionguard.DenseFallbackWarning)]
    assert (w.filename, w.lineno) == (__file__, line)  # the user's line: filters by module work
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fusionguard.DenseFallbackWarning)
        flex_attention(q, k, v)  # silenced, still logged
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusionguard.DenseFallbackWarning)
        with pytest.raises(fusionguard.DenseFallbackWarning):
            flex_attention(q, k, v)
    assert [e["action"] for e in flex_events()] == ["warn", "warn", "warn"]


@needs("debug_flag")
@pytest.mark.parametrize("strict", [False, True])
def test_the_debug_flag_is_logged_as_allowed_without_a_warning(guard, monkeypatch, strict):
    """``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` is the user asking for the dense path: no warning
    (PyTorch's own test_debug_flag_disables_internal_compilation runs under ``-W error``), no
    DenseFallbackError, one record with ``action: "allow"``."""
    monkeypatch.setattr(PUBLIC, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    guard(strict=strict)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusionguard.DenseFallbackWarning)
        out = flex_attention(*qkv())
    assert out.shape == (1, 2, 16, 8)
    (e,) = flex_events()
    assert (e["cause"], e["action"], e["allowed"]) == ("debug_flag", "allow", True)
    from fusionguard.dense.guard import format_message

    assert "allowed by the debug flag" in format_message(e)


class Attn(nn.Module):
    def forward(self, q, k, v):
        return flex_attention(q, k, v, enable_gqa=True)


def test_watch_traced_warning_points_at_the_users_line(guard, dynamo_reset):
    guard()
    model = Attn()
    model.register_forward_hook(lambda mod, args, out: None)  # the user's own: watch()'s hooks stay in Dynamo's sight
    compiled = torch.compile(lambda q, k, v: model(q, k, v), backend="eager")  # fusionguard cannot know
    q, k, v = torch.randn(1, 4, 64, 8), torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    STATS = fusionguard.core.state.STATE.stats

    STATS.told_traced = False  # said once per process: say it in this test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fusionguard.watch(model):
            line = sys._getframe().f_lineno + 1
            compiled(q, k, v)
    told = [w for w in caught if issubclass(w.category, RuntimeWarning) and "watch()" in str(w.message)]
    assert told, [str(w.message)[:80] for w in caught]
    assert (told[0].filename, told[0].lineno) == (__file__, line)
    assert fusionguard.events("watch_traced")
