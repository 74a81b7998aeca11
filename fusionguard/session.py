"""``fusionguard.track(model)``: one session of fusionguard around a model, for a plain loop and
under every framework callback (docs/integrations.md, "The session object").

    with fusionguard.track(model, strict=True) as fg:
        for batch in loader:
            ...
            step = fg.step()            # this step's counts: dense, fused, allowed, per layer
            writer.add_scalar("fusionguard/dense_calls", step.dense, i)
    print(fg.verdict("run").text)

A session starts ``enable()`` or joins the one running, by one rule: what the session names
(``strict``, ``mode``, ``log_path``, options) replaces what the launcher (``FUSIONGUARD=``,
``fusionguard run``) or an earlier session set, and never what the program's own ``enable()``
set: that conflict is said once (the program's settings stand). It owns the ``watch()`` of its
model (one session per model: a newer session on the same model takes the hooks over), follows
the model when the framework swaps it (``follow()``), and ends on ``stop()``, at the end of its
``with`` block (an exception too), when the object it is bound to (``bind(trainer)``) or the
session itself is garbage-collected, and on ``fusionguard.disable()``, which ends every session.
Its counts are its own: every call counted from its start, by layer, phase and cause. It knows
when fusionguard is off (``FUSIONGUARD=off``, ``disable()``) and says so instead of a verdict.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

import fusionguard
from fusionguard._summary import Summary
from fusionguard._tally import PEAK, Counts, Tally, Verdict, tap, verdict
from fusionguard.activate import switched_off
from fusionguard.core.config import UNSET, Config, check_log_path, check_options
from fusionguard.core.state import STATE, guarded, internal_error
from fusionguard.eventlog.messages import say

__all__ = ["Counts", "Session", "Verdict", "describe", "track"]

KILL_SWITCH = "FUSIONGUARD=off in the environment (the kill switch)"
DISABLED = "fusionguard.disable() was called"


class _Held:
    """A session's counters and watch, apart from it: what its finalizer undoes."""

    def __init__(self) -> None:
        self.total = Tally()
        self.step = Tally()
        self.watch: Any = None


_IDS = itertools.count(1)
_STARTS = itertools.count(1)
_LIVE: "weakref.WeakSet[Session]" = weakref.WeakSet()  # started, not ended
_OWNERS: Dict[int, Tuple[Any, Any]] = {}  # id(model) -> (weak model, weak session watching it)
_TOLD: set = set()  # conflicts said (once per process)
_LOCK = threading.RLock()


