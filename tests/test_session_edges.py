"""#33, a hostile tester's second round on the public session object (CPU, inference only):
a session never started, counts taken while fusionguard is off, allowed-only layers and dense
calls outside the model in a verdict, and the clear errors for wrong arguments, copies and
pickling."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
import warnings
import weakref

import pytest
import torch
from test_session import Attn, Net, x  # one copy of the tiny two-layer model
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import _testing


def run(fn):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn(x())


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("FUSIONGUARD", raising=False)
    yield
    fusionguard.disable()
    _testing.reset_for_tests()


def test_a_session_never_started_raises_instead_of_false_zeros(clean):
    model = Net()
    fg = fusionguard.track(model, log_path=False)  # (start() forgotten)
    run(model)
    for call in (fg.step, fg.counts, fg.pending, fg.metrics, fg.new_events, lambda: fg.verdict("step 1")):
        with pytest.raises(RuntimeError, match=r"never started: call start\(\) first, or use it as `with fusionguard.track\(\) as fg:`"):
            call()
    assert "was never started" in fg.summary_text()
    with fg:  # started: the same calls answer
        run(model)
        assert fg.step().dense == 2
    assert fg.counts().dense == 2 and fg.metrics()["fusionguard/dense_calls"] == 2.0  # (after stop(): its final counts)


@pytest.mark.parametrize("how", ["kill switch", "disable()"])
def test_step_counts_taken_while_off_give_no_metrics(clean, monkeypatch, how):
    """The documented ``fg.step().metrics()`` pattern: no false 0 on a dashboard while off."""
    model = Net()
    if how == "kill switch":
        monkeypatch.setenv("FUSIONGUARD", "off")
    with fusionguard.track(model, log_path=False) as fg:
        if how == "disable()":
            run(model)
            fusionguard.disable()
        run(model)
        step = fg.step()
        assert step.off == fg.off and step.off is not None
        assert step.metrics() == {} and fg.pending().metrics() == {} and fg.counts().metrics() == {}


def test_allowed_only_layers_ran_and_dense_outside_the_model_is_said(clean):
    model, other = Net(), Attn()
    with fusionguard.track(model, log_path=False) as fg:
        run(lambda t: model.layers[0](t))
        with fusionguard.allow_dense():
            run(lambda t: model.layers[1](t))
        first = fg.verdict("step 1")
        fg.step()
        run(model)
        run(other)  # a module the session does not watch
        second = fg.verdict("step 2")
    assert first == (
        "fusionguard: step 1: 2 FlexAttention layers, forward fused 0/2 (1 allowed dense); dense: layers.0 forward x1 (eager_call)",
        False,
    )
    assert "never ran flex" not in first.text
    assert second.text.endswith("; +1 dense outside any watched layer") and not second.ok


def test_the_gc_callback_of_sessions_goes_through_the_registry(clean):
    """Newcomer read (#33): ``gc.callbacks`` got fusionguard's callback at import, for good."""
    from fusionguard import session

    def ours():
        return sum(cb is session._gc_phase for cb in gc.callbacks)

    assert ours() == 0  # (importing adds nothing)
    model = Net()
    with fusionguard.track(model, log_path=False), fusionguard.track(Net(), log_path=False):
        assert ours() == 1
    assert ours() == 0 and not fusionguard.is_enabled()  # (the last session disabled what it enabled)
    fg = fusionguard.track(model, log_path=False).start()
    fusionguard.disable()
    assert ours() == 0 and not fg.active


class _Scriptable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_a_copy_made_during_a_session_scripts_once_a_session_took_its_no_ops_off(clean):
    """Hostile pass 7 (#33), as docs/integrations.md ("Copies") says: TorchScript cannot script the
    no-ops a copy carries; ``with fusionguard.track(copy): pass`` leaves the copy bare."""
    model = _Scriptable()
    with fusionguard.track(model, log_path=False):
        clone = copy.deepcopy(model)
    with pytest.raises(torch.jit.frontend.NotSupportedError, match="excinfo"):
        torch.jit.script(clone)
    with fusionguard.track(clone, log_path=False):
        pass
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in clone.modules())
    x = torch.randn(2, 4)
    torch.testing.assert_close(torch.jit.script(clone)(x), model(x))


