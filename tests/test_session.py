"""#33: the public session object, ``fusionguard.track(model)``, on CPU (eager FlexAttention
runs the dense kernels: inference only, no backward on CPU).

Its counts are its own (from its start, by layer, phase and cause, per-step deltas); the rule
for who wins (launcher < session < the program's own enable(), a conflict said once); it owns
its model's hooks (one session per model, ended by stop(), an exception, garbage collection of
what it is bound to, disable()); a model pickles and deep-copies during and after it; it says
when fusionguard is off instead of a verdict.
"""

from __future__ import annotations

import copy
import gc
import io
import logging
import os
import pickle
import subprocess
import sys
import time
import warnings

import pytest
import torch
from conftest import Lines
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import _lifecycle, _testing
from fusionguard.core import state as _state

D = 8


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x):
        return self.proj(flex_attention(x, x, x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Attn(), Attn()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def x():
    return torch.randn(1, 2, 16, D, generator=torch.Generator().manual_seed(0))


def run(model, n=1):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(n):
            model(x())


def hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("FUSIONGUARD", raising=False)
    yield
    fusionguard.disable()
    _testing.reset_for_tests()


@pytest.fixture
def said():
    handler = Lines()
    logging.getLogger("fusionguard").addHandler(handler)
    yield handler
    logging.getLogger("fusionguard").removeHandler(handler)


def test_public_and_documented():
    assert {"track", "Session"} <= set(fusionguard.__all__)
    assert fusionguard.track.__doc__ and fusionguard.Session.__doc__


def test_counts_are_its_own_by_layer_phase_and_cause_with_step_deltas(clean):
    model = Net()
    with fusionguard.track(model, log_path=False) as fg:
        run(model, 2)
        first = fg.step()
        run(model)
        with fusionguard.allow_dense():
            run(model)
        second = fg.step()
        total = fg.counts()
    assert (first.dense, first.fused, first.allowed) == (4, 0, 0)
    assert (second.dense, second.allowed) == (2, 2)
    assert (total.dense, total.allowed) == (6, 2)
    assert [(r["layer"], r["phase"], r["dense"], r["allowed"], r["causes"]) for r in total.rows] == [
        ("layers.0", "forward", 3, 1, {"eager_call": 3}),
        ("layers.1", "forward", 3, 1, {"eager_call": 3}),
    ]
    assert first.metrics() == {"fusionguard/dense_calls": 4.0, "fusionguard/fused_calls": 0.0, "fusionguard/allowed_calls": 0.0}
    # a second session on the same model counts from its own start: causes are not counted twice
    with fusionguard.track(model, log_path=False) as again:
        run(model)
    assert [r["causes"] for r in again.counts().rows] == [{"eager_call": 1}, {"eager_call": 1}]
    row = fusionguard.summary()[0]  # (the process's table: every call, the allowed one apart, as a session counts it)
    assert (row["dense"], row["allowed"], row["causes"]) == (4, 1, {"eager_call": 4})


def test_the_verdict_and_the_summary(clean):
    model = Net()
    with fusionguard.track(model, log_path=False) as fg:
        run(model)
        verdict = fg.verdict("step 1")
    assert verdict == (
        "fusionguard: step 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        "layers.0 forward x1 (eager_call); layers.1 forward x1 (eager_call)",
        False,
    )
    assert "layers.1" in str(fg.summary()) and "eager_call" in fg.summary_text()
    empty = fusionguard.track(Net(), log_path=False).start()
    assert empty.summary_text(KeyboardInterrupt()) == (
        "fusionguard: the run ended on KeyboardInterrupt: no FlexAttention call was counted before it"
    )
    empty.stop()


def test_strict_on_the_session_beats_the_launchers_default_and_stop_puts_it_back(clean):
    _lifecycle.enable_as("launcher", mode="warn", log_path=False)  # what FUSIONGUARD=warn does at torch import
    model = Net()
    with fusionguard.track(model, strict=True) as fg:
        assert fg.mode == "strict"
        with pytest.raises(fusionguard.DenseFallbackError):
            run(model)
    assert (_state.STATE.config.mode, _state.STATE.enabled_by) == ("warn", "launcher")


def test_under_fusionguard_run_strict_session_blocks(tmp_path):
    """The launcher for real: FUSIONGUARD=warn and the start-up hook on PYTHONPATH."""
    from fusionguard import activate

    code = (
        "import sys, torch, fusionguard\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_session import Net, x\n"
        "assert fusionguard.is_enabled()\n"
        "m = Net()\n"
        "with fusionguard.track(m, strict=True):\n"
        "    try:\n"
        "        with torch.no_grad(): m(x())\n"
        "    except fusionguard.DenseFallbackError: print('blocked')\n"
    )
    env = {
        **os.environ,
        "FUSIONGUARD": "warn",
        "FUSIONGUARD_LOG": str(tmp_path / "fg.jsonl"),
        "PYTHONPATH": os.pathsep.join([activate.HOOK_DIR, os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "blocked", out.stderr


def test_the_programs_own_enable_wins_and_the_conflict_is_said_once(clean, said):
    fusionguard.enable(strict=False, log_path=False)
    model = Net()
    for _ in range(3):
        with fusionguard.track(model, strict=True) as fg:
            assert fg.mode == "warn"
            run(model)
    told = [m for m in said.lines if "asked for" in m]
    assert told == [
        "fusionguard: fusionguard.track() asked for mode='strict', but the program's own fusionguard.enable() set "
        "mode='warn': the program's settings stand (pass them to that enable(), or leave them out of fusionguard.track())"
    ]
    assert fusionguard.is_enabled()  # (the session did not enable it: it does not disable it)


def test_a_session_that_enabled_disables_at_stop_a_joined_one_does_not(clean):
    with fusionguard.track(Net(), log_path=False):
        assert fusionguard.is_enabled()
        with fusionguard.track(Net()) as inner:
            assert inner.active
        assert fusionguard.is_enabled()
    assert not fusionguard.is_enabled()


def test_off_says_so_instead_of_a_verdict(clean, monkeypatch):
    monkeypatch.setenv("FUSIONGUARD", "off")
    model = Net()
    with fusionguard.track(model) as fg:
        run(model)
        assert fg.off.startswith("FUSIONGUARD=off")
        assert fg.verdict("step 1").text == (
            "fusionguard: step 1: no verdict: FUSIONGUARD=off in the environment (the kill switch); FlexAttention calls are not checked"
        )
        assert fg.metrics() == {} and hooks(model) == 0
    monkeypatch.delenv("FUSIONGUARD")
    fg = fusionguard.track(model, log_path=False).start()
    fusionguard.disable()
    run(model)
    assert fg.off == "fusionguard.disable() was called" and fg.metrics() == {}
    assert "no verdict: fusionguard.disable() was called" in fg.verdict("step 2").text


def test_disable_removes_every_hook_of_every_session(clean):
    models = [Net() for _ in range(3)]
    sessions = [fusionguard.track(m, log_path=False).start() for m in models]
    assert all(hooks(m) > 0 for m in models)
    fusionguard.disable()
    assert [hooks(m) for m in models] == [0, 0, 0]
    assert not any(s.active for s in sessions)


def test_one_session_per_model_a_new_one_takes_the_hooks_over(clean):
    model = Net()
    fusionguard.enable(log_path=False)
    one = fusionguard.track(model).start()
    per_session = hooks(model)
    kept = [fusionguard.track(model).start() for _ in range(20)]  # a notebook cell run 20 times
    assert hooks(model) == per_session
    for s in kept:
        s.stop()
    one.stop()
    assert hooks(model) == 0


def test_an_exception_ends_it_and_so_does_the_owner_going_away(clean):
    model = Net()
    with pytest.raises(KeyError):
        with fusionguard.track(model, log_path=False):
            raise KeyError("boom")
    assert hooks(model) == 0 and not fusionguard.is_enabled()

    class Owner:
        pass

    owner = Owner()
    fg = fusionguard.track(model, log_path=False).start().bind(owner)
    assert hooks(model) > 0
    del owner
    gc.collect()
    assert hooks(model) == 0 and not fg.active
    fg2 = fusionguard.track(model, log_path=False).start()
    assert hooks(model) > 0
    del fg2  # the session itself, dropped without stop()
    gc.collect()
    assert hooks(model) == 0


def _held(model):
    """What a session leaves in the process: fusionguard on, hooks on the model, undo entries, taps."""
    entries = [e.name for e in _state.STATE.patches.entries() if e.name.startswith("session ")]
    return fusionguard.is_enabled(), hooks(model), len(entries), len(_state.STATE.stats.taps)


def test_a_session_dropped_without_stop_ends_as_stop_would_said_once(clean, said):
    """A notebook cell ``fg = fusionguard.track(model); fg.start()`` run again, then the name
    dropped: each dropped session ends as stop() ends it (its hooks, its undo entry, its counters,
    and the enable() it made), said once."""

    _state.STATE.sessions.told.clear()
    model = Net()
    fg = fusionguard.track(model, log_path=False)
    fg.start()
    first = _held(model)
    fg = fusionguard.track(model, log_path=False)  # the cell again: the first session is dropped here
    fg.start()
    assert _held(model) == first and first[0] and first[1] > 0 and first[2] == 1
    run(model)
    assert fg.counts().dense == 2
    del fg
    gc.collect()
    assert _held(model) == (False, 0, 0, 0)
    dropped = [line for line in said.lines if "garbage-collected without stop()" in line]
    assert dropped == ["fusionguard: a session of fusionguard.track() was garbage-collected without stop(): it ended as stop() ends it"]
    before = len(fusionguard.events())
    run(model)  # nothing logs it
    assert len(fusionguard.events()) == before


def test_a_session_in_a_reference_cycle_is_ended_by_the_collector(clean):
    """Collected by the cyclic collector (which may run while fusionguard holds a lock), it ends
    on a short-lived thread: the same end, a moment later."""
    model = Net()
    fg = fusionguard.track(model, log_path=False).start()
    fg.cycle = fg
    del fg
    gc.collect()
    for _ in range(200):
        if _held(model) == (False, 0, 0, 0):
            break
        time.sleep(0.05)
    assert _held(model) == (False, 0, 0, 0)


def test_disable_removes_every_sessions_hooks_and_a_later_drop_says_nothing(clean, said):

    _state.STATE.sessions.told.clear()
    model, other = Net(), Net()
    a = fusionguard.track(model, log_path=False).start()
    b = fusionguard.track(other, log_path=False).start()
    assert hooks(model) > 0 and hooks(other) > 0
    fusionguard.disable()
    assert _held(model) == (False, 0, 0, 0) and hooks(other) == 0
    assert a.off == b.off == "fusionguard.disable() was called"
    del a, b
    gc.collect()
    assert not [line for line in said.lines if "garbage-collected" in line]
    assert not fusionguard.is_enabled()


def test_the_sessions_bookkeeping_is_part_of_the_one_state(clean, said):
    """The running sessions, the models' owners and the lines said once live in ``STATE.sessions``:
    ``disable()`` ends every session there, ``STATE.reset()`` forgets what was said (in place)."""
    sessions = _state.STATE.sessions
    fusionguard.enable(strict=False, log_path=False)  # the program's own: a conflict to say
    fg = fusionguard.track(Net(), strict=True).start()
    assert list(sessions.live.values()) == [fg._h] and len(sessions.owners) == 1 and len(sessions.told) == 1
    fusionguard.disable()
    assert (sessions.live, sessions.owners, fg.active) == ({}, {}, False)
    _state.STATE.reset()
    assert _state.STATE.sessions is sessions and sessions.told == set()


def test_reset_for_tests_forgets_what_the_sessions_said_once(clean, said):
    """Each test starts as a fresh process would: a conflict said in one test is said again in the next."""
    for _ in range(2):
        fusionguard.enable(strict=False, log_path=False)  # the program's own
        with fusionguard.track(strict=True):
            pass
        fusionguard.disable()
        _testing.reset_for_tests()
    assert len([line for line in said.lines if "the program's settings stand" in line]) == 2


def test_a_model_pickles_and_copies_during_and_after_watch_and_a_session(clean, tmp_path):
    model = Net()
    fusionguard.enable(log_path=False)
    for ctx in (lambda: fusionguard.watch(model), lambda: fusionguard.track(model)):
        with ctx():
            buf = io.BytesIO()
            torch.save(model, buf)
            clone = copy.deepcopy(model)
            loaded = pickle.loads(pickle.dumps(model))
            run(clone)  # the copy carries inert hooks: never counted as the watched layers
            run(loaded)
        assert not {e["layer"] for e in fusionguard.events("flex_call")} & {"layers.0", "layers.1"}
        torch.save(model, tmp_path / "m.pt")
        copy.deepcopy(model)
        buf.seek(0)
        run(torch.load(buf, weights_only=False))
    assert hooks(model) == 0


def test_a_session_unwraps_a_model_by_the_one_rule_of_the_names(clean):
    """One rule for unwrapping (``wrapper_chain``): what the layer names see through (activation
    checkpointing's wrapper too), the session's model sees through; a torch.compile wrapper is kept."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = Net()
    with fusionguard.track(torch.nn.DataParallel(checkpoint_wrapper(inner)), log_path=False) as fg:
        assert fg.model is inner
        compiled = torch.compile(inner)
        fg.follow(torch.nn.DataParallel(compiled))
        assert fg.model is compiled


def test_follow_watches_the_swapped_model(clean):
    first, second = Net(), Net()
    with fusionguard.track(first, log_path=False) as fg:
        fg.follow(torch.nn.DataParallel(second))  # unwrapped
        assert hooks(first) == 0 and hooks(second) > 0 and fg.model is second
        run(second)
    assert {r["layer"] for r in fg.counts().rows} == {"layers.0", "layers.1"}


def test_options_are_checked_when_the_session_is_made():
    with pytest.raises(ValueError, match=r"^fusionguard.track\(\): mode"):
        fusionguard.track(mode="stirct")
    with pytest.raises(TypeError, match="unknown option"):
        fusionguard.track(fsynk=True)