def unwrap(model: Any) -> Any:
    """The model under DataParallel / DistributedDataParallel / FSDP1 wrappers (their ``module``);
    a ``torch.compile`` wrapper is kept: ``watch()`` names through it and hooks nothing inside."""
    import torch  # lazy: torch loads with the first watched model, never when this module is imported

    wrappers: Tuple[type, ...] = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel  # lazy: an optional part of torch

        wrappers += (FullyShardedDataParallel,)
    except Exception:
        pass
    for _ in range(8):
        inner = getattr(model, "module", None)
        if not (isinstance(model, wrappers) and isinstance(inner, torch.nn.Module)):
            break
        model = inner
    return model


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
        name: str = "fusionguard.track()",
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
        _check_arguments(name, model, memory=memory, hooks=hooks)
        self.name = name
        self._named = named
        self._log_path = log_path
        self._memory = bool(memory)
        #: False: names only, no hooks (set before ``start()``; a framework that compiles the model later)
        self.hooks = bool(hooks)
        self._model = model
        self._id = next(_IDS)
        self._lock = threading.RLock()
        self._started = False
        self._off: Optional[str] = None
        self._mine: Any = None  # the Config of the enable() this session made
        self._over: Any = None  # (the Config it replaced, who had enabled that, the one put in its place)
        self._order = 0  # when it started (the sessions started after it inherit what it replaced)
        self._h = _Held()  # what the finalizer needs: counters and the watch
        self._watched: Any = None  # the model the watch is on
        self._took_from: Any = None  # weak reference to the session it took the model's hooks over from
        self._seen: Tuple[Any, int] = (None, 0)  # (log, seq) for new_events()
        self._bound: List[Any] = []
        self._entered = 0  # nested ``with`` blocks of this session
        weakref.finalize(self, _finalize, self._h).atexit = False  # (the process's exit has its own end: at_exit)

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> "Session":
        """Enable or join (the rule in the module docstring), watch the model, count from here.
        A second call does nothing."""
        with self._lock:
            if self._started:
                return self
            self._started = True
            self._off = None
            self._order = next(_STARTS)
            self._join()
            if self._off is not None:
                return self
            self._h.total, self._h.step = Tally(), Tally()
            tap(self._h.total, True)
            tap(self._h.step, True)
            self._seen = (STATE.log, STATE.log.seq)
            with _LOCK:
                _LIVE.add(self)
            me, held = weakref.ref(self), self._h  # (the registry must not keep a dropped session alive)
            STATE.patches.add_hook(self._key(), lambda: _if_alive(me, Session._ended_by_disable), lambda: held.watch is None)
            if self._model is not None:
                self._follow(self._model)
        return self

    def stop(self) -> None:
        """End the session: its hooks come off, its counts stop; if it enabled fusionguard and no
        other session is running, disable (the launcher's settings come back if it replaced them)."""
        with self._lock:
            if not self._started:
                return
            self._started = False
            STATE.patches.remove(self._key())  # (the entry's undo ends the watch and the counts)
            self._end(None)
            with _LOCK:
                _LIVE.discard(self)
                others = [s for s in _LIVE if s._started]
            self._hand_over(others)

    def __enter__(self) -> "Session":
        self._entered += 1
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self._entered -= 1
        if self._entered <= 0:  # (``with fg:`` inside ``with fg:`` ends with the outer block)
            self._entered = 0
            self.stop()

    def bind(self, owner: Any) -> "Session":
        """End the session when ``owner`` (a Trainer, say) is garbage-collected."""
        try:
            end = weakref.finalize(owner, Session.stop, self)
            end.atexit = False  # (at the process's exit fusionguard's own end runs, as without a session)
            self._bound.append(end)
        except TypeError:  # (no weak references to it: the session ends with itself or the process)
            pass
        return self

    def follow(self, model: Any) -> None:
        """Watch ``model`` from now on (the framework swapped it: ``model_init``, a wrapper, a
        compiled or unwrapped model); the same module again does nothing."""
        with self._lock:
            self._model = model
            if self._started and self._off is None:
                self._follow(model)

    # -- what it knows --------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The model watched (unwrapped), or the one given."""
        return self._watched if self._watched is not None else self._model

    @property
    def active(self) -> bool:
        """Started, not ended, and fusionguard is on."""
        return self._started and self.off is None

    @property
    def off(self) -> Optional[str]:
        """Why fusionguard checks nothing for this session (``FUSIONGUARD=off``, ``disable()``), or None."""
        if self._off is None and self._started and not fusionguard.is_enabled():
            self._off = DISABLED
        return self._off

    @property
    def mode(self) -> Optional[str]:
        """The running mode (``strict``, ``warn``, ``oom``), None when off."""
        return STATE.config.mode if self.active else None

    @property
    def log_path(self) -> Optional[str]:
        """The log file being written (resolved), None when there is none or fusionguard is off."""
        return STATE.config.log_path if self.active else None

    def counts(self) -> Counts:
        """Every call counted since the session started."""
        return self._h.total.counts()

    def step(self) -> Counts:
        """The calls since the last ``step()`` (or the start), and a new step from here."""
        with self._lock:
            old, self._h.step = self._h.step, Tally()
            if self._started and self._off is None:
                tap(self._h.step, True, instead_of=old)  # (one swap: no call falls between the two)
        return old.counts()

    def pending(self) -> Counts:
        """The calls since the last ``step()``, without starting a new one."""
        return self._h.step.counts()

    def metrics(self, counts: Optional[Counts] = None) -> Dict[str, float]:
        """``counts`` (default: since the start) as metric keys, with ``fusionguard/peak_layer_bytes``
        where a watched layer's peak was measured (CUDA); empty when fusionguard is off (never a
        false 0)."""
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
        if self.off is not None:
            return Verdict(f"fusionguard: {label}: no verdict: {self.off}; FlexAttention calls are not checked", True)
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
        a run that ended on ``ended_by`` before any call)."""
        if self.off is not None:
            return f"fusionguard: {self.off}; FlexAttention calls were not checked"
        counts = self.counts()
        ended = f"the run ended on {type(ended_by).__name__}" if ended_by is not None else ""
        if not counts.rows:
            return f"fusionguard: {ended + ' ' if ended else ''}no FlexAttention call was counted" + (" before it" if ended else "")
        return (f"fusionguard: {ended}\n" if ended else "") + str(Summary(counts.rows))

    def new_events(self) -> List[Dict[str, Any]]:
        """The events logged since the last call (or the start), oldest first (from the
        in-memory ring: ``enable(max_events=...)`` bounds how many can be seen at once)."""
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
        or ``disable()``): for a test runner between tests. Starts the session if it had ended."""
        if self._off == KILL_SWITCH:
            return
        with self._lock:
            if not fusionguard.is_enabled() or self._differs():
                self._started = False
                self._off = None
                fusionguard._enable_as("session", **self._settings())
                self._mine = STATE.config
            self.start()

    def guarded(self, where: str) -> ContextManager[None]:
        """For an integration's own bookkeeping: an unexpected error inside is logged once
        (``internal_error``) and the host program goes on; ``DenseFallbackError`` passes."""
        return guarded(f"{self.name} {where}", passes=(fusionguard.DenseFallbackError,))

    def crashed(self, exc: BaseException, where: str) -> None:
        """The run ends on ``exc``: the ``crash`` record (with ``where``) and the pending counts,
        written now (a framework that tears down before the excepthook would run)."""
        if not self.active:
            return
        with self.guarded("crash record"):
            from fusionguard.eventlog import crash  # lazy: only on a crash

            crash.record(exc, where=where)
            STATE.log.flush_sampler()

    def ranks_with_dense(self, dense: bool) -> List[int]:
        """The ranks whose ``dense`` is true, the same list on every rank: under several processes a
        collective every rank must call (one small all-reduce); one process: ``[0]`` or ``[]``."""
        from fusionguard.eventlog.distributed import process_group_ready  # lazy: only for stop_on_dense

        if not process_group_ready():
            return [0] if dense else []
        try:  # (not guarded(): the fallback depends on dense)
            import torch  # lazy: as above
            import torch.distributed as dist  # lazy: as above

            nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
            flags = torch.zeros(
                dist.get_world_size(), dtype=torch.int32, device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
            )
            flags[dist.get_rank()] = int(dense)
            dist.all_reduce(flags)
            return [r for r, flag in enumerate(flags.tolist()) if flag]
        except Exception as exc:
            internal_error("session ranks_with_dense", exc)
            return [0] if dense else []

    def dense_stop(self, step: "Counts", at: str) -> Optional[str]:
        """``stop_on_dense`` for a framework's adapter, called by every rank after every training
        step: the same answer everywhere (``ranks_with_dense``), so every rank stops together or
        none. The line to say (once, on rank 0) when this step ran dense on some rank, else None."""
        if not self.active:
            return None
        ranks = self.ranks_with_dense(step.dense > 0)
        if not ranks:
            return None
        from fusionguard.eventlog.distributed import process_group_ready  # lazy: as in ranks_with_dense

        on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if process_group_ready() else ""
        return f"fusionguard: stop_on_dense: dense FlexAttention{on} at {at}: training stops"

    # -- inside ---------------------------------------------------------------------------------------
    def _key(self) -> str:
        return f"session {self._id} ({self.name})"

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
            self._off = KILL_SWITCH
            return
        if not fusionguard.is_enabled():
            fusionguard._enable_as("session", **self._settings())
            self._mine = STATE.config if fusionguard.is_enabled() else None
            return
        differ = self._differs()
        if not differ:
            return
        if STATE.enabled_by in ("launcher", "session"):  # defaults: the session's explicit settings win
            before, by = STATE.config, STATE.enabled_by
            if by == "session":
                self._tell_overridden(differ)
            fusionguard._enable_as("session", **self._settings())
            self._over = (before, by, STATE.config)  # (put back at stop: the earlier session's or the launcher's)
            _renamed(before, STATE.config)
            return
        running = ", ".join(f"{k}={have!r}" for k, (have, _) in sorted(differ.items()))
        wanted = ", ".join(f"{k}={want!r}" for k, (_, want) in sorted(differ.items()))
        key = (self.name, wanted, running)
        if key not in _TOLD:
            _TOLD.add(key)
            say(
                f"fusionguard: {self.name} asked for {wanted}, but the program's own fusionguard.enable() set "
                f"{running}: the program's settings stand (pass them to that enable(), or leave them out of {self.name})\n"
            )

    def _follow(self, model: Any, regain: bool = False) -> None:
        with guarded("session watch"):
            import torch  # lazy: torch loads with the first watched model, never when this module is imported

            inner = unwrap(model)
            if not isinstance(inner, torch.nn.Module) or inner is self._watched:
                return
            from fusionguard.watching.watcher import Watch  # lazy: it imports torch

            self._unwatch()
            with _LOCK:  # one session per model: the newest takes the hooks over (and gives them back at its end)
                ref, owner = _OWNERS.get(id(inner), (None, None))
                other = owner() if owner is not None and ref is not None and ref() is inner else None
                if other is not None and other is not self:
                    other._unwatch(give_back=False)
                    self._took_from = weakref.ref(other)
                elif not regain:
                    self._took_from = None
                self._h.watch = Watch(inner, memory=self._memory, hooks=self.hooks).__enter__()
                self._watched = inner
                try:
                    _OWNERS[id(inner)] = (weakref.ref(inner), weakref.ref(self))
                except TypeError:
                    pass

    def _unwatch(self, give_back: bool = True) -> None:
        """Hooks off; ``give_back``: the running session this one took the model over from
        (a nested session on the same model; through any that ended meanwhile) watches it again."""
        owned = False
        with _LOCK:
            w, self._h.watch = self._h.watch, None
            inner, self._watched = self._watched, None
            if inner is not None:
                ref, owner = _OWNERS.get(id(inner), (None, None))
                if owner is not None and owner() is self:
                    del _OWNERS[id(inner)]
                    owned = True
        if w is not None:
            _end_watch(w)
        earlier = self._took_from() if owned and give_back and self._took_from is not None else None
        for _ in range(64):
            if earlier is None or (earlier._started and earlier._off is None):
                break
            earlier = earlier._took_from() if earlier._took_from is not None else None
        if earlier is not None and earlier._watched is None and unwrap(earlier._model) is inner:
            earlier._follow(earlier._model, regain=True)

    def _end(self, why: Optional[str]) -> None:
        self._unwatch(give_back=why is None)  # (disable() ends every session: none takes hooks back)
        tap(self._h.total, False)
        tap(self._h.step, False)
        if why is not None:
            self._off = why
        for f in self._bound:
            f.detach()
        self._bound = []

    def _ended_by_disable(self) -> None:
        """``disable()`` (the registry's undo; also run by ``stop()``, then a no-op): hooks off,
        counts stop, the session says so."""
        if not self._started:
            return
        self._started = False
        self._end(DISABLED)
        with _LOCK:
            _LIVE.discard(self)

    def _tell_overridden(self, differ: Dict[str, Tuple[Any, Any]]) -> None:
        """A running session named a setting this one replaces: said once (it comes back at this one's stop)."""
        with _LOCK:
            others = [s for s in _LIVE if s is not self and s._started and s._off is None]
        for other in others:
            theirs = other._wanted()
            keys = sorted(k for k in differ if k in theirs)
            if not keys:
                continue
            was = ", ".join(f"{k}={differ[k][0]!r}" for k in keys)
            now = ", ".join(f"{k}={differ[k][1]!r}" for k in keys)
            key = (self.name, other.name, now, was)
            if key not in _TOLD:
                _TOLD.add(key)
                say(
                    f"fusionguard: {self.name} sets {now} while {other.name} (still running) asked for {was}: "
                    f"the newest session's settings apply until it stops, then {other.name}'s come back\n"
                )

    def _hand_over(self, others: List["Session"]) -> None:
        """What this session enabled passes to a running session, else is undone; what it replaced
        (the launcher's or an earlier session's settings) comes back, unless a session started
        after it runs on its settings (which then puts them back at its own stop)."""
        mine, self._mine = self._mine, None
        over, self._over = self._over, None
        if not fusionguard.is_enabled():
            return
        with guarded("session stop"):
            if mine is not None and STATE.config is mine:
                if not others:
                    fusionguard.disable()
                    return
                others[-1]._mine = mine
            if over is not None:
                before, by, put = over
                if STATE.config is not put:  # (changed since: whoever replaced it puts back what this one replaced)
                    for s in others:
                        if s._over is not None and s._over[0] is put:
                            s._over = (before, by, s._over[2])
                    return
                later = [s for s in others if s._order > self._order]
                if later:  # the next one started on what this one put in place: it puts back what this one replaced
                    after = min(later, key=lambda s: s._order)
                    after._over = over if after._over is None else (before, by, after._over[2])
                    return
                back = {k: getattr(before, k) for k in self._wanted() if k != "log_path"}
                if "log_path" in self._wanted():
                    back["log_path"] = before.log_path if before.log_path is not None else False
                fusionguard._enable_as(by, **back)
                _renamed(put, STATE.config)


