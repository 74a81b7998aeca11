"""Bad inputs are refused before anything is installed, with one error naming the argument (issue
#27, part 4); a failure part-way through ``enable()`` undoes everything it did. "Not half-enabled"
means: ``is_enabled()`` is False, the registry is empty and every host object fusionguard patches
is the very original (then a dense call runs as PyTorch runs it, and says so: no wrapper at all).
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from conftest import flex_events, qkv, read_jsonl
from test_undo_registry import _host_slots, _same
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import _testing
from fusionguard.core import state as _state
from fusionguard.eventlog import crash

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def assert_nothing_installed(before):
    assert fusionguard.is_enabled() is False
    assert _state.STATE.patches.entries() == []
    after = _host_slots()
    assert [k for k in before if not _same(before[k], after[k])] == []


def assert_guard_works_after(guard):
    """The next enable() is a clean first one: its header, then strict mode blocking."""
    log = guard(strict=True)
    q, k, v = qkv()
    with pytest.raises(fusionguard.DenseFallbackError):
        flex_attention(q, k, v)
    seen = [(e["event"], e.get("action")) for e in read_jsonl(log) if e["event"] != "compiled_before_enable"]  # (graphs of earlier tests)
    assert seen[-2:] == [("header", None), ("flex_call", "raise")], seen


class BytesPath:
    def __init__(self, path):
        self.path = path

    def __fspath__(self):
        return os.fsencode(self.path)


BAD_LOG_PATHS = [
    pytest.param(lambda d: os.fsencode(d / "fg.jsonl"), TypeError, "log_path must be a path.*bytes", id="bytes"),
    pytest.param(lambda d: BytesPath(d / "fg.jsonl"), TypeError, "log_path must be a path.*returns bytes", id="pathlike-of-bytes"),
    pytest.param(lambda d: str(d / "fg\0.jsonl"), ValueError, "log_path contains a NUL", id="nul"),
    pytest.param(lambda d: pathlib.Path(str(d / "x\0") + "/fg.jsonl"), ValueError, "log_path contains a NUL", id="pathlib-nul"),
    pytest.param(lambda d: "", ValueError, "log_path is empty", id="empty"),
    pytest.param(lambda d: 3, TypeError, "log_path must be a path.*int 3", id="int"),
]


@pytest.mark.parametrize("make, error, match", BAD_LOG_PATHS)
def test_a_bad_log_path_installs_nothing(tmp_path, make, error, match):
    before = _host_slots()
    with pytest.raises(error, match=match):
        fusionguard.enable(strict=True, log_path=make(tmp_path))
    assert_nothing_installed(before)
    assert os.listdir(tmp_path) == [], "a file was created"
    q, k, v = qkv()
    assert torch.equal(flex_attention(q, k, v), flex_attention(q, k, v))  # PyTorch's own call, no wrapper
    assert flex_events() == []


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"strict": "yes"}, TypeError, "strict must be True or False"),
        ({"fsync": "sometimes"}, TypeError, "fsync must be"),
        ({"log_max_bytes": 10}, ValueError, "log_max_bytes must be"),
        ({"flush_interval": "1"}, ValueError, "flush_interval must be"),
        ({"log_mode": 0o400}, ValueError, "log_mode must be"),
        ({"max_event": 3}, TypeError, "unknown option"),
    ],
)
def test_a_bad_option_installs_nothing_and_keeps_a_running_guard(guard, options, error, match):
    before = _host_slots()
    with pytest.raises(error, match=match):
        fusionguard.enable(log_path=str(guard.log), **options)
    assert_nothing_installed(before)
    assert not guard.log.exists()
    # while enabled: the bad call changes nothing, strict mode goes on blocking
    log = guard(strict=True)
    with pytest.raises(error, match=match):
        fusionguard.enable(log_path=str(log), **options)
    with pytest.raises(TypeError, match="log_path"):
        fusionguard.enable(strict=False, log_path=os.fsencode(log))
    assert fusionguard.is_enabled() and _state.STATE.config.strict
    q, k, v = qkv()
    with pytest.raises(fusionguard.DenseFallbackError):
        flex_attention(q, k, v)


def test_bad_arguments_are_refused_under_the_kill_switch_too(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSIONGUARD", "off")
    with pytest.raises(TypeError, match="log_path"):
        fusionguard.enable(log_path=b"x.jsonl")
    with pytest.raises(TypeError, match="strict"):
        fusionguard.enable(strict="yes", log_path=False)
    fusionguard.enable(strict=True, log_path=str(tmp_path / "fg.jsonl"))  # good ones: a no-op
    assert not fusionguard.is_enabled() and os.listdir(tmp_path) == []


def test_a_failure_part_way_through_enable_undoes_everything(guard, monkeypatch):
    """An unexpected error after the patches are in (fault injected into fusionguard's own crash
    file setup): enable() raises it, says it undid itself, and leaves nothing behind."""
    before = _host_slots()

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(crash, "capture_native", broken)
    with pytest.raises(RuntimeError, match="injected failure") as err:
        fusionguard.enable(strict=True, log_path=str(guard.log))
    assert any("nothing of fusionguard is installed" in n for n in getattr(err.value, "__notes__", []))
    assert_nothing_installed(before)
    q, k, v = qkv()
    flex_attention(q, k, v)  # runs as PyTorch runs it: no wrapper left that could half-guard it
    monkeypatch.undo()
    assert_guard_works_after(guard)


def test_a_failure_while_reconfiguring_undoes_everything(guard, monkeypatch):
    before = _host_slots()
    guard(strict=True)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(crash, "capture_native", broken)
    with pytest.raises(RuntimeError, match="injected failure"):
        fusionguard.enable(strict=True, log_path=str(guard.log) + ".2")  # a new file: reopened
    assert_nothing_installed(before)
    monkeypatch.undo()
    fusionguard.disable()
    assert_guard_works_after(guard)


# -- watch() and summary() ---------------------------------------------------------------------


class Attn(torch.nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layers": 5}, r"layers must be a list.*got int 5"),
        ({"layers": "attn"}, r"layers must be a list.*single str 'attn': put it in a list"),
        ({"layers": Attn}, r"layers must be a list.*single type"),
        ({"layers": [Attn, 3]}, r"layers must be a list.*got int 3 in it"),
        ({"layers": [torch.Tensor]}, r"layers must be a list.*Tensor"),
        ({"memory": "no"}, r"memory must be True or False, not 'no'"),
        ({"memory": None}, r"memory must be True or False"),
    ],
)
def test_watch_names_the_bad_argument(kwargs, match):
    with pytest.raises(TypeError, match=match):
        fusionguard.watch(Attn(), **kwargs)


def test_watch_reads_layers_once(guard):
    """A generator of layers is read once: its classes and names both count."""
    guard(log_path=False)
    w = fusionguard.watch(Attn(), layers=(x for x in (Attn, "layers.0.attn")))
    assert w.layer_types == (Attn,) and w.layer_names == {"layers.0.attn"}


def test_summary_names_a_bad_all_ranks(guard):
    guard(log_path=False)
    for bad in ("x", 1, None):
        with pytest.raises(TypeError, match="all_ranks must be True or False"):
            fusionguard.summary(all_ranks=bad)
    assert isinstance(fusionguard.summary(all_ranks=False), fusionguard.Summary)


@pytest.mark.parametrize("strict, mode", [(False, "strict"), (True, "warn"), (True, "oom")])
def test_strict_and_mode_that_disagree_are_refused_both_ways(strict, mode):
    """#32: one rule for ``strict`` and ``mode`` named together: they must agree; a pair that
    does not is refused, naming both, and nothing is installed."""
    try:
        with pytest.raises(ValueError, match=rf"strict={strict}.*mode={mode!r}"):
            fusionguard.enable(strict=strict, mode=mode, log_path=False)
        assert not fusionguard.is_enabled()
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()


@pytest.mark.parametrize(
    "kwargs, strict, mode",
    [
        ({"mode": "strict"}, True, "strict"),
        ({"strict": True}, True, "strict"),
        ({"strict": True, "mode": "strict"}, True, "strict"),
        ({"strict": False, "mode": "warn"}, False, "warn"),
        ({"strict": False, "mode": "oom"}, False, "oom"),
        ({"mode": "oom"}, False, "oom"),
        ({}, False, "warn"),
    ],
)
def test_strict_and_mode_that_agree_or_stand_alone_are_accepted(kwargs, strict, mode):
    try:
        fusionguard.enable(log_path=False, **kwargs)
        assert (_state.STATE.config.strict, _state.STATE.config.mode) == (strict, mode)
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
