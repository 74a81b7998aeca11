"""The tables fusionguard fills while a program runs: per-layer statistics, the watch registry,
the running sessions, and the caches of the dense path. Each is a field of the single ``State`` (``core/state.py``).

Why a module of its own: ``core.state`` imports these classes, and nothing here imports ``core.state``
(nor torch; of fusionguard's, only ``eventlog.kinds``' ``NO_LAYER``), so the state has no import
cycle. Each class resets *in place* (``reset()``): the objects live as long as the process, so a
module may hold one and never see a stale copy.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from fusionguard.eventlog.kinds import NO_LAYER  # (also read from here: summary()'s rows)


@dataclass
class LayerStats:
    calls: int = 0
    dense: int = 0  # dense calls not allowed (warned or blocked)
    allowed: int = 0  # dense calls inside allow_dense() (or the debug flag): on purpose, not dense
    fused: int = 0
    recompute: int = 0
    dense_recompute: int = 0
    causes: Dict[str, int] = field(default_factory=dict)
    alloc_delta_last: Optional[int] = None
    alloc_delta_max: Optional[int] = None
    peak_delta_last: Optional[int] = None
    peak_delta_max: Optional[int] = None
    scores_bytes: Optional[int] = None
    measured: int = 0


class WatchRegistry:
    """What ``watch()`` knows about the user's modules while it is active (``fusionguard.watching``).

    ``names``: qualified names under an active watch() -> count. ``modules``: id(module) ->
    (weak reference, qualified name, watch() count, forward's code): names a dense call by the
    module whose forward frame made it. ``forward_codes``: id of those forwards' code objects ->
    count; ``forward_sites``: their (file, first line) -> count (a forward Dynamo compiled runs
    its own rewritten code, with the same file and first line). ``roots``: id(watched model) ->
    (weak reference, count). ``pairs``: module -> its pool of hook pairs (the same hook objects at
    every entry: Dynamo guards on them). ``hooked``: id(pair) -> the pairs now registered (taken
    out of sight while Dynamo compiles). ``compiled_inside``: module held by a live
    ``torch.compile`` wrapper -> a weak reference to that wrapper. ``unhooked``: id(Watch) ->
    True for each running watch that names modules it puts no hooks on (``hooks=False``,
    modules inside or held by a compile wrapper): only then is the layer of a compiled function's
    call looked for on the stack (``fused.runs``). ``lock`` guards modules, roots, pairs and hooked."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.names: Dict[str, int] = {}
        self.modules: Dict[int, Tuple[Any, str, int, Any]] = {}
        self.forward_codes: Dict[Any, int] = {}
        self.forward_sites: Dict[Tuple[str, int], int] = {}
        self.roots: Dict[int, Tuple[Any, int]] = {}
        self.pairs: "weakref.WeakKeyDictionary[Any, List[Any]]" = weakref.WeakKeyDictionary()
        self.hooked: Dict[int, Any] = {}
        self.compiled_inside: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self.unhooked: Dict[int, bool] = {}

    def tables(self) -> Dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "lock"}

    def reset(self) -> None:
        with self.lock:
            for table in self.tables().values():
                table.clear()


