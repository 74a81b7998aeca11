"""#33, found by a hostile try: sessions that overlap (nested ``with`` blocks, a notebook's cells,
a test's own ``track()`` under the pytest plugin's session), on CPU, inference only.

- a session that replaced another running session's settings puts them back at its stop (LIFO
  or not), says so once, and the one that enabled fusionguard still disables it at the end;
- a nested session on the same model gives the hooks back to the one it took them from;
- ``with fg:`` inside ``with fg:`` ends with the outer block;
- a wrong type is a clear ``TypeError``, nothing installed.
"""

from __future__ import annotations

import gc
import logging
import threading

import pytest
from conftest import Lines
from test_session import Net, hooks, run

import fusionguard
from fusionguard import _lifecycle, _testing
from fusionguard.core import state as _state


def mode():
    return (_state.STATE.config.mode, _state.STATE.enabled_by) if fusionguard.is_enabled() else None


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("FUSIONGUARD", raising=False)
    yield
    fusionguard.disable()
    _testing.reset_for_tests()


@pytest.fixture
def told():
    _state.STATE.sessions.told.clear()
    handler = Lines()
    logging.getLogger("fusionguard").addHandler(handler)
    yield handler
    logging.getLogger("fusionguard").removeHandler(handler)
    _state.STATE.sessions.told.clear()


def test_a_replaced_sessions_settings_come_back_and_it_is_said_once(clean, told):
    model = Net()
    with fusionguard.track(model, strict=True, log_path=False) as outer:  # the pytest plugin's session, say
        for _ in range(2):
            with fusionguard.track(model, strict=False):
                run(model)  # warn inside
        assert outer.mode == "strict"
        with pytest.raises(fusionguard.DenseFallbackError):  # strict again after the block
            run(model)
    assert mode() is None  # the outer one enabled: it disabled
    assert [m for m in told.lines if "still running" in m] == [
        "fusionguard: fusionguard.track() sets mode='warn' while fusionguard.track() (still running) asked for mode='strict': "
        "the newest session's settings apply until it stops, then fusionguard.track()'s come back"
    ]


def test_out_of_order_stops_unwind_to_the_launcher(clean):
    _lifecycle.enable_as("launcher", mode="warn", log_path=False)
    a, b, c = (fusionguard.track(Net(), strict=s) for s in (True, False, True))
    a.start(), b.start(), c.start()
    assert mode() == ("strict", "session")
    c.stop()
    assert mode() == ("warn", "session")  # b's
    b.stop()
    assert mode() == ("strict", "session")  # a's
    a.stop()
    assert mode() == ("warn", "launcher")
    a.start(), b.start()
    a.stop()  # the earlier one first: b's settings stay, the launcher's come back after b
    assert mode() == ("warn", "session")
    b.stop()
    assert mode() == ("warn", "launcher")
    fusionguard.disable()
    a, b = fusionguard.track(Net(), strict=True, log_path=False), fusionguard.track(Net(), strict=False)
    a.start(), b.start()
    a.stop()
    b.stop()
    assert mode() is None  # a enabled it, b replaced a's settings: the last one out disables


def test_a_nested_session_on_one_model_gives_the_hooks_back(clean):
    model = Net()
    a = fusionguard.track(model, log_path=False).start()
    one = hooks(model)
    b = fusionguard.track(model).start()
    c = fusionguard.track(model).start()
    c.stop()
    assert hooks(model) == one and b.model is model
    b.stop()
    assert hooks(model) == one and a.model is model  # the outer one watches again
    b.start(), c.start()
    b.stop()  # the middle one first: c keeps them, then they go back to a through b
    assert hooks(model) == one
    c.stop()
    assert hooks(model) == one and a.model is model
    run(model)
    assert {r["layer"] for r in a.counts().rows} == {"layers.0", "layers.1"}
    a.stop()
    assert hooks(model) == 0


def test_the_hooks_go_back_through_a_middle_session_that_was_collected(clean):
    """#33: a cell ``fg2 = track(model).start()`` run twice inside an outer session: the first
    fg2, dropped, is collected; at the last fg2's stop the outer session gets the hooks back."""
    model = Net()
    outer = fusionguard.track(model, log_path=False).start()
    one = hooks(model)
    cell = {"fusionguard": fusionguard, "model": model}
    for _ in range(2):
        exec("fg2 = fusionguard.track(model, log_path=False).start()", cell)
    gc.collect()
    for t in [t for t in threading.enumerate() if t.name == "fusionguard-session-end"]:
        t.join(10)
    cell["fg2"].stop()
    assert hooks(model) == one and outer.model is model
    run(model)
    assert {r["layer"] for r in outer.counts().rows} == {"layers.0", "layers.1"}


@pytest.mark.parametrize("away", [False, True])
def test_a_session_that_takes_its_model_back_leaves_no_hook_after_both_stop(clean, away):
    """#33: s2 took the model from s1, s1 takes it back (``follow()`` again, or via another model):
    the two ``took_from`` links form a cycle; after both stop and ``disable()`` no hook is left."""
    model, other = Net(), Net()
    s1 = fusionguard.track(model, log_path=False).start()
    s2 = fusionguard.track(model).start()
    if away:
        s1.follow(other)
    s1.follow(model)
    s1.stop()
    assert hooks(model) > 0 and s2.model is model  # s2, still running, gets them back
    s2.stop()
    fusionguard.disable()
    assert hooks(model) == 0 and hooks(other) == 0
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_middle_session_that_follows_another_model_passes_its_link_on(clean):
    """#33: s1, s2, s3 on one model (each newer takes the hooks), s2 follows another model away,
    s3 stops: s1, still running on the model, gets the hooks back (s3 took them from s2, which took
    them from s1), and names its calls."""
    model, other = Net(), Net()
    s1 = fusionguard.track(model, log_path=False).start()
    one = hooks(model)
    s2, s3 = fusionguard.track(model).start(), fusionguard.track(model).start()
    s2.follow(other)
    s3.stop()
    assert hooks(model) == one and s1.model is model and s2.model is other
    run(model)
    assert {r["layer"] for r in s1.counts().rows} == {"layers.0", "layers.1"}


def test_a_collected_model_leaves_no_owner_entry(clean):
    """#33: a model holding its own session (``model.fg = track(model).start()``) is collected: its
    entry in the table of who holds each model's hooks goes with it (no dead entry per model)."""
    other = fusionguard.track(log_path=False).start()  # (keeps fusionguard enabled: no reset)
    model = Net()
    model.fg = fusionguard.track(model).start()
    assert len(_state.STATE.sessions.owners) == 1
    del model
    gc.collect()
    for t in [t for t in threading.enumerate() if t.name == "fusionguard-session-end"]:
        t.join(10)
    assert _state.STATE.sessions.owners == {} and other.active


def test_the_same_session_nested_ends_with_the_outer_block(clean):
    model = Net()
    fg = fusionguard.track(model, log_path=False)
    with fg:
        with fg:
            pass
        assert fg.active and hooks(model) > 0
    assert not fg.active and hooks(model) == 0 and not fusionguard.is_enabled()


@pytest.mark.parametrize("kwargs, word", [({"memory": "no"}, "memory"), ({"hooks": 1}, "hooks"), ({"model": "net"}, "model")])
def test_a_wrong_type_is_a_clear_error_and_installs_nothing(clean, kwargs, word):
    model = kwargs.pop("model", None) or Net()
    with pytest.raises(TypeError, match=rf"^fusionguard.track\(\): {word} must be"):
        fusionguard.track(model, log_path=False, **kwargs)
    assert not fusionguard.is_enabled()
