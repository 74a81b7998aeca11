"""Bounded log volume: which per-call events are written in full and which become counters.

Why its own module: the sampler is pure bookkeeping (no I/O, no torch): the first few fused
per-call events per (layer, phase) and the first few repeats of one dense call are written, the
rest are folded into ``fused_calls`` / ``dense_calls`` counter events, so nothing is lost.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

#: Defaults of the sampler (``enable(fused_first=..., fused_every=..., keep_all=...)``).
DEFAULT_FUSED_FIRST = 10
DEFAULT_FUSED_EVERY = 1000
#: Never sampled, whatever their fields say.
NEVER_SAMPLED = frozenset(
    {"header", "flex_compile", "flex_call", "flex_inlined", "summary", "shutdown", "crash", "fused_calls", "dense_calls", "mask_builds"}
)
#: Emitting one of these first writes the pending ``fused_calls`` counters (nothing is lost).
FLUSH_BEFORE = frozenset({"summary", "shutdown", "crash"})
KEEP = "keep"
COUNTER_LEVEL = {"fused_calls": "info", "dense_calls": "warning", "mask_builds": "info"}


class _Window:
    __slots__ = ("total", "window", "agg", "flex_calls", "same")

    def __init__(self, same: Optional[Dict[str, Any]] = None) -> None:
        self.total = 0
        self.window = 0
        self.flex_calls = 0  # FlexAttention calls covered by the window's ``flex_run`` events
        self.agg: Dict[str, List[Any]] = {}  # field -> [max, last]
        self.same = same  # fields every call of the key shares (a dense key's cause, site, ...)


#: What a dense call's sampling key holds besides layer and phase, copied into its counter.
_DENSE_KEY_FIELDS = ("cause", "action", "call_site", "traced")


class Sampler:
    """Decides which per-call events are written.

    Fused per-call events (``info``, ``path: "fused"``), per (layer, phase): the first ``first``
    are kept as they are; after that, calls are counted and every ``every``-th call writes one
    ``fused_calls`` event instead, covering the calls since the previous record: ``count`` (calls
    covered), ``total`` (calls so far for that layer and phase), ``of`` (the event kind counted)
    and, for each numeric field in ``aggregate`` that the events carried, ``<field>_max`` and
    ``<field>_last``, and for ``flex_run`` events the FlexAttention calls they covered
    (``flex_calls``). ``every=0``: counters only when flushed (before ``summary`` / ``shutdown``
    / ``crash`` and on close).

    Dense calls (``flex_call`` with ``path: "dense"``) the same way with ``dense_first`` /
    ``dense_every``, per (layer, phase, call site, cause, action): a training loop that runs
    dense repeats one call thousands of times, and each full event cost the dense path a JSON
    line; their counter is ``dense_calls`` (level ``warning``) and carries the key's cause,
    action, call site. A blocked call (``action: "raise"``) is always written.

    ``keep_all=True`` keeps everything. Compile-time records and errors are never sampled.
    Thread-safe.
    """

    def __init__(
        self,
        first: int = DEFAULT_FUSED_FIRST,
        every: int = DEFAULT_FUSED_EVERY,
        keep_all: bool = False,
        aggregate: Tuple[str, ...] = ("alloc_delta", "peak_delta", "scores_bytes", "estimated_bytes", "predicted_bytes"),
        max_keys: int = 100_000,
        dense_first: int = DEFAULT_FUSED_FIRST,
        dense_every: int = DEFAULT_FUSED_EVERY,
    ) -> None:
        self.first = max(0, int(first))
        self.every = max(0, int(every))
        self.dense_first = max(1, int(dense_first))  # the first of a key is always written
        self.dense_every = max(0, int(dense_every))
        self.keep_all = bool(keep_all)
        self.aggregate = tuple(aggregate)
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._keys: Dict[tuple, _Window] = {}
        self.kept = 0
        self.dropped = 0
        self.counters = 0
        # True while some call is counted but not yet written; ``on_pending`` is called (outside
        # the lock) when that becomes true, so a flusher can sleep until there is work.
        self.pending = False
        self.on_pending: Optional[Callable[[], None]] = None

    def fresh(self) -> "Sampler":
        """The same settings, no calls counted (a forked child: the parent's are the parent's)."""
        new = Sampler(self.first, self.every, self.keep_all, self.aggregate, self.max_keys, self.dense_first, self.dense_every)
        new.on_pending = self.on_pending
        return new

    @staticmethod
    def applies(level: str, event: str, fields: dict) -> bool:
        path = fields.get("path")
        if path == "fused":
            return level == "info" and event not in NEVER_SAMPLED
        if event == "mask_build":  # eager mask builds: sampled like dense calls; a blocked one never
            return path == "dense" and fields.get("action") in ("log", "warn", "allow")
        return path == "dense" and event == "flex_call" and fields.get("action") in ("warn", "allow")

    def written_in_full(self, event: str, fields: dict) -> bool:
        """Would ``offer`` keep this event whole now? A peek (nothing counted), for work worth
        doing only for an event that is written: ``free_bytes`` asks the CUDA driver."""
        if self.keep_all:
            return True
        site = fields.get("call_site") or {}
        key = (
            fields.get("layer"),
            fields.get("phase"),
            event,
            fields.get("cause"),
            fields.get("action"),
            fields.get("traced"),
            site.get("file"),
            site.get("line"),
        )
        with self._lock:
            w = self._keys.get(key)
            return w is None or w.total < self.dense_first

    def offer(self, event: str, fields: dict) -> Any:
        """``"keep"``: write the event; ``None``: drop it; ``(event, fields)``: write that
        counter event instead."""
        if self.keep_all:
            return KEEP
        dense = fields.get("path") == "dense"
        key: tuple = (fields.get("layer"), fields.get("phase"), event)
        if dense:
            site = fields.get("call_site") or {}
            key += (fields.get("cause"), fields.get("action"), fields.get("traced"), site.get("file"), site.get("line"))
        first, every = (self.dense_first, self.dense_every) if dense else (self.first, self.every)
        with self._lock:
            w = self._keys.get(key)
            if w is None:
                other = len(self._keys) >= self.max_keys
                if other:
                    key = ("(other)", fields.get("phase"), event) + (("dense",) if dense else ())
                    w = self._keys.get(key)
                if w is None:
                    same = None
                    if dense:  # the overflow bucket mixes calls: it names no cause or site
                        same = {k: (None if other else fields.get(k)) for k in _DENSE_KEY_FIELDS}
                    w = self._keys[key] = _Window(same)
            w.total += 1
            if w.total <= first:
                self.kept += 1
                return KEEP
            w.window += 1
            n = fields.get("flex_calls")
            if isinstance(n, int) and not isinstance(n, bool):
                w.flex_calls += n
            for name in self.aggregate:
                if name not in fields:
                    continue
                value = fields[name]
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    slot = w.agg.get(name)
                    if slot is None:
                        w.agg[name] = [value, value]
                    else:
                        if value > slot[0]:
                            slot[0] = value
                        slot[1] = value
            if every and w.window >= every:
                self.counters += 1
                return self._counter(key, w)
            self.dropped += 1
            wake = not self.pending
            self.pending = True
        if wake and self.on_pending is not None:
            self.on_pending()
        return None

    def _counter(self, key: tuple, w: _Window) -> Tuple[str, Dict[str, Any]]:
        dense = w.same is not None
        out: Dict[str, Any] = {"layer": key[0], "phase": key[1], "path": "dense" if dense else "fused", "of": key[2]}
        if w.same is not None:
            out.update(w.same)
        out["count"], out["total"] = w.window, w.total
        if w.flex_calls:
            out["flex_calls"] = w.flex_calls
            w.flex_calls = 0
        for name, (mx, last) in w.agg.items():
            out[f"{name}_max"] = mx
            out[f"{name}_last"] = last
        w.window = 0
        w.agg = {}
        if key[2] == "mask_build":  # its own counter: report must not count mask builds as dense calls
            return "mask_builds", out
        return ("dense_calls" if dense else "fused_calls"), out

    def flush(self) -> List[Tuple[str, Dict[str, Any]]]:
        """Counter events for every key with calls not yet written."""
        with self._lock:
            self.pending = False
            out = [self._counter(k, w) for k, w in self._keys.items() if w.window]
            self.counters += len(out)
            return out
