"""Compiled graphs at run time: the layer of each fused FlexAttention call (at compile time
from Dynamo's FX graph, at each run from the frame's module or AOTAutograd's ``ctx``) and the
count of every graph run (``count_runs``): one Python call per graph run, none per kernel."""

from __future__ import annotations

import re
import sys
import warnings
import weakref
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from fusionguard import torch_internals as ti
from fusionguard.core import profiler as profiling
from fusionguard.core.frames import take_deferred
from fusionguard.core.state import STATE, count, internal_error
from fusionguard.watching.naming import (
    clean_name,
    counting_layer,
    flex_layer,
    fqn_from_source,
    in_backward,
    is_watching,
    outside_watched,
    resolve_watched_name,
    stack_source,
    watched_forward,
    watched_name,
)
from fusionguard.watching.paths import caller_name, is_module_forward, module_path

# -- names: the layer of each FlexAttention call of a compiled graph ------------------------------
#
# Dynamo names modules relative to the frame it compiled (``L['self'].attn``), and one compiled
# frame serves every instance of its class (Dynamo does not guard on module identity): after a
# graph break each block's ``forward`` is compiled once for all blocks; ``block.compile()``
# compiles ``Module._call_impl`` once for every block. So a graph's calls are named by the path
# Dynamo recorded (from the FX graph of this very compile, the same on a cache hit) joined to the
# watched name of the module the frame runs for, which is read again at each run when that
# module is a watched layer (``_FrameLocal``).

_ROOT_LOCAL = re.compile(r"^L\[['\"]([^'\"]+)['\"]\]")


def dynamo_names() -> Optional[Tuple[List[str], Optional["_FrameLocal"], Any]]:
    """In a Dynamo compile: the module path of each FlexAttention call in the frame's FX graph
    (relative to the frame's root module, graph order), a finder for that module at run time,
    and the module now (or None where the calls are not under one module local)."""
    found = ti.dynamo_frame_graph()
    if found is None:
        return None
    import torch  # lazy: torch loads on first use, never when this module is imported

    f_locals, code, graph = found
    hop = torch.ops.higher_order.flex_attention
    rels: List[str] = []
    roots = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not hop:
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        if stack:
            m = _ROOT_LOCAL.match(stack_source(stack[0]))
            roots.add(m.group(1) if m else None)
        else:  # called by the frame's own module (a method of it): no module entered
            roots.add("self" if isinstance(f_locals.get("self"), torch.nn.Module) else None)
        rels.append(clean_name(fqn_from_source(stack_source(stack[-1]))) if stack else "")
    local = roots.pop() if len(roots) == 1 else None
    root = f_locals.get(local) if local else None
    if local is None or not isinstance(root, torch.nn.Module):
        return rels, None, None
    return rels, _FrameLocal((code.co_name,), code.co_filename, local), root


# A compiled frame's module known to lie outside the watched models (``naming.outside_watched``):
# its calls are none of theirs, whatever its paths spell (never a module name: names hold no NUL).
OUTSIDE = "\0outside"


def root_prefix(module: Any) -> Optional[str]:
    """The name of a compiled frame's module: its watched name under ``watch()`` (None if it is
    not known to be watched, ``OUTSIDE`` if known not to be), else its path from the outermost
    module holding it (``watching.paths``)."""
    if module is None:
        return None
    if not is_watching():
        return module_path(module)
    name = watched_name(module)
    return OUTSIDE if name is None and outside_watched(module) else name


def join_names(prefix: Optional[str], rels: List[str], outer: str = "") -> List[Optional[str]]:
    """Full names of calls at ``rels``: under the watched module ``prefix`` ('' for a watched
    model), else (a frame rooted outside the watched models) joined to the hook layer around
    the compile and mapped to the watched spelling (``resolve_watched_name``); ``OUTSIDE``: none
    (named by the hooked layer running them, if any: ``_hook_names``)."""
    if prefix == OUTSIDE:
        return [None] * len(rels)
    if prefix is not None:
        return [".".join(x for x in (prefix, r) if x) or None for r in rels]
    out: List[Optional[str]] = []
    for r in rels:
        name = ".".join(x for x in (outer, r) if x)
        out.append(resolve_watched_name(name) if name else None)
    return out