class SessionRegistry:
    """The sessions of ``fusionguard.track()`` (``session.py``). ``live``: key -> the end-state
    (``_Life``) of each session started and not ended, oldest first. ``owners``: id(model) ->
    (weak reference to the model, weak reference to the ``_Life`` holding its hooks): one session
    per model. ``told``: the lines said once (conflicts, a dropped session, a raising test).
    ``collecting``: non-empty while a cyclic garbage collection runs (``gc.callbacks``). ``ids`` /
    ``starts`` hand out session numbers and start order (never reset: only unique numbers).
    ``lock`` guards live and owners."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.ids = itertools.count(1)
        self.starts = itertools.count(1)
        self.live: Dict[str, Any] = {}
        self.owners: Dict[int, Tuple[Any, Any]] = {}
        self.told: Set[Any] = set()
        self.collecting: List[bool] = []

    def tables(self) -> Dict[str, Any]:
        return {"live": self.live, "owners": self.owners, "told": self.told}

    def own(self, model: Any, life: Any) -> None:
        """``life`` holds ``model``'s hooks; the entry goes when the model is collected (a session
        that ends then finds its model gone, and no one else would remove it)."""
        key, owners = id(model), self.owners

        def forget(ref: Any) -> None:  # (no lock: a collection may run while a thread holds it)
            if owners.get(key, (None,))[0] is ref:
                owners.pop(key, None)

        owners[key] = (weakref.ref(model, forget), weakref.ref(life))

    def reset(self) -> None:
        with self.lock:
            for table in self.tables().values():
                table.clear()


class Stats:
    """Per-(layer, phase) counts and memory for ``summary()``, the layer classes seen calling
    FlexAttention, the true CUDA peaks across watch()'s resets, and two once-per-process notes."""

    def __init__(self, watched: Dict[str, int]) -> None:
        self.lock = threading.Lock()
        self.watched = watched  # the watch registry's names (reset in place: never a stale copy)
        self.reset()

    def reset(self) -> None:
        self.rows: Dict[Tuple[str, str], LayerStats] = {}
        self.flex_classes: set = set()  # module classes seen making FlexAttention calls
        self.peak: Dict[int, int] = {}  # device -> true peak allocated, across our resets
        self.warned_reset = False
        self.told_traced = False  # watch_traced said (once per process)
        # recompile pressure: frames holding FlexAttention, by id(code): code, compiles, warned
        self.pressure: Dict[int, Dict[str, Any]] = {}
        # no_flex_calls: watched models already told about (once per model), by id: a weakref
        self.no_flex_told: Dict[int, Any] = {}
        # the counters of running sessions (``fusionguard.track()``): each gets every call counted
        # here, under this lock, from its start (a tuple, replaced whole: read without the lock)
        self.taps: Tuple[Any, ...] = ()

    def new_log(self) -> None:
        """A new log file starts: its rows count from zero. Why: a log's ``summary`` event (and
        ``summary()``) must count that log's calls only; rows kept from an earlier log added its
        hook-counted calls and memory to this log's graph runs (double counts, memory of layers
        never measured here). Learned layer classes and the true peaks are the process's: kept."""
        with self.lock:
            self.rows = {}

    def row(self, layer: str, phase: str) -> LayerStats:
        key = (layer, phase)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = LayerStats()
        return row

    def on_dense(
        self,
        layer: Optional[str],
        phase: str,
        cause: Optional[str],
        scores: Optional[int],
        recompute: bool = False,
        allowed: bool = False,
    ) -> None:
        with self.lock:
            for tap in self.taps:
                tap.on_dense(NO_LAYER if layer is None else layer, phase, cause, allowed)
            row = self.row(NO_LAYER if layer is None else layer, phase)
            if recompute:  # checkpointing re-ran the dense forward: counted apart from calls
                row.dense_recompute += 1
            elif allowed:  # on purpose: not dense, and no cause (a session's and the report's rule)
                row.allowed += 1
                return
            else:
                row.dense += 1
            if cause:
                row.causes[cause] = row.causes.get(cause, 0) + 1
            if scores:
                row.scores_bytes = max(row.scores_bytes or 0, scores)

    def on_fused(self, layers: Iterable[Tuple[Optional[str], int]], phase: str, hooked: bool = False) -> None:
        """A compiled graph ran: ``(layer, n)`` fused FlexAttention calls per layer, ``None``
        for calls no name reaches (``NO_LAYER``). Under ``watch()``, a name outside the watched
        model counts under ``NO_LAYER`` in the sessions' counters, which no hook feeds: a call
        named wrongly is still counted, never dropped. The rows count it there too, unless
        ``hooked``: a hooked attention layer runs the graph (``fused.runs`` settles it per run,
        before), whose hooks count those calls by layer (not twice): a graph compiled inside one
        block names its modules relative to that block (``attn`` for every block's)."""
        watched = self.watched
        with self.lock:
            for layer, n in layers:
                if layer is None:
                    layer = NO_LAYER
                elif watched and layer not in watched:
                    for tap in self.taps:
                        tap.on_fused(NO_LAYER, phase, n)
                    if not hooked:
                        self.row(NO_LAYER, phase).fused += n
                    continue
                self.row(layer, phase).fused += n
                for tap in self.taps:
                    tap.on_fused(layer, phase, n)

    def summary(self) -> List[Dict[str, Any]]:
        with self.lock:
            out = []
            for (layer, phase), r in sorted(
                self.rows.items(), key=lambda kv: (kv[0][0] == NO_LAYER, kv[0])
            ):  # (NO_LAYER last, as report has it)
                d = {"layer": layer, "phase": phase, **r.__dict__}
                d["causes"] = dict(r.causes)
                # Calls of a FlexAttention layer that ran no dense kernel (allowed or not) ran the
                # fused one; compiled-graph runs count their fused calls (a compiled model has no hooks).
                d["calls"] = max(r.calls, r.dense + r.allowed + r.fused)
                d["fused"] = max(r.fused, d["calls"] - r.dense - r.allowed)
                out.append(d)
            return out