def _renamed(old: Any, new: Any) -> None:
    """The running Config ``old`` was replaced by ``new``: the sessions that hold it (the one
    they enabled, the one they put in place of another) hold ``new``."""
    with _LOCK:
        live = list(_LIVE)
    for s in live:
        if s._mine is old:
            s._mine = new
        if s._over is not None and s._over[2] is old:
            s._over = (s._over[0], s._over[1], new)


def _check_arguments(name: Any, model: Any, **flags: Any) -> None:
    """A wrong type is a clear ``TypeError`` naming the argument, before anything is installed."""
    if not isinstance(name, str):
        raise TypeError(f"fusionguard.Session(): name must be a str, not {type(name).__name__}")
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: {key} must be True or False, not {value!r}")
    if model is not None:
        import torch  # lazy: a model was given, so torch is loaded already

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{name}: model must be a torch.nn.Module (or None: counts only), not {type(model).__name__}")


def _if_alive(ref: Any, method: Any) -> None:
    obj = ref()
    if obj is not None:
        method(obj)


def _finalize(held: _Held) -> None:
    """The session was garbage-collected without ``stop()``: its hooks come off, its counters out."""
    try:
        tap(held.total, False)
        tap(held.step, False)
        w, held.watch = held.watch, None
        if w is not None:
            _end_watch(w)
    except Exception:
        pass


def track(
    model: Any = None, *, strict: Any = UNSET, log_path: Any = UNSET, memory: bool = True, hooks: bool = True, **options: Any
) -> Session:
    """A session around ``model`` (module docstring): ``with fusionguard.track(model, strict=True):``,
    or ``fg = fusionguard.track(model).start()`` ... ``fg.stop()``.

    strict, log_path, options: ``enable()``'s (``mode="oom"``, ``rescue=True``...), checked now;
    only what is named is applied (the rule in the module docstring). memory: per-layer CUDA
    memory (``watch()``'s). hooks=False: names only, no hooks (a model the framework compiles
    after the session starts). ``model`` may be None (counts only) and set later (``follow``)."""
    return Session(model, strict=strict, log_path=log_path, memory=memory, hooks=hooks, **options)


def describe(event: Dict[str, Any]) -> str:
    """The human verdict of a dense ``flex_call`` event (the text of ``DenseFallbackError``)."""
    from fusionguard.dense.guard import format_message  # lazy: it imports torch

    return format_message(event)


def _iter_live() -> Iterator[Session]:  # (tests)
    with _LOCK:
        return iter(list(_LIVE))