class _FrameLocal:
    """A local of the nearest frame above the caller running one of ``names`` (code name) in a
    file whose path contains ``file``: the root module of a compiled frame (``self``), or AOTAutograd's
    ``ctx``. The depth found is kept and checked by code identity, so a run costs one
    ``sys._getframe`` and one locals read; after ``patience`` misses in a row it stops looking."""

    patience = 8

    __slots__ = ("names", "file", "local", "depth", "code", "misses")

    def __init__(self, names: Tuple[str, ...], file: str, local: str) -> None:
        self.names, self.file, self.local = names, file, local
        self.depth, self.code, self.misses = 0, None, 0

    def get(self) -> Any:
        f: Any
        if self.code is not None:
            try:
                f = sys._getframe(self.depth)
                if f.f_code is self.code:
                    return f.f_locals.get(self.local)
            except ValueError:
                pass
        if self.misses >= self.patience:
            return None
        f = start = sys._getframe(1)
        d = 1
        while f is not None and d < 80:
            if self._match(f):
                self.depth, self.code, self.misses = d, f.f_code, 0
                return f.f_locals.get(self.local)
            f, d = f.f_back, d + 1
        self.misses += 1
        self._missed(start)
        return None

    def _match(self, f: Any) -> bool:
        c = f.f_code
        return c.co_name in self.names and self.file in c.co_filename and self.local in c.co_varnames

    def _missed(self, f: Any) -> None:
        """A walk from ``f`` found nothing."""


class _WatchedSelf(_FrameLocal):
    """The nearest frame whose ``self`` is a watched module: for a graph compiled before
    ``enable()``, whose frame is unknown (found once per graph, then kept like any other)."""

    def __init__(self) -> None:
        super().__init__((), "", "self")

    def _match(self, f: Any) -> bool:
        return "self" in f.f_code.co_varnames and watched_name(f.f_locals.get("self")) is not None


class _WatchedForward(_FrameLocal):
    """The nearest frame running a watched module's own ``forward`` (by its code, as
    ``layer_from_stack`` finds a dense call's layer): under a ``watch()`` that leaves watched
    modules without hooks (``hooks=False``, the Trainer's ``torch_compile``), the layer that called
    a compiled function from eager code (found once per graph, then kept like any other). It never
    stops looking: the calls from outside a watched forward (a reference model of the same class,
    a teacher) may come first. A miss is cheap after the first from its caller: the innermost
    module ``forward`` a walk found nothing above (``outside``) ends the next walks there, its
    depth kept like a found one's (its ``self``, unwatched, names nothing; a watched module of
    the same class at that depth is named)."""

    patience = sys.maxsize

    def __init__(self) -> None:
        super().__init__((), "", "self")
        self.outside: Dict[int, Any] = {}  # id(code) -> code: forwards of modules that called from outside

    def _match(self, f: Any) -> bool:
        return id(f.f_code) in self.outside or watched_forward(f) is not None

    def _missed(self, f: Any) -> None:
        for _ in range(80):
            if f is None:
                return
            if is_module_forward(f):
                if len(self.outside) >= 64:
                    self.outside.clear()
                self.outside[id(f.f_code)] = f.f_code  # (the code kept alive: its id is never reused meanwhile)
                return
            f = f.f_back


class _ModuleForward(_FrameLocal):
    """The nearest frame running a module's own ``forward``: without ``watch()``, the layer that
    called a compiled function (found once per graph, then kept like any other)."""

    def __init__(self) -> None:
        super().__init__((), "", "self")

    def _match(self, f: Any) -> bool:
        return is_module_forward(f)


def _aot_ctx() -> "_FrameLocal":
    """AOTAutograd's autograd ``ctx``: shared by a forward run and its backward."""
    return _FrameLocal(ti.AOT_CTX_FUNCTIONS, ti.AOT_RUNTIME_DIR, "ctx")


_CTX_FIELD = "_fusionguard_layers"  # on AOTAutograd's ctx: the forward run's full names


