"""#32 point 10: a second ``enable()`` changes what it names and keeps the rest (sentinel
defaults for ``strict``, ``mode`` and ``log_path``); after ``disable()`` an ``enable()`` starts
from the defaults again. ``strict`` and ``mode`` are one setting: naming either replaces both."""

from __future__ import annotations

import pytest

import fusionguard
from fusionguard import _testing
from fusionguard.core import state as _state


@pytest.fixture
def clean():
    yield
    fusionguard.disable()
    _testing.reset_for_tests()


def config():
    return _state.STATE.config


def test_a_second_enable_keeps_what_it_does_not_name(tmp_path, clean):
    mine = tmp_path / "mine.jsonl"
    fusionguard.enable(log_path=str(mine), mask_limit=123, recompile_warn_at=3, log_max_bytes=10**6)
    fusionguard.enable(strict=True)
    c = config()
    assert (c.log_path, c.mask_limit, c.recompile_warn_at, c.log_max_bytes) == (str(mine), 123, 3, 10**6)
    assert (c.strict, c.mode) == (True, "strict")
    assert _state.STATE.runtime.now.mask_limit == 123
    assert not (tmp_path / "fusionguard.jsonl").exists()
    fusionguard.enable(mask_limit=7)  # strict stays: not named
    assert (config().strict, config().mode, config().mask_limit, config().log_path) == (True, "strict", 7, str(mine))


def test_strict_and_mode_are_one_setting(tmp_path, clean):
    fusionguard.enable(mode="oom", log_path=False)
    fusionguard.enable(keep_all=True)
    assert (config().mode, config().strict, config().keep_all) == ("oom", False, True)
    fusionguard.enable(strict=True)  # names the mode: oom is replaced, not contradicted
    assert (config().mode, config().strict) == ("strict", True)
    fusionguard.enable(strict=False)
    assert (config().mode, config().strict) == ("warn", False)
    fusionguard.enable(mode="oom")
    assert (config().mode, config().strict, config().keep_all) == ("oom", False, True)


def test_none_names_nothing_for_strict_and_mode_alike(tmp_path, clean):
    """Hostile review of #32: ``enable(mode=None)`` reset the mode to warn while
    ``enable(strict=None)`` kept it. None names nothing, for both."""
    fusionguard.enable(mode="oom", log_path=False)
    fusionguard.enable(mode=None)
    assert config().mode == "oom"
    fusionguard.enable(strict=None)
    assert config().mode == "oom"
    fusionguard.enable(strict=True, mode=None)
    assert (config().mode, config().strict) == ("strict", True)


def test_after_disable_enable_starts_from_the_defaults(tmp_path, clean, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fusionguard.enable(strict=True, log_path=str(tmp_path / "a.jsonl"), mask_limit=5)
    fusionguard.disable()
    fusionguard.enable()
    c = config()
    assert (c.strict, c.mode, c.mask_limit, c.log_path) == (False, "warn", None, str(tmp_path / "fusionguard.jsonl"))


def test_a_named_log_path_moves_the_log_and_none_means_the_default(tmp_path, clean, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fusionguard.enable(log_path=str(tmp_path / "a.jsonl"), mask_limit=5)
    fusionguard.enable(log_path=None)  # said: the default file
    assert (config().log_path, config().mask_limit) == (str(tmp_path / "fusionguard.jsonl"), 5)


def test_a_bad_second_enable_changes_nothing(tmp_path, clean):
    fusionguard.enable(strict=True, log_path=False, mask_limit=5)
    before = config()
    with pytest.raises(ValueError):
        fusionguard.enable(mask_limit=-1)
    assert config() is before