class ModulePaths:
    """Module names found without ``watch()`` (``watching.paths``): by identity, checked through
    a weak reference; the last scan's parent links and outermost modules."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.names: Dict[int, Tuple[Any, str]] = {}  # id(module) -> (ref, name)
        self.parents: Dict[int, Tuple[Any, Any, str]] = {}  # id(child) -> (ref child, ref parent, key)
        self.tops: Dict[int, Any] = {}  # id(outermost module) -> ref, as of the last scan
        self.partial: Dict[str, int] = {}  # class name -> instances named partially so far
        self.rooted: Any = None  # weak ref to the one model named from the root (""), if any
        self.scans = 0
        self.scan_s = 0.0  # seconds spent scanning
        self.noted = False

    def __len__(self) -> int:  # (what is held: empty after reset, like the other tables)
        return (
            len(self.names) + len(self.parents) + len(self.tops) + len(self.partial) + self.scans + self.noted + (self.rooted is not None)
        )


class Caches:
    """What the dense path works out once and looks up after: bounded, keyed so that a stale
    entry is never returned (each user checks identity or bounds the size)."""

    def __init__(self) -> None:
        # guard: trace-time notes of dense kernels Dynamo inlined, by token; tensor fields by
        # (shapes, dtype, device); the last stderr message per phase
        self.inline_notes: Dict[int, dict] = {}
        self.tensor_fields: Dict[tuple, Dict[str, Any]] = {}
        self.messages: Dict[Optional[str], tuple] = {}
        # causes: id(code) -> (code, kind, original code, is the user's) for each stack frame seen
        self.code_kinds: Dict[int, Tuple[Any, int, Optional[Any], bool]] = {}
        # rescue: Dynamo backends looked up once ("inductor")
        self.backends: Dict[str, Any] = {}
        # watching.paths: module names without watch()
        self.module_paths = ModulePaths()
        # watching.naming: per FX graph's generated code object, line -> the module path of the
        # FlexAttention call on that line (a dense call inside an aot_eager graph)
        self.graph_lines: Dict[Any, Dict[int, str]] = {}
        # fused.runs: id(compiled graph) -> (weak reference to it, its records, its namer), as the
        # enable() that counted it had them: kept over disable(), so a graph Dynamo reuses after a
        # later enable() keeps its layer names
        self.graph_names: Dict[int, Tuple[Any, List[Dict[str, Any]], Any]] = {}

    def reset(self) -> None:
        for table in vars(self).values():
            table.clear()