def _ctx_names(ctx: Any, n: int, backward: bool) -> Optional[Tuple[Optional[str], ...]]:
    """The names a forward run left on ``ctx``, in the order of a backward graph's calls
    (reverse: gradients flow back through the calls last to first)."""
    names = getattr(ctx, _CTX_FIELD, None) if ctx is not None else None
    if not names or len(names) != n:
        return None
    return tuple(reversed(names)) if backward else tuple(names)


def log_compile_record(fields: Dict[str, Any]) -> None:
    count(f"fused_compile_{fields['phase']}")
    STATE.log.emit("info", "flex_compile", **fields)


def compile_names(
    calls: List[Dict[str, Any]], source: Optional[str], around: Optional[str]
) -> Tuple[Optional[List[Optional[str]]], Optional[str], Optional["Namer"]]:
    """Names of a graph's calls at compile time, how they were found, and its run-time namer.

    A forward graph compiled by Dynamo (lowered, or loaded from Inductor's / AOTAutograd's
    caches: Dynamo traces the frame anew either way) is named from that FX graph's
    ``nn_module_stack`` ("nn_module_stack"). A backward graph is compiled (or loaded) at its
    first run, outside Dynamo: it takes the names its forward run left on AOTAutograd's ``ctx``
    ("forward_run"). Neither (a graph found at ``enable()``): None."""
    phases = {c["phase"] for c in calls}
    if len(phases) != 1:
        return None, None, None
    phase = phases.pop()
    if source == "before_enable":  # no module paths: named by the watched module running it
        return None, None, Namer(phase, len(calls), [""] * len(calls), _WatchedSelf(), "")
    dyn = dynamo_names()
    outer = flex_layer() or ""
    if dyn is not None and len(dyn[0]) == len(calls):
        rels, finder, root = dyn
        if phase == "backward":
            rels = rels[::-1]
        prefix = root_prefix(root)
        joined = join_names(prefix, rels, outer)
        namer = Namer(phase, len(calls), rels, finder, outer)
        if any(joined) or phase == "backward" or len(calls) != 1 or is_watching():
            return joined, "nn_module_stack", namer
        return _caller_names(namer)
    namer = Namer(phase, len(calls), None, None, around or "")
    if phase == "backward":
        names = _ctx_names(_aot_ctx().get(), len(calls), True)
        if names is not None:
            return list(names), "forward_run", namer
    elif len(calls) == 1 and not around and not is_watching():
        return _caller_names(namer)
    return None, None, namer


def _caller_names(namer: "Namer") -> Tuple[Optional[List[Optional[str]]], Optional[str], "Namer"]:
    """Without ``watch()``, a compiled function's one call (compiled inside its first call, so
    the stack holds the caller): named by the module whose ``forward`` called it."""
    name = caller_name(sys._getframe(2), limit=400)
    return ([name], "caller", namer) if name else (None, None, namer)


