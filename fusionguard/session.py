"""``fusionguard.track(model)``: one session of fusionguard around a model, for a plain loop and
under every framework callback (docs/integrations.md, "The session object").

    with fusionguard.track(model, strict=True) as fg:
        for batch in loader:
            ...
            step = fg.step()            # this step's counts: dense, fused, allowed, per layer
            writer.add_scalar("fusionguard/dense_calls", step.dense, i)
    print(fg.verdict("run").text)

A session starts ``enable()`` or joins the one running, by one rule: what the session names (``strict``,
``mode``, ``log_path``, options) replaces what the launcher (``FUSIONGUARD=``, ``fusionguard run``) or an
earlier session set, and never what the program's own ``enable()`` set: that conflict is said once (the
program's settings stand; a test runner's ``restore()`` overrides them). It owns the ``watch()`` of its model
(one session per model: a newer session on the same model takes the hooks over), follows the model when the
framework swaps it (``follow()``), and ends on ``stop()``, at the end of its ``with`` block (an exception too),
when the object it is bound to (``bind(trainer)``) or the session itself is garbage-collected, and on
``fusionguard.disable()``, which ends every session. Its counts are its own: every call counted from its start,
by layer, phase and cause. It knows when fusionguard is off (``FUSIONGUARD=off``, ``disable()``) and says so
instead of a verdict.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import fusionguard
from fusionguard import _lifecycle
from fusionguard._summary import Summary
from fusionguard._tally import PEAK, Counts, Tally, Verdict, tap, verdict
from fusionguard.activate import switched_off
from fusionguard.core.config import UNSET, Config, check_log_path, check_options, check_session_arguments, check_truth, check_types
from fusionguard.core.state import STATE, guarded, internal_error, nothing
from fusionguard.eventlog.distributed import process_group_ready, ranks_with
from fusionguard.eventlog.messages import say

__all__ = ["Counts", "Session", "Verdict", "describe", "track"]

KILL_SWITCH = "FUSIONGUARD=off in the environment (the kill switch)"
DISABLED = "fusionguard.disable() was called"
STOPPED = "the session was stopped (stop()): calls since then are not counted"


class _Life:
    """Everything a session's end needs, apart from the session (a weak reference to it at most):
    the finalizer of a session dropped without ``stop()`` ends it through this, never keeping it
    alive, and the undo registry and the other sessions hold this, not the session."""

    def __init__(self, session: "Session", name: str, wanted: Dict[str, Any]) -> None:
        self.session = weakref.ref(session)  # (to give the model's hooks back to it)
        self.key = f"session {next(STATE.sessions.ids)} ({name})"
        self.name = name
        self.wanted = wanted  # what the session names, as the running Config spells it
        self.lock = threading.RLock()
        self.started = False
        self.off: Optional[str] = None
        self.mine: Any = None  # the Config of the enable() this session made
        self.over: Any = None  # (the Config it replaced, who had enabled that, the one put in its place)
        self.order = 0  # when it started (the sessions started after it inherit what it replaced)
        self.total = Tally()
        self.step = Tally()
        self.watch: Any = None
        self.watched: Callable[[], Any] = nothing  # a weak reference to the model the watch is on (the model may hold its session)
        self.took_from: Any = None  # weak reference to the _Life it took the model's hooks over from
        self.bound: List[Any] = []  # finalizers of the objects it is bound to
        self.on_forward = False  # a step_on_forward() test is set (on the session: it may hold the session)


def _unwrap(model: Any) -> Any:
    from fusionguard.watching.watcher import unwrap  # lazy: it imports torch (loaded: a model was given)

    return unwrap(model)


@guarded("session watch exit")
def _end_watch(watch: Any) -> None:
    watch.__exit__(None, None, None)


class Session:
    """One hold on fusionguard around a model: ``fusionguard.track(...)`` makes one (module
    docstring); ``start()`` / ``stop()`` for callbacks, or ``with``."""

    def __init__(
        self,
        model: Any = None,
        *,
        strict: Any = UNSET,
        log_path: Any = UNSET,
        memory: bool = True,
        hooks: bool = True,
        name: str = "fusionguard.Session()",
        **options: Any,
    ) -> None:
        named = dict(options) if strict is UNSET else {**options, "strict": strict}
        try:  # enable()'s own checks, now, naming the session's maker
            check_options(options)
            Config(**named)
            if log_path is not UNSET:
                check_log_path(log_path)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("fusionguard.enable()", name)) from None
        check_session_arguments(name, model, memory=memory, hooks=hooks)
        self.name = name
        self._named = named
        self._log_path = log_path
        self._memory = bool(memory)
        #: False: names only, no hooks (set before ``start()``; a framework that compiles the model later)
        self.hooks = bool(hooks)
        self._model = model
        self._h = _Life(self, name, self._wanted())  # (its end, apart from it)
        self._seen: Tuple[Any, int] = (None, 0)  # (log, seq) for new_events()
        self._entered = 0  # nested ``with`` blocks of this session
        self._on_forward: Optional[Callable[[], bool]] = None  # step_on_forward()'s test
        weakref.finalize(self, _end_soon, self._h, True).atexit = False  # (the process's exit has its own end: at_exit)

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> "Session":
        """Enable or join (the rule in the module docstring), watch the model, count from here.
        A second call while it runs does nothing; after ``stop()`` it starts again, from zero."""
        life = self._h
        with life.lock:
            if life.started:
                return self
            life.started = True
            life.off = None
            if STATE.patches.add_hook("gc.callbacks: session ends", _gc_phase_off, lambda: _gc_phase not in gc.callbacks):
                gc.callbacks.append(_gc_phase)  # (_end_soon's; through the registry: disable() takes it off)
            life.order = next(STATE.sessions.starts)
            self._join()
            if life.off is not None:
                return self
            tap(life.total, False)  # (restore(): the old counters out)
            tap(life.step, False)
            life.total, life.step = Tally(), Tally()
            tap(life.total, True)
            tap(life.step, True)
            self._seen = (STATE.log, STATE.log.seq)
            with STATE.sessions.lock:
                STATE.sessions.live[life.key] = life
            STATE.patches.add_hook(life.key, lambda: _ended_by_disable(life), lambda: life.watch is None)
            if self._model is not None:
                self._follow(self._model)
        return self

    def stop(self) -> None:
        """End the session: its hooks come off, its counts stop; if it enabled fusionguard and no
        other session is running, disable (the launcher's settings come back if it replaced them)."""
        _stop(self._h)

    def __enter__(self) -> "Session":
        self._entered += 1
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self._entered -= 1
        if self._entered <= 0:  # (``with fg:`` inside ``with fg:`` ends with the outer block)
            self._entered = 0
            self.stop()

    def bind(self, owner: Any) -> "Session":
        """End the session when ``owner`` (a Trainer, say: an object that can be weakly referenced) is garbage-collected."""
        try:
            end = weakref.finalize(owner, _end_soon, self._h, False)
        except TypeError:  # (None, an int, a class with __slots__ and no __weakref__: never collected as such)
            raise TypeError(f"{self.name}: bind(owner): owner must be an object with weak references, not {type(owner).__name__}") from None
        end.atexit = False  # (at the process's exit fusionguard's own end runs, as without a session)
        self._h.bound.append(end)
        return self

    def follow(self, model: Any) -> None:
        """Watch ``model`` from now on (the framework swapped it: ``model_init``, a wrapper, a
        compiled or unwrapped model); the same module again does nothing."""
        if model is None:
            raise TypeError(f"{self.name}: follow(model) takes a torch.nn.Module, not None")
        check_session_arguments(self.name, model)
        with self._h.lock:
            self._model = model
            if self._h.started and self._h.off is None:
                self._follow(model)

    # -- what it knows --------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The model watched (unwrapped), or the one given."""
        watched = self._h.watched()
        return watched if watched is not None else self._model

    @property
    def active(self) -> bool:
        """Started, not ended, and fusionguard is on."""
        return self._h.started and self.off is None

    @property
    def off(self) -> Optional[str]:
        """Why fusionguard checks nothing for this session (``FUSIONGUARD=off``, ``disable()``), or None."""
        life = self._h
        if life.off is None and life.started and not fusionguard.is_enabled():
            life.off = DISABLED
        return life.off

    @property
    def mode(self) -> Optional[str]:
        """The running mode (``strict``, ``warn``, ``oom``), None when off."""
        return STATE.config.mode if self.active else None

    @property
    def log_path(self) -> Optional[str]:
        """The log file being written (resolved), None when there is none or fusionguard is off."""
        return STATE.config.log_path if self.active else None

    def counts(self) -> Counts:
        """Every call counted since the session started (``off`` set when fusionguard is off:
        its ``metrics()`` are then empty)."""
        self._started("counts()")
        return self._h.total.counts(self.off)

    def step(self) -> Counts:
        """The calls since the last ``step()`` (or the start), and a new step from here."""
        self._started("step()")
        off = self._not_counting()
        with self._h.lock:
            old, self._h.step = self._h.step, Tally()
            if self._h.started and self._h.off is None:
                tap(self._h.step, True, instead_of=old)  # (one swap: no call falls between the two)
        return old.counts(off)

    def step_on_forward(self, when: Optional[Callable[[], bool]]) -> None:
        """From now on, a new step starts (as ``step()`` starts one) as each forward of its model begins for which
        ``when()`` is true (None: no more): for a framework whose evaluation has no callback at its begin (the Hugging
        Face Trainer's ``evaluate()``), so that the calls made before it, elsewhere, are not its first batch's.
        Only on a model with hooks: none with ``hooks=False`` or a model compiled whole in place."""
        if when is not None and not callable(when):
            raise TypeError(f"{self.name}: step_on_forward() takes a function of no argument (or None), not {type(when).__name__}")
        self._on_forward, self._h.on_forward = when, when is not None

    def pending(self) -> Counts:
        """The calls since the last ``step()``, without starting a new one."""
        self._started("pending()")
        return self._h.step.counts(self._not_counting())

    def metrics(self, counts: Optional[Counts] = None) -> Dict[str, float]:
        """``counts`` (default: since the start) as metric keys, with ``fusionguard/peak_layer_bytes``
        where a watched layer's peak was measured (CUDA); empty when fusionguard is off (never a
        false 0)."""
        self._started("metrics()")
        self._counts_arg("metrics(counts=...)", counts)
        if self.off is not None:
            return {}
        out = (counts or self.counts()).metrics()
        with guarded("session metrics"):
            peaks = [r["peak_delta_max"] for r in STATE.stats.summary() if r.get("peak_delta_max") is not None]
            if self._h.watch is not None and peaks:
                out[PEAK] = float(max(peaks))
        return out

    def verdict(self, label: str, counts: Optional[Counts] = None) -> Verdict:
        """One line on ``counts`` (default: since the last ``step()``), e.g. ``fusionguard: step 1:
        2 FlexAttention layers, forward fused 2/2, backward fused 2/2``; what ran dense and why,
        what never ran flex; or why fusionguard is off."""
        self._started("verdict()")
        check_types(f"{self.name}: verdict(label, counts=...)", label=(label, str))
        self._counts_arg("verdict(label, counts=...)", counts)
        off = self.off or (counts.off if counts is not None else self._not_counting())
        if off is not None:
            then = "this session ended then (start() it again)" if off == DISABLED and fusionguard.is_enabled() else ""
            then = then or ("start() it again to count" if off == STOPPED else "FlexAttention calls are not checked")
            return Verdict(f"fusionguard: {label}: no verdict: {off}; {then}", True)
        try:  # (not guarded(): the fallback names the label)
            return verdict(label, counts or self.pending(), self.model)
        except Exception as exc:
            internal_error("session verdict", exc)
            return Verdict(f"fusionguard: {label}: no verdict (internal error, see the log)", True)

    def summary(self) -> Summary:
        """The session's rows since it started, as a table (``fusionguard.summary()`` counts the process)."""
        return Summary(self.counts().rows)

    def summary_text(self, ended_by: Optional[BaseException] = None) -> str:
        """The summary table, or one line when there is nothing to show (fusionguard off, no call,
        a run that ended on ``ended_by`` before any call); ended by ``disable()``: the rows counted before it."""
        check_types(f"{self.name}: summary_text(ended_by=...)", ended_by=(ended_by, (BaseException, type(None))))
        if self._h.order == 0:
            return f"fusionguard: {self.name} was never started (call start(), or use it in a with block)"
        if self.off == KILL_SWITCH:
            return f"fusionguard: {self.off}; FlexAttention calls were not checked"
        counts = self.counts()
        ended = f"the run ended on {type(ended_by).__name__}" if ended_by is not None else ""
        ended = f"this session ended when {DISABLED}" if self.off is not None else ended
        if not counts.rows:
            return f"fusionguard: {ended + ': ' if ended else ''}no FlexAttention call was counted" + (" before it" if ended else "")
        return (f"fusionguard: {ended}\n" if ended else "") + str(Summary(counts.rows))

    def new_events(self) -> List[Dict[str, Any]]:
        """The events logged since the last call (or the start), oldest first (from the
        in-memory ring: ``enable(max_events=...)`` bounds how many can be seen at once)."""
        self._started("new_events()")
        log = STATE.log
        last_log, last_seq = self._seen
        if log is not last_log:  # (fusionguard's state was reset: a new log, seq from 0)
            last_seq = 0
        if log is last_log and log.seq == last_seq:
            return []
        self._seen = (log, log.seq)
        fresh: List[Dict[str, Any]] = []
        for event in reversed(list(log.memory)):  # list(): a snapshot, threads may append
            if event.get("seq", 0) <= last_seq:
                break
            fresh.append(dict(event))
        fresh.reverse()
        return fresh

    def restore(self) -> None:
        """Put the session's own settings back if the program changed them (its own ``enable()``
        or ``disable()``): for a test runner between tests, the one exception to the who-wins rule:
        the session then owns the running ``enable()`` (``stop()`` ends it). Starts it if it had ended."""
        if self._h.off == KILL_SWITCH:
            return
        with self._h.lock:
            if not fusionguard.is_enabled() or self._differs():
                self._h.started = False
                self._h.off = None
                _lifecycle.enable_as("session", **self._settings())
                self._h.mine = STATE.config
            self.start()

    def guarded(self, where: str) -> ContextManager[None]:
        """For an integration's own bookkeeping: an unexpected error inside is logged once
        (``internal_error``) and the host program goes on; ``DenseFallbackError`` passes."""
        check_types(f"{self.name}: guarded(where)", where=(where, str))
        return guarded(f"{self.name} {where}", passes=(fusionguard.DenseFallbackError,))

    def crashed(self, exc: BaseException, where: str) -> None:
        """The run ends on ``exc``: the ``crash`` record (with ``where``) and the pending counts,
        written now (a framework that tears down before the excepthook would run)."""
        check_types(f"{self.name}: crashed(exc, where)", exc=(exc, BaseException), where=(where, str))
        if not self.active:
            return
        with self.guarded("crash record"):
            from fusionguard.eventlog import crash  # lazy: only on a crash

            crash.record(exc, where=where)
            STATE.log.flush_sampler()

    def ranks_with_dense(self, dense: bool) -> List[int]:
        """The ranks whose ``dense`` is true, the same list on every rank: under several processes a
        collective every rank must call (one small all-reduce); one process: ``[0]`` or ``[]``."""
        dense = check_truth(f"{self.name}: ranks_with_dense(dense)", "dense", dense)  # (a numpy bool, a 1-element tensor)
        try:  # (not guarded(): the fallback depends on dense)
            return ranks_with(dense)
        except Exception as exc:
            internal_error("session ranks_with_dense", exc)
            return [0] if dense else []

    def dense_stop(self, step: "Counts", at: str) -> Optional[str]:
        """``stop_on_dense`` for a framework's adapter, called by every rank after every training
        step: the same answer everywhere (``ranks_with_dense``), so every rank stops together or
        none. The line to say (once, on rank 0) when this step ran dense on some rank, else None."""
        self._counts_arg("dense_stop(step, at)", step, required=True)
        check_types(f"{self.name}: dense_stop(step, at)", at=(at, str))
        if not self.active:
            return None
        ranks = self.ranks_with_dense(step.dense > 0)
        if not ranks:
            return None
        on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if process_group_ready() else ""
        return f"fusionguard: stop_on_dense: dense FlexAttention{on} at {at}: training stops"

    # -- inside ---------------------------------------------------------------------------------------
    def _not_counting(self) -> Optional[str]:
        """Why the span from the last ``step()`` to now is not all counted (off, or stopped), or None."""
        return self.off or (None if self._h.started else STOPPED)

    def _started(self, what: str) -> None:
        """Counts of a session never started would be false zeros (and a false "never ran flex")."""
        if self._h.order == 0:
            raise RuntimeError(
                f"{self.name}: {what} on a session that was never started: call start() first, or use it as `with {self.name} as fg:`"
            )

    def _counts_arg(self, call: str, counts: Any, required: bool = False) -> None:
        if (counts is not None or required) and not isinstance(counts, Counts):
            raise TypeError(f"{self.name}: {call} takes the Counts of step(), counts() or pending(), not {type(counts).__name__}")

    def __reduce_ex__(self, protocol: Any) -> Any:  # (copy.copy and copy.deepcopy come here too)
        raise TypeError(f"a fusionguard session ({self.name}) cannot be copied or pickled; its model can (copy or save the model)")

    def _settings(self) -> Dict[str, Any]:
        return dict(self._named) if self._log_path is UNSET else {**self._named, "log_path": self._log_path}

    def _wanted(self) -> Dict[str, Any]:
        """What the session names, as the running Config spells it."""
        want = {k: v for k, v in self._named.items() if k not in ("strict", "mode")}
        if "strict" in self._named or "mode" in self._named:
            want["mode"] = Config(**{k: v for k, v in self._named.items() if k in ("strict", "mode")}).mode
        if self._log_path is not UNSET:
            want["log_path"] = None if self._log_path is False else self._log_path
        return want

    def _differs(self) -> Dict[str, Tuple[Any, Any]]:
        now = STATE.config
        out = {}
        for k, v in self._wanted().items():
            have = getattr(now, k)
            if k == "log_path" and isinstance(v, (str, os.PathLike)):
                v = os.path.abspath(os.path.expanduser(os.fspath(v)))
                if os.path.isdir(v) and have is not None and os.path.dirname(have) == v:
                    continue
            if have != v and not (k == "log_path" and v is True):
                out[k] = (have, v)
        return out

    def _join(self) -> None:
        if switched_off():
            self._h.off = KILL_SWITCH
            return
        if not fusionguard.is_enabled():
            _lifecycle.enable_as("session", **self._settings())
            self._h.mine = STATE.config if fusionguard.is_enabled() else None
            return
        differ = self._differs()
        if not differ:
            return
        if STATE.enabled_by in ("launcher", "session"):  # defaults: the session's explicit settings win
            before, by = STATE.config, STATE.enabled_by
            if by == "session":
                _tell_overridden(self._h, differ)
            _lifecycle.enable_as("session", **self._settings())
            self._h.over = (before, by, STATE.config)  # (put back at stop: the earlier session's or the launcher's)
            _renamed(before, STATE.config)
            return
        running = ", ".join(f"{k}={have!r}" for k, (have, _) in sorted(differ.items()))
        wanted = ", ".join(f"{k}={want!r}" for k, (_, want) in sorted(differ.items()))
        key = (self.name, wanted, running)
        if key not in STATE.sessions.told:
            STATE.sessions.told.add(key)
            say(
                f"fusionguard: {self.name} asked for {wanted}, but the program's own fusionguard.enable() set "
                f"{running}: the program's settings stand (pass them to that enable(), or leave them out of {self.name})\n"
            )

    def _follow(self, model: Any, regain: bool = False) -> None:
        with guarded("session watch"):
            import torch  # lazy: torch loads with the first watched model, never when this module is imported

            inner = _unwrap(model)
            life = self._h
            if not isinstance(inner, torch.nn.Module) or inner is life.watched() or not (life.started and life.off is None):
                return  # (an ended session never takes hooks)
            from fusionguard.watching.watcher import Watch  # lazy: it imports torch

            if not regain:
                _pass_on(life)
            _unwatch(life)
            with STATE.sessions.lock:  # one session per model: the newest takes the hooks over (and gives them back at its end)
                ref, owner = STATE.sessions.owners.get(id(inner), (None, None))
                other = owner() if owner is not None and ref is not None and ref() is inner else None
                if other is not None and other is not life:
                    _unwatch(other, give_back=False)
                    life.took_from = weakref.ref(other)
                elif not regain:
                    life.took_from = None
                life.watch = Watch(inner, memory=self._memory, hooks=self.hooks).__enter__().release()
                life.watch.on_forward = _forward_began
                life.watched = weakref.ref(inner)
                try:
                    STATE.sessions.own(inner, life)
                except TypeError:
                    pass


def _forward_began(model: Any) -> None:
    """A watched model's forward begins (its root pre-hook): the sessions of that model whose
    ``step_on_forward()`` test says so start a new step (whichever session holds its hooks)."""
    with STATE.sessions.lock:
        lives = [life for life in STATE.sessions.live.values() if life.on_forward and life.started]
    for life in lives:
        session = life.session()
        when = session._on_forward if session is not None else None
        if session is None or when is None or _unwrap(session._model) is not model or not _asks(life, when):
            continue
        with life.lock:
            old, life.step = life.step, Tally()
            if life.started and life.off is None:
                tap(life.step, True, instead_of=old)


def _asks(life: _Life, when: Callable[[], bool]) -> bool:
    """The user's ``step_on_forward()`` test; one that raises is said once (not fusionguard's error) and means no."""
    try:
        return bool(when())
    except Exception as exc:
        if ("on_forward", life.key) not in STATE.sessions.told:
            STATE.sessions.told.add(("on_forward", life.key))
            say(f"fusionguard: {life.name}: its step_on_forward() test raised {type(exc).__name__}: {exc} (no new step on it; said once)\n")
        return False


# -- a session's end, from its _Life (stop(), disable(), its finalizer) ------------------------------


def _stop(life: _Life) -> None:
    """``stop()``: hooks off, counts stop, then what it enabled or replaced is handed over."""
    with life.lock:
        if not life.started:
            return
        life.started = False
        STATE.patches.remove(life.key)  # (its undo, _ended_by_disable, is then a no-op)
        _end(life, None)
        with STATE.sessions.lock:
            STATE.sessions.live.pop(life.key, None)
            others = [o for o in STATE.sessions.live.values() if o.started]
        _hand_over(life, others)


def _end_soon(life: _Life, dropped: bool) -> None:
    """The finalizer of a session (``dropped``: garbage-collected without ``stop()``) or of what it
    is bound to: the session ends as ``stop()`` ends it, now; inside a cyclic garbage collection,
    which may run while this thread holds one of fusionguard's locks, on a short-lived thread."""
    if not life.started:
        return
    if STATE.sessions.collecting:
        try:
            threading.Thread(target=_end_dropped, args=(life, dropped), name="fusionguard-session-end", daemon=True).start()
            return
        except RuntimeError:  # (the interpreter is shutting down: at_exit ends everything)
            return
    _end_dropped(life, dropped)


@guarded("session finalizer")
def _end_dropped(life: _Life, dropped: bool) -> None:
    if dropped and life.started and life.off is None and ("dropped", life.name) not in STATE.sessions.told:
        STATE.sessions.told.add(("dropped", life.name))
        say(f"fusionguard: a session of {life.name} was garbage-collected without stop(): it ended as stop() ends it\n")
    _stop(life)


def _gc_phase(phase: str, info: Any) -> None:
    if phase == "start":
        STATE.sessions.collecting.append(True)
    else:
        STATE.sessions.collecting.clear()


def _gc_phase_off() -> None:
    if _gc_phase in gc.callbacks:
        gc.callbacks.remove(_gc_phase)
    STATE.sessions.collecting.clear()  # (taken off mid-collection: no "stop" phase comes)


def _unwatch(life: _Life, give_back: bool = True) -> None:
    """Hooks off; ``give_back``: the running session this one took the model over from
    (a nested session on the same model; through any that ended meanwhile) watches it again."""
    owned = False
    with STATE.sessions.lock:
        w, life.watch = life.watch, None
        inner, life.watched = life.watched(), nothing
        if inner is not None:
            ref, owner = STATE.sessions.owners.get(id(inner), (None, None))
            if owner is not None and owner() is life:
                del STATE.sessions.owners[id(inner)]
                owned = True
    if w is not None:
        _end_watch(w)
    earlier, seen = (life.took_from() if owned and give_back and life.took_from is not None else None), {id(life)}
    while earlier is not None and id(earlier) not in seen and not (earlier.started and earlier.off is None):
        seen.add(id(earlier))  # (never itself, never an ended one, never round a cycle)
        earlier = earlier.took_from() if earlier.took_from is not None else None
    session = earlier.session() if earlier is not None and id(earlier) not in seen and earlier.watched() is None else None
    if session is not None and _unwrap(session._model) is inner:
        session._follow(session._model, regain=True)


def _pass_on(life: _Life) -> None:
    """``life`` ends or follows another model: who took its model's hooks over from it takes them from whom it took them."""
    with STATE.sessions.lock:
        for other in STATE.sessions.live.values():
            if other.took_from is not None and other.took_from() is life:
                other.took_from = None if life.took_from is None or life.took_from() is other else life.took_from  # (no cycle)


def _end(life: _Life, why: Optional[str]) -> None:
    _pass_on(life)  # (it may be freed next)
    _unwatch(life, give_back=why is None)  # (disable() ends every session: none takes hooks back)
    tap(life.total, False)
    tap(life.step, False)
    if why is not None:
        life.off = why
    for f in life.bound:
        f.detach()
    life.bound = []


def _ended_by_disable(life: _Life) -> None:
    """``disable()`` (the registry's undo; also run by ``stop()``, then a no-op): hooks off,
    counts stop, the session says so."""
    if not life.started:
        return
    life.started = False
    _end(life, DISABLED)
    with STATE.sessions.lock:
        STATE.sessions.live.pop(life.key, None)


def _tell_overridden(life: _Life, differ: Dict[str, Tuple[Any, Any]]) -> None:
    """A running session named a setting this one replaces: said once (it comes back at this one's stop)."""
    with STATE.sessions.lock:
        others = [o for o in STATE.sessions.live.values() if o is not life and o.started and o.off is None]
    for other in others:
        keys = sorted(k for k in differ if k in other.wanted)
        if not keys:
            continue
        was = ", ".join(f"{k}={differ[k][0]!r}" for k in keys)
        now = ", ".join(f"{k}={differ[k][1]!r}" for k in keys)
        key = (life.name, other.name, now, was)
        if key not in STATE.sessions.told:
            STATE.sessions.told.add(key)
            say(
                f"fusionguard: {life.name} sets {now} while {other.name} (still running) asked for {was}: "
                f"the newest session's settings apply until it stops, then {other.name}'s come back\n"
            )


def _hand_over(life: _Life, others: List[_Life]) -> None:
    """What this session enabled passes to a running session, else is undone; what it replaced
    (the launcher's or an earlier session's settings) comes back, unless a session started
    after it runs on its settings (which then puts them back at its own stop)."""
    mine, life.mine = life.mine, None
    over, life.over = life.over, None
    if not fusionguard.is_enabled():
        return
    with guarded("session stop"):
        if mine is not None and STATE.config is mine:
            if not others:
                fusionguard.disable()
                return
            others[-1].mine = mine
        if over is not None:
            before, by, put = over
            if STATE.config is not put:  # (changed since: whoever replaced it puts back what this one replaced)
                for o in others:
                    if o.over is not None and o.over[0] is put:
                        o.over = (before, by, o.over[2])
                return
            later = [o for o in others if o.order > life.order]
            if later:  # the next one started on what this one put in place: it puts back what this one replaced
                after = min(later, key=lambda o: o.order)
                after.over = over if after.over is None else (before, by, after.over[2])
                return
            back = {k: getattr(before, k) for k in life.wanted if k != "log_path"}
            if "log_path" in life.wanted:
                back["log_path"] = before.log_path if before.log_path is not None else False
            _lifecycle.enable_as(by, **back)
            _renamed(put, STATE.config)


def _renamed(old: Any, new: Any) -> None:
    """The running Config ``old`` was replaced by ``new``: the sessions that hold it (the one
    they enabled, the one they put in place of another) hold ``new``."""
    with STATE.sessions.lock:
        live = list(STATE.sessions.live.values())
    for o in live:
        if o.mine is old:
            o.mine = new
        if o.over is not None and o.over[2] is old:
            o.over = (o.over[0], o.over[1], new)


def track(
    model: Any = None, *, strict: Any = UNSET, log_path: Any = UNSET, memory: bool = True, hooks: bool = True, **options: Any
) -> Session:
    """A session around ``model`` (module docstring): ``with fusionguard.track(model, strict=True):``,
    or ``fg = fusionguard.track(model).start()`` ... ``fg.stop()``.

    strict, log_path, options: ``enable()``'s (``mode="oom"``, ``rescue=True``...), checked now;
    only what is named is applied (the rule in the module docstring). memory: per-layer CUDA
    memory (``watch()``'s). hooks=False: names only, no hooks (a model the framework compiles
    after the session starts). ``model`` may be None (counts only) and set later (``follow``).
    A copy of the model made meanwhile (``copy.deepcopy``, ``torch.save``) carries a stdlib no-op
    per hook (``contextlib.nullcontext.__exit__``): it loads without fusionguard; a session of the copy takes them off."""
    if "name" in options:  # (Session(name=...) is the adapters': its messages say that name)
        raise TypeError("fusionguard.track() takes no name: its messages say fusionguard.track(); an adapter uses Session(name=...)")
    return Session(model, strict=strict, log_path=log_path, memory=memory, hooks=hooks, name="fusionguard.track()", **options)


def describe(event: Dict[str, Any]) -> str:
    """The human verdict of a dense ``flex_call`` event (the text of ``DenseFallbackError``)."""
    from fusionguard.dense.guard import format_message  # lazy: it imports torch

    return format_message(event)