def test_track_refuses_a_name_with_a_clear_error(clean):
    """Newcomer read (#33): Python's own "got multiple values for keyword argument 'name'"."""
    with pytest.raises(TypeError, match=r"^fusionguard.track\(\) takes no name: .*Session\(name=\.\.\.\)"):
        fusionguard.track(None, name="x")
    assert fusionguard.Session(None, name="mine").name == "mine"


def test_follow_checks_its_argument(clean):
    model = Net()
    with fusionguard.track(model, log_path=False) as fg:
        with pytest.raises(TypeError, match=r"fusionguard.track\(\): model must be a torch.nn.Module .*not str"):
            fg.follow("nope")
        with pytest.raises(TypeError, match="not None"):
            fg.follow(None)
        assert fg.model is model


def test_clear_errors_for_wrong_counts_copies_and_the_constructors_name(clean):
    model = Net()
    with fusionguard.track(model, log_path=False) as fg:
        with pytest.raises(TypeError, match=r"metrics\(counts=...\) takes the Counts of step\(\), counts\(\) or pending\(\), not str"):
            fg.metrics(counts="x")
        with pytest.raises(TypeError, match=r"verdict\(label, counts=...\) takes the Counts"):
            fg.verdict("s", counts=3)
        with pytest.raises(
            TypeError, match=r"dense_stop\(step, at\) takes the Counts of step\(\), counts\(\) or pending\(\), not NoneType"
        ):
            fg.dense_stop(None, "x")
        for copier in (copy.deepcopy, copy.copy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be copied or pickled; its model can"):
                copier(fg)
        assert fg.active and copy.deepcopy(model) is not None
    with pytest.raises(TypeError, match=r"^fusionguard.Session\(\) got unknown option\(s\) \['bogus'\]"):
        fusionguard.Session(model, bogus=1)
    with pytest.raises(TypeError, match=r"^fusionguard.track\(\) got unknown option\(s\) \['bogus'\]"):
        fusionguard.track(model, bogus=1)


def test_a_step_on_forward_test_that_holds_its_session_lets_it_be_collected(clean):
    """The test is kept on the session, not in the registry of running sessions: a test naming its
    own session (a lambda, a bound method of an object holding it) no longer keeps it alive."""
    model = Net()
    fg = fusionguard.track(model, log_path=False).start()
    fg.step_on_forward(lambda s=fg: s.pending().dense > 100)
    run(model)
    gone = weakref.ref(fg)
    del fg
    gc.collect()
    assert gone() is None
    for t in [t for t in threading.enumerate() if t.name == "fusionguard-session-end"]:
        t.join(10)  # (a session collected by the cyclic collector ends on a short-lived thread)
    assert not fusionguard.is_enabled()  # it ended, and with it the enable() it made


def test_step_on_forward_takes_a_function_and_a_test_that_raises_is_the_users(clean, fg_records):
    model = Net()
    a = fusionguard.track(model, log_path=False).start()
    with pytest.raises(TypeError, match=r"step_on_forward\(\) takes a function of no argument \(or None\), not int"):
        a.step_on_forward(42)
    b = fusionguard.track(model, log_path=False).start()  # (b holds the model's hooks; a's test runs first)
    a.step_on_forward(lambda: 1 / 0)
    b.step_on_forward(lambda: True)
    for _ in range(3):
        run(model)
    assert b.pending().dense == 2  # b's test ran on every forward, after a's raised: each forward a new step
    assert a.pending().dense == 6
    told = [m for m in fg_records.lines if "step_on_forward" in m]
    assert told == [
        "fusionguard: fusionguard.track(): its step_on_forward() test raised ZeroDivisionError: division by zero "
        "(no new step on it; said once)"
    ]
    assert not [m for m in fg_records.lines if "internal error" in m]
    a.step_on_forward(None)  # None: no more
    run(model)
    assert a.pending().dense == 8 and len([m for m in fg_records.lines if "step_on_forward" in m]) == 1


def test_a_stopped_session_says_so_instead_of_false_zeros(clean):
    """Hostile read (#33): after stop(), step() gave dense=0 with metrics of 0 and the verdict
    "the model never ran flex" while the model went on running dense."""
    model = Net()
    fg = fusionguard.track(model, log_path=False).start()
    run(model)
    assert fg.step().dense == 2
    fusionguard.enable(log_path=False)  # (the program's own: fusionguard stays on after stop())
    fg.stop()
    run(model)  # dense again, after the session stopped
    for step in (fg.pending(), fg.step(), fg.step()):
        assert step.off == fusionguard.session.STOPPED and step.metrics() == {}
    text, ok = fg.verdict("after stop")
    assert ok and text == f"fusionguard: after stop: no verdict: {fusionguard.session.STOPPED}; start() it again to count"
    total = fg.counts()  # its whole span, which ended at stop(): true counts, with a verdict
    assert total.off is None and total.dense == 2 and total.metrics()["fusionguard/dense_calls"] == 2.0
    assert "dense" in fg.verdict("whole run", total).text and not fg.verdict("whole run", total).ok
    with fg:  # started again: counts from zero, and a step is counted again
        run(model)
        assert fg.step().off is None and fg.pending().off is None


def test_a_session_ended_by_disable_says_so_after_a_new_enable(clean):
    model = Net()
    fg = fusionguard.track(model, log_path=False).start()
    fusionguard.disable()
    fusionguard.enable(strict=True, log_path=False)  # (calls are checked again, not by this session)
    text = fg.verdict("step 1").text
    assert text == "fusionguard: step 1: no verdict: fusionguard.disable() was called; this session ended then (start() it again)"


def test_the_summary_of_a_session_ended_by_disable_shows_what_it_checked_before(clean):
    """#33: it said "FlexAttention calls were not checked" over 2 dense calls it had counted."""
    model = Net()
    fg = fusionguard.track(model, log_path=False).start()
    run(model)
    empty = fusionguard.track(log_path=False).start()  # (counts from here: nothing)
    fusionguard.disable()
    text = fg.summary_text()
    assert text.startswith("fusionguard: this session ended when fusionguard.disable() was called\nlayer ")
    assert "layers.0" in text and "layers.1" in text and "not checked" not in text
    assert empty.summary_text() == (
        "fusionguard: this session ended when fusionguard.disable() was called: no FlexAttention call was counted before it"
    )


_MODELS = '''
import torch
from torch.nn.attention.flex_attention import flex_attention


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

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
'''

_LOAD_WITHOUT_FUSIONGUARD = '''
import sys, warnings
for name in [n for n in sys.modules if n == "fusionguard" or n.startswith("fusionguard.")]:
    del sys.modules[name]
sys.modules["fusionguard"] = None  # (import fusionguard, or any of its modules, now fails)
sys.path.insert(0, sys.argv[1])
import torch
warnings.simplefilter("ignore")
for path in sys.argv[2:]:
    model = torch.load(path, weights_only=False)
    with torch.no_grad():
        out = model(torch.randn(1, 2, 16, 8))
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    print(path.rsplit("/", 1)[-1], tuple(out.shape), hooks)
assert not [n for n in sys.modules if n.startswith("fusionguard")] or sys.modules["fusionguard"] is None
'''


def test_a_model_saved_during_a_session_loads_where_fusionguard_is_not_importable(clean, tmp_path, monkeypatch):
    """F9: ``torch.save(model)`` (the whole module) inside a session carries its hooks; another
    process without fusionguard (an inference server) loads it and runs it."""
    (tmp_path / "tinymodels.py").write_text(_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tinymodels  # (a module of the test's: the loading process imports the class by name)

    model = tinymodels.Net()
    with fusionguard.track(model, log_path=False):
        assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 3  # (the model and its two layers)
        torch.save(model, tmp_path / "during.pt")
        torch.save(copy.deepcopy(model), tmp_path / "copy.pt")
        run(copy.deepcopy(model))  # (a copy runs here too: inert hooks)
    torch.save(model, tmp_path / "after.pt")
    import subprocess
    import sys

    paths = [str(tmp_path / f) for f in ("during.pt", "copy.pt", "after.pt")]
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_FUSIONGUARD, str(tmp_path), *paths], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # during / copy: an inert hook pair on each hooked module; after: none
    assert done.stdout.split("\n")[:3] == ["during.pt (1, 2, 16, 8) 6", "copy.pt (1, 2, 16, 8) 6", "after.pt (1, 2, 16, 8) 0"]


def test_a_fused_call_named_outside_the_watched_model_is_counted_not_dropped(clean):
    """#33: a compiled graph whose names miss the watched ones (Dynamo reaching a layer through
    ``self.__dict__['_modules']``, Lightning's compiled module) counted nothing for the session."""
    from fusionguard.core.state import STATE
    from fusionguard.eventlog.kinds import NO_LAYER
    from fusionguard.watching.naming import fqn_from_source

    assert fqn_from_source("L['self'].__dict__['_modules']['net'].layers.1") == "net.layers.1"
    assert fqn_from_source("L['self'].__dict__[\"_modules\"]['net']") == "net"
    model = Net()
    with fusionguard.track(model, log_path=False) as fg:
        STATE.stats.on_fused([("layers.0", 1), ("not.a.watched.name", 2)], "forward")  # (a graph run's report)
        rows = {r["layer"]: r["fused"] for r in fg.counts().rows}
    assert rows == {"layers.0": 1, NO_LAYER: 2}


def test_the_fused_path_settles_whether_hooks_count_a_call_before_the_tables(clean):
    """#33: the tables took a callback into ``watching`` (run under their lock) to ask whether a
    hooked attention layer counts the calls named outside the watched model: now plain data,
    settled by the fused path per run; the session counts them, summary()'s rows leave them to the hooks."""
    from fusionguard.core.state import STATE
    from fusionguard.eventlog.kinds import NO_LAYER

    with fusionguard.track(Net(), log_path=False) as fg:
        STATE.stats.on_fused([("not.a.watched.name", 2)], "forward", True)
        rows = {r["layer"]: r["fused"] for r in fg.counts().rows}
        summary = {r["layer"]: r["fused"] for r in fusionguard.summary()}
    assert rows == {NO_LAYER: 2} and NO_LAYER not in summary


def test_a_session_stored_on_its_own_model_is_collected_with_it(clean):
    """#33: ``model.fg = fusionguard.track(model).start()`` (a notebook cell run again) held the
    model, its hooks and the enable() for the life of the process: the running sessions' registry
    held the session's end, which held the model's watch, which held the model."""
    gone = []
    for _ in range(3):  # the cell, run 3 times
        model = Net()
        model.fg = fusionguard.track(model, log_path=False).start()
        run(model)
        gone.append((weakref.ref(model), weakref.ref(model.fg)))
    del model
    gc.collect()
    for t in [t for t in threading.enumerate() if t.name == "fusionguard-session-end"]:
        t.join(10)
    assert [(m(), s()) for m, s in gone] == [(None, None)] * 3
    assert not fusionguard.session.STATE.sessions.live and not fusionguard.is_enabled()


class _Outer(torch.nn.Module):
    """A module that compiles its child in ``__init__`` (docs/integrations.md's Lightning advice)."""

    def __init__(self):
        super().__init__()
        self.net = torch.compile(Net())

    def forward(self, inp):
        return self.net(inp)


def test_a_compiled_child_is_named_by_its_layers_and_its_fused_calls_are_said(clean):
    """#33: ``self.net = torch.compile(self.net)``: the compile records name ``net.layers.N``, which
    were not watched names, so all fused calls were ``(no layer)`` and the verdict said "never ran flex"."""
    model = _Outer()
    with fusionguard.track(model, log_path=False) as fg, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            model(x())
        rows = {r["layer"]: r["fused"] for r in fg.counts().rows}
        verdict = fg.verdict("batch 1")
    assert rows == {"net.layers.0": 2, "net.layers.1": 2}
    assert verdict == ("fusionguard: batch 1: 2 FlexAttention layers, forward fused 2/2", True)


def test_the_verdict_on_fused_calls_outside_any_watched_layer_says_them(clean):
    """#33: fused (or dense) calls counted only under ``(no layer)`` are never "the model never ran flex"."""
    from fusionguard.eventlog.kinds import NO_LAYER
    from fusionguard.session import Counts

    def row(dense, fused):
        return {"layer": NO_LAYER, "phase": "forward", "dense": dense, "fused": fused, "allowed": 0, "causes": {}}

    with fusionguard.track(Net(), log_path=False) as fg:
        fused = fg.verdict("batch 1", Counts(fused=6, rows=(row(0, 6),)))
        both = fg.verdict("batch 1", Counts(dense=1, fused=6, rows=(row(1, 6),)))
    assert fused == ("fusionguard: batch 1: 6 fused FlexAttention call(s) outside any watched layer", True)
    assert both.ok is False and "never ran flex" not in both.text and "6 fused" in both.text and "1 dense" in both.text


class _NoWeakRef:
    __slots__ = ()


def test_wrong_arguments_of_the_adapter_methods_raise_naming_them_before_doing_anything(clean, fg_records):
    """#33 (hostile6): ``crashed("x", "y")`` wrote no crash record and said nothing (the record ran inside
    ``guarded()``), ``summary_text(ended_by="x")`` said "the run ended on str", ``bind(None)`` / ``bind(1)``
    were accepted (the ``except TypeError`` for owners without weak references swallowed them)."""
    name = r"^fusionguard.track\(\): "
    with fusionguard.track(Net(), log_path=False) as fg:
        wrong = [
            (lambda: fg.crashed("x", "y"), r"crashed\(exc, where\): exc must be an exception, not str$"),
            (lambda: fg.crashed(ValueError("boom"), 3), r"crashed\(exc, where\): where must be a str, not int$"),
            (lambda: fg.summary_text(ended_by="x"), r"summary_text\(ended_by=...\): ended_by must be an exception or None, not str$"),
            (lambda: fg.bind(None), r"bind\(owner\): owner must be an object with weak references, not NoneType$"),
            (lambda: fg.bind(1), r"bind\(owner\): owner must be an object with weak references, not int$"),
            (lambda: fg.bind(_NoWeakRef()), r"bind\(owner\): owner must be an object with weak references, not _NoWeakRef$"),
            (lambda: fg.verdict(5), r"verdict\(label, counts=...\): label must be a str, not int$"),
            (lambda: fg.guarded(None), r"guarded\(where\): where must be a str, not NoneType$"),
            (lambda: fg.dense_stop(fg.pending(), 12), r"dense_stop\(step, at\): at must be a str, not int$"),
            (lambda: fg.ranks_with_dense("yes"), r"ranks_with_dense\(dense\): dense must be True or False, not str$"),
        ]
        for call, message in wrong:
            with pytest.raises(TypeError, match=name + message):
                call()
        assert not fg._h.bound and fg.active
        assert fusionguard.events("crash") == [] and fg_records.lines == []  # (nothing written, nothing said)
        with pytest.raises(TypeError, match=r"^fusionguard.events\(\): kind must be a str .* or None, not int$"):
            fusionguard.events(1)
        # the right spellings still answer
        assert fg.summary_text(ended_by=KeyboardInterrupt()).startswith("fusionguard: the run ended on KeyboardInterrupt")
        assert fg.ranks_with_dense(True) == [0] and fg.ranks_with_dense(False) == []
        owner = _Owner()
        assert fg.bind(owner) is fg and len(fg._h.bound) == 1
        fg.crashed(ValueError("boom"), "a test")
    assert [e["where"] for e in fusionguard.events("crash")] == ["a test"]


class _Owner:
    pass


def test_ranks_with_dense_takes_what_has_one_truth_value_and_names_numpy_types_in_full(clean):
    """#33 (hostile7): the sixth pass's type check refused a numpy bool, ``1`` and a 0-d bool tensor with
    "dense must be True or False, not bool" (numpy's type is also named ``bool``). An adapter's flag from
    ``np.any(...)`` or ``(t > 0).any()`` is a flag; None, text and a several-element tensor are refused."""
    np = pytest.importorskip("numpy")  # (installed with the test dependencies; torch does not need it)
    call = r"^fusionguard.track\(\): ranks_with_dense\(dense\): dense must be True or False, not "
    with fusionguard.track(None, log_path=False) as fg:
        for flag in (np.bool_(True), np.any(np.array([0, 3]) > 0), torch.tensor([0, 2]).gt(0).any(), torch.tensor([1]), 1, True):
            assert fg.ranks_with_dense(flag) == [0], flag
        for flag in (np.bool_(False), torch.tensor(False), 0, False):
            assert fg.ranks_with_dense(flag) == [], flag
        for flag, name in ((None, "NoneType$"), ("yes", "str$"), (b"1", "bytes$"), ([True], "list$")):
            with pytest.raises(TypeError, match=call + name):
                fg.ranks_with_dense(flag)
        with pytest.raises(TypeError, match=call + r"Tensor \(Boolean value of Tensor with more than one value is ambiguous\)$"):
            fg.ranks_with_dense(torch.tensor([0, 2]).gt(0))
        with pytest.raises(TypeError, match=r"verdict\(label, counts=...\): label must be a str, not numpy.bool$"):
            fg.verdict(np.bool_(True))  # (the qualified name where the short one is a builtin's)


def _hooks(model):
    """Forward (pre-)hooks on the model's modules, and flag ids (with_kwargs, always_call) left without their hook."""
    count = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    stale = [
        k
        for m in model.modules()
        for hooks, flags in ((m._forward_pre_hooks, m._forward_pre_hooks_with_kwargs), (m._forward_hooks, m._forward_hooks_with_kwargs))
        for k in flags
        if k not in hooks
    ] + [k for m in model.modules() for k in m._forward_hooks_always_called if k not in m._forward_hooks]
    return count, stale


def test_a_model_saved_and_loaded_inside_a_session_again_and_again_carries_no_more_hooks(clean):
    """#33 (hostile6): a checkpoint/resume loop saving the whole model inside ``track(model)`` added one
    more set of inert hooks per generation (6, 12, 18, ... on this model): a watch of a copy now takes
    the copy's inert leftovers off (their flags too), so a copy of a copy carries what the first copy did."""
    model, carried = Net(), []
    for _ in range(4):
        with fusionguard.track(model, log_path=False) as fg:
            assert _hooks(model) == (6, [])  # (the live pair on the model and its two layers: no leftover beside it)
            run(model)
            buf = io.BytesIO()
            torch.save(model, buf)
            assert {r["layer"]: r["dense"] for r in fg.counts().rows} == {"layers.0": 1, "layers.1": 1}
        buf.seek(0)
        model = torch.load(buf, weights_only=False)
        carried.append(_hooks(model))
    assert carried == [(6, [])] * 4
    with fusionguard.watch(model):
        pass
    assert _hooks(model) == (0, [])  # (watched and ended: nothing left on it)


_compiled_flex = torch.compile(flex_attention)


class _RootFlex(torch.nn.Module):
    """A model whose own forward calls a compiled flex_attention after its two (eager) attention layers."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, inp):
        out = self.net(inp)
        return _compiled_flex(out, out, out)


def test_the_verdict_says_fused_calls_outside_the_watched_layers_beside_them(clean):
    """#33 (hostile6): with watched-layer rows, the fused calls made outside any watched layer were not
    said ("forward fused 0/2" while the metrics said fused_calls 1); the dense ones outside already were."""
    model = _RootFlex()
    with fusionguard.track(model, log_path=False) as fg:
        run(model)
        counts = fg.counts()
        verdict = fg.verdict("batch 1", counts)
    assert (counts.dense, counts.fused) == (2, 1) and fg.metrics(counts)["fusionguard/fused_calls"] == 1.0
    assert verdict.text == (
        "fusionguard: batch 1: 2 FlexAttention layers, forward fused 0/2; dense: net.layers.0 forward x1 (eager_call); "
        "net.layers.1 forward x1 (eager_call); 1 fused FlexAttention call(s) outside any watched layer"
    )
    assert not verdict.ok