class Namer:
    """Names a compiled graph's calls at each run under ``watch()`` (without it, the module is
    named by ``watching.paths``); results built once per set of names (a run looks them up).
    Forward: the compile-time paths joined to the watched name of the module the frame runs for
    now (read from the running frame, ``_FrameLocal``); the names go on AOTAutograd's ``ctx`` for
    the backward. Backward: the names its forward left on the ``ctx``. A graph with one call and
    nothing better: the layer running now (hooks, backward span; ``_hook_names``)."""

    __slots__ = ("phase", "n", "rels", "root", "outer", "ctx", "built", "unwatched", "callers")

    def __init__(self, phase: str, n: int, rels: Optional[List[str]], root: Optional[_FrameLocal], outer: str) -> None:
        self.phase, self.n, self.rels, self.root, self.outer = phase, n, rels, root, outer
        self.ctx = _aot_ctx()
        self.built: Dict[Any, Any] = {}
        # without watch(): a frame of a module (one graph may serve every block), a backward
        # (named by its forward run) or a graph of one call (named by the layer calling it) is
        # still named per run; others keep their compile-time names
        self.unwatched = phase == "backward" or (rels is not None and root is not None) or n == 1
        self.callers: Dict[type, _FrameLocal] = {}  # finder class -> its finder (``_caller_names``)

    def names(self) -> Optional[Tuple[Optional[str], ...]]:
        if self.phase == "backward":
            return _ctx_names(self.ctx.get(), self.n, True)
        if self.rels is None or self.root is None:
            return None  # (a frame of no module: a function compiled, called from the layers)
        prefix = root_prefix(self.root.get())
        names = self.built.get(prefix)
        if names is None:
            names = self.built[prefix] = tuple(join_names(prefix, self.rels, self.outer))
        return names

    def run(self, fixed: Tuple[Optional[str], ...]) -> Tuple[Optional[str], ...]:
        """This run's names (``fixed``: the compile-time ones), left on the ctx for a backward."""
        names = self.names()
        if names is None or not any(names):
            # (a graph with no module path of its own, a compiled function: its fixed name is its first caller's)
            names = _hook_names(fixed, self.phase == "forward" and (self.rels is None or not any(self.rels)))
            if self.n == 1 and self.phase == "forward":
                if not is_watching():
                    names = self._caller_names(names, _ModuleForward, module_path)
                elif STATE.watch.unhooked and not flex_layer():  # (hooks name every caller that is a hooked layer)
                    names = self._caller_names(names, _WatchedForward, watched_name)
        self._to_backward(names)
        return names

    def _caller_names(
        self, names: Tuple[Optional[str], ...], finder: type, name_of: Callable[[Any], Optional[str]]
    ) -> Tuple[Optional[str], ...]:
        """The one call of a compiled function (``torch.compile(flex_attention)`` serves every
        layer), named by the module whose ``forward`` called it now. Without ``watch()``: any
        module (``_ModuleForward``, ``module_path``). Under it, when no hook named it and a watched
        module has none (``hooks=False``): the watched one (``_WatchedForward``, ``watched_name``),
        as a dense call is (a Trainer's second ``evaluate()`` runs the model it compiled for the
        first eagerly, its attention calling Hugging Face's compiled ``flex_attention``)."""
        found = self.callers.get(finder)
        if found is None:
            found = self.callers[finder] = finder()
        module = found.get()
        if module is None and found.misses >= found.patience:
            self.unwatched = False  # called from no module's forward: runs keep the fixed names
        name = name_of(module)
        if not name:
            return names
        built = self.built.get(name)
        if built is None:
            built = self.built[name] = (name,)
        return built

    def _to_backward(self, names: Tuple[Optional[str], ...]) -> None:
        """A forward run leaves its names on AOTAutograd's ctx (none in an inference graph)."""
        if self.phase == "forward" and any(names):
            ctx = self.ctx.get()
            if ctx is not None:
                try:
                    setattr(ctx, _CTX_FIELD, names)
                except Exception:
                    pass


def _hook_names(fixed: Tuple[Optional[str], ...], from_caller: bool = False) -> Tuple[Optional[str], ...]:
    """One compiled flex_attention often serves every layer (``torch.compile(flex_attention)``
    called from eager modules): its compile-time layer is the first caller's. For a graph with one
    FlexAttention call, the layer running it now (forward hooks, or the open backward span),
    unless the compile-time name is a more specific module inside it. ``from_caller`` (the graph
    holds no module path: its fixed name is only its first caller's, never this run's): under
    ``watch()`` the run is the running hooked layer's (a container's own call too), else no
    layer's (the model's own forward, a model watched with ``hooks=False``), as a dense call there
    is; ``Namer.run`` then names it by the watched forward calling it, if a watched module has no hooks."""
    if len(fixed) != 1:
        return fixed
    now = flex_layer()
    if from_caller and is_watching():
        return (now or None,)
    known = fixed[0]
    if not now or known and known.startswith(now + "."):
        return fixed
    return (now,)


def _hooks_count(per_layer: Tuple[Tuple[Optional[str], int], ...]) -> bool:
    """Whether the calls of this run that are named outside the watched models (if any) are
    counted by the hooks of the attention layer running it (``naming.counting_layer``), so that
    ``summary()``'s rows leave them out (``Stats.on_fused``); asked only for such names."""
    watched = STATE.watch.names
    return bool(watched) and any(x is not None and x not in watched for x, _ in per_layer) and bool(counting_layer())


def _run_events(
    fields: Dict[str, Any], names: Tuple[Optional[str], ...]
) -> Tuple[List[Dict[str, Any]], Tuple[Tuple[Optional[str], int], ...]]:
    """The ``flex_run`` events of a graph run whose calls have ``names``, and its per-layer counts
    (for ``summary()``): one event per layer, so that the log's per-(layer, phase) counters stay
    exact when one graph holds several layers' calls (``flex_calls`` of the layer, ``graph_calls``
    of the run); unnamed calls share one event with ``layer: null``, and count under ``None``
    (``summary()``'s ``(no layer)`` row, as ``report`` counts that event)."""
    counts: Dict[Optional[str], int] = {}
    for x in names:
        counts[x] = counts.get(x, 0) + 1
    if len(counts) == 1:
        ((x, k),) = counts.items()
        events = [{**fields, "layer": x, "layers": [x] if x else None}]
    else:
        events = [
            {**fields, "layer": x, "layers": [x] if x else None, "flex_calls": k, "graph_calls": len(names)} for x, k in counts.items()
        ]
    return events, tuple((x, k) for x, k in counts.items() if x != "")


def count_runs(compiled: Any, records: List[Dict[str, Any]], namer: Optional[Namer] = None) -> None:
    """Per-call evidence for a compiled graph holding fused FlexAttention: count its executions.

    The fused kernels run without any Python call into the operator, but every execution of the
    compiled graph goes through ``CompiledFxGraph.current_callable`` (also a CUDA-graph replay,
    which is started from there). Wrapping that one callable costs one Python call per graph
    execution, not per kernel, and never changes which launcher runs. Each execution logs a
    ``flex_run`` event (sampled like every fused per-call event: the first few per layer and
    phase, then counters) with the number of fused FlexAttention calls it made, named per run
    (``Namer``; without ``watch()`` too, see ``Namer.unwatched``). The wrapper goes in through
    the patch registry, so ``disable()`` puts the graph's own callable back."""
    fn = ti.graph_callable(compiled)
    if fn is None or getattr(fn, "_fusionguard_records", None) is not None or not records:
        return
    per_phase: Dict[str, List[Dict[str, Any]]] = {}
    for r in records:
        per_phase.setdefault(r["phase"], []).append(r)
    summaries: List[Dict[str, Any]] = [
        {
            "path": "fused",
            "traced": True,
            "cause": None,
            "phase": phase,
            "flex_calls": len(rs),
            "template": rs[0].get("template"),
            "graph": rs[0].get("graph"),
            "cudagraphs": ti.graph_uses_cudagraphs(compiled) or None,
        }
        for phase, rs in per_phase.items()
    ]

    # Built once: per run, only a counter, the naming of the run (under watch(); its events are
    # built once per set of names) and the (sampled) events remain on the fused path.
    runs: List[Tuple[str, int, Dict[str, Any], Tuple[Any, ...], Dict[Any, Any]]] = [
        (f"fused_runs_{s['phase']}", s["flex_calls"], s, tuple(r.get("layer") for r in per_phase[s["phase"]]), {}) for s in summaries
    ]
    if len(runs) != 1:
        namer = None
    unlogged = [r["record"] for r in records if r.get("record", {}).get("source") == "before_enable"]

    def run_names(n: int, names: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if namer is not None:
            if namer.unwatched or is_watching():
                return namer.run(names)
        elif n == 1:
            return _hook_names(names)
        return names

    def range_name() -> str:  # (named before the run, as the bookkeeping below names it after)
        return profiling.fused_name((fields["phase"], run_names(n, names)) for _, n, fields, names, _ in runs)

    # Warnings an error filter raised while Dynamo traced this compile (recompile pressure): issued
    # at the graph's first run, where the filter raises them at the user's call; the graph stays.
    deferred = take_deferred(ti.current_compile_id())
    runtime = STATE.runtime  # (the holder: its ``now`` is read per run, one object)

    def counted(*args: Any, **kwargs: Any) -> Any:
        while deferred:
            warnings.warn_explicit(*deferred.pop(0))  # (popped first: issued once, whatever the filter does)
        if profiling.recording() and runtime.now.enabled:  # a range in the profiler's timeline, every run
            out = profiling.in_range(range_name, fn, *args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        if runtime.now.enabled:  # (read after the run: a disable() meanwhile counts nothing)
            try:  # a plain try, not guarded(): it costs nothing per run when nothing raises
                for key, n, fields, names, cache in runs:
                    count(key, n)
                    names = run_names(n, names)
                    hit = cache.get(names)
                    if hit is None:
                        if len(cache) > 10_000:
                            cache.clear()
                        hit = cache[names] = _run_events(fields, names)
                    events, per_layer = hit
                    if unlogged:  # a graph compiled before enable(): its records at its first run
                        for rec in unlogged:
                            if n == 1 and rec.get("layer") is None and names[0]:
                                rec = {**rec, "layer": names[0], "named_from": "first_run"}
                            log_compile_record(rec)
                        unlogged.clear()
                    # a forward re-run by checkpointing inside the backward is not a new call
                    # (a watched layer's hooks count it as a recompute)
                    if per_layer and not (fields["phase"] == "forward" and in_backward()):
                        STATE.stats.on_fused(per_layer, fields["phase"], _hooks_count(per_layer))
                    for event in events:
                        STATE.log.emit_fields("info", "flex_run", event)
            except Exception as exc:
                internal_error("fused run count", exc)
        return out

    # A plain function, not wrapt (#24): an entry of the graph's __dict__, called once per graph run,
    # and it carries attributes of its own (a wrapt proxy would set them on the graph's callable).
    counted._fusionguard_records = summaries  # type: ignore[attr-defined]
    counted.__wrapped__ = fn  # type: ignore[attr-defined]
    if not ti.graph_callable_is_own(compiled):  # (not reversible: not wrapped)
        return
    if not unlogged:
        _remember(compiled, records, namer)
    table = _GraphAttrs(compiled)
    # (keyed by the table, which the registry keeps alive: its id is never reused meanwhile)
    STATE.patches.apply(f"graph {id(table)}.{ti.CURRENT_CALLABLE}", table, ti.CURRENT_CALLABLE, lambda _: counted)


def _remember(compiled: Any, records: List[Dict[str, Any]], namer: Optional[Namer]) -> None:
    """Keep a compiled graph's records and namer past ``disable()`` (``counted_before``)."""
    table, key = STATE.caches.graph_names, id(compiled)

    def forget(ref: Any) -> None:  # (the graph is gone: its id may be reused)
        entry = table.get(key)
        if entry is not None and entry[0] is ref:
            del table[key]

    try:
        table[key] = (weakref.ref(compiled, forget), records, namer)
    except TypeError:  # (no weak reference to it: not kept)
        pass


def counted_before(compiled: Any) -> Optional[Tuple[List[Dict[str, Any]], Optional[Namer]]]:
    """The records and namer an earlier ``enable()`` of this process counted ``compiled`` with, or
    None. ``disable()`` puts the graph's own callable back, and Dynamo runs the same graph after the
    next ``enable()``, which finds it living (``source: "before_enable"``): its compile-time names
    (``nn_module_stack``) are gone with its FX graph, so they are kept here. Its records are
    written again (to the new log) at its first run, with ``source: "before_enable"``."""
    entry = STATE.caches.graph_names.get(id(compiled))
    if entry is None or entry[0]() is not compiled:
        return None
    return [{**r, "record": {**r["record"], "source": "before_enable"}} for r in entry[1]], entry[2]


class _GraphAttrs(MutableMapping):
    """A compiled graph's attributes for the patch registry, holding the graph weakly: the
    registry must not keep a graph Dynamo dropped (and its constants) alive until disable()."""

    def __init__(self, graph: Any) -> None:
        self.ref = weakref.ref(graph)

    def _attrs(self) -> Dict[str, Any]:
        graph = self.ref()
        return {} if graph is None else graph.__dict__

    def __getitem__(self, key: str) -> Any:
        return self._attrs()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        graph = self.ref()
        if graph is not None:
            graph.__dict__[key] = value

    def __delitem__(self, key: str) -> None:
        del self._attrs()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._attrs())

    def __len__(self) -> int:
        return len(self._attrs())
