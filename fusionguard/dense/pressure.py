"""Recompile pressure: a frame holding FlexAttention that Dynamo keeps recompiling, said before
the recompile limit makes Dynamo run it eagerly (dense FlexAttention for the rest of the job).

Work happens only when Dynamo compiles, never when a graph runs:
- Dynamo's FlexAttention tracing method (``torch_internals.flex_trace_method``), which runs each
  time Dynamo puts a FlexAttention call into a graph, counts the compiles of the frame being
  compiled in Dynamo's own cache entries and reads Dynamo's guard-failure reasons
  (``torch._dynamo.utils.guard_failures``), which Dynamo records whatever its logging is set to
  (``set_logs(dynamo=logging.ERROR)`` silences the log records, not these).
From ``recompile_warn_at`` compiles on, once the frame churns: one ``recompile_pressure`` event
per frame and one warning at the user's line, with what varies and its fix. Churn is what goes on
to the limit: one guard failing again and again with new values (a length, a closed-over value,
a scalar; ``dynamo_signals.churning``). A few distinct modes are not (grad mode, dispatch keys,
the training flag, one partial batch: the standard train / eval / inference loop compiles 4
times and then never again, #32).

The same tracing method also notes the graph breaks Dynamo records while it traces the call
(``SIGNALS.flex_traced``): the evidence of a dense call inlined from that frame, never another's.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types
from typing import Any, Callable, Dict, Optional, Tuple

import wrapt

from fusionguard import torch_internals as ti
from fusionguard.core.config import Runtime, RuntimeRef
from fusionguard.core.frames import defer_warning, first_user_frame, frame_site, warn_at_user_line, warning_at
from fusionguard.core.state import STATE, guarded, internal_error
from fusionguard.dense.dynamo_signals import SIGNALS, break_counts, churning, latest_reasons, reason_fix, reason_varies
from fusionguard.errors import DenseFallbackWarning
from fusionguard.eventlog.kinds import FIXES


def threshold(limit: Optional[int], option: Optional[int]) -> Optional[int]:
    """The compile count that warns: ``option`` (None: half the limit, rounded up), at least 2
    (a first compile is no recompile) and always below the limit; None when there is nothing
    to warn before (limit 1 or 2, or ``option`` 0)."""
    if option == 0 or not isinstance(limit, int) or limit < 1:
        return None
    n = option if option is not None else -(-limit // 2)
    n = min(max(n, 2), limit - 1)
    return n if n >= 2 else None


def make_trace_wrapper(runtime: RuntimeRef, original: Callable[..., Any]) -> wrapt.FunctionWrapper:
    """Dynamo's FlexAttention tracing method, also counting the compiles of the frame being
    compiled (``runtime``: ``STATE.runtime``, read once per trace). Decided while Dynamo
    traces: its cache entries then hold the earlier compiles and its guard failures the
    reasons of this one (no compile-end callback, which ``torch._dynamo.reset()`` clears)."""

    def traced(wrapped: Callable[..., Any], _variable: Any, args: tuple, kwargs: dict) -> Any:
        before = _break_counts()
        try:
            out = wrapped(*args, **kwargs)
        finally:  # (also when Dynamo cannot capture the call: the break of this frame's call)
            if before is not None:
                _flex_traced(before)
        rt = runtime.now
        if rt.enabled:
            try:  # (per call: a plain try costs nothing when nothing raises; a with does)
                found = ti.compiling_frame()
                if found is not None:
                    check(rt, found[1], found[0])
            except Warning:  # (a backstop: check() defers its own warning) never into Dynamo's trace
                pass
            except Exception as exc:
                internal_error("recompile pressure", exc)
        return out

    return wrapt.FunctionWrapper(original, traced)


@guarded("graph breaks before a FlexAttention trace")
def _break_counts() -> Optional[Dict[str, int]]:
    return break_counts() if STATE.enabled else None


def _flex_traced(before: Dict[str, int]) -> None:
    """Dynamo's graph breaks while it traced this FlexAttention call, kept for its frame: the
    evidence a dense call inlined from this frame names (``dense/guard.py``)."""
    with guarded("graph breaks of a FlexAttention trace"):
        found = ti.compiling_frame()
        if found is not None:
            SIGNALS.flex_traced(found[1], before)


def compiles_of(code: Any, f_locals: Any = None) -> Tuple[int, int]:
    """(how many times Dynamo compiled ``code`` for these locals, this compile included; how many
    cache entries it had before this compile). Counted as Dynamo's recompile limit counts them:
    entries made for other objects (e.g. other layers sharing one ``forward``) are not
    recompiles. The entry of the compile now running is added when it ends (counted either way)."""
    entries = ti.cache_entries(code)
    current = ti.current_compile_id()
    mine = [e for e in entries if current is not None and ti.entry_compile_id(e) == current]
    before = [e for e in entries if not any(e is m for m in mine)]
    same = ti.same_object_entries(before, f_locals) if f_locals is not None else None
    return (len(before) if same is None else same) + 1, len(before)


def check(rt: Runtime, code: Any, f_locals: Any = None) -> None:
    """Count this compile of ``code`` (a frame holding FlexAttention); warn at the threshold
    (``rt.recompile_warn_at``)."""
    limit = ti.recompile_limit_value()
    table = STATE.stats.pressure
    key = id(code)
    record = table.get(key)
    if record is None or record["code"] is not code:
        if len(table) > 10_000:
            table.clear()
        record = table[key] = {"code": code, "warned": False}
    compiles, entries_before = compiles_of(code, f_locals)
    if compiles < record.get("compiles", 0):
        record["warned"] = False  # fewer than before: Dynamo's caches were reset, the count starts over
    record["compiles"], record["limit"] = compiles, limit  # (the limit: read by causes at a dense call)
    warn_at = threshold(limit, rt.recompile_warn_at)
    if warn_at is None or compiles < warn_at or record["warned"]:
        return
    if churning(ti.guard_failures(code), ti.id_matched_names(ti.cache_entries(code))) is None:
        return  # a few modes (grad mode, eval, one partial batch), not churn: a later compile may tell
    record["warned"] = True
    reasons = latest_reasons(code, entries_before)
    reason = reasons[0] if reasons else None
    target = user_frame(sys._getframe(1))
    fields: Dict[str, Any] = {
        "function": code.co_name,
        "file": code.co_filename,
        "line": code.co_firstlineno,
        "compiles": compiles,
        "limit": limit,
        "limit_type": ti.recompile_limit_option(),
        "warn_at": warn_at,
        "reason": reason,
        "reasons": reasons,
        "varies": reason_varies(reason),
        "fix": reason_fix(reason, FIXES["recompile_limit"]),
        "call_site": frame_site(target) if target is not None else None,
    }
    STATE.log.emit("warning", "recompile_pressure", **fields)
    try:
        warn_at_user_line(message(fields), target, DenseFallbackWarning)
    except Warning:
        # The user's filters made it an error (pytest's ``filterwarnings = error``): raised here it
        # would reach Dynamo, which gives up the frame (eager: dense). Issued again at the first run
        # of this compile's graph instead (fused/runs.py), where the filter raises it at their call.
        defer_warning(ti.current_compile_id(), warning_at(message(fields), target, DenseFallbackWarning))


_STDLIB = sysconfig.get_paths().get("stdlib", "\0") + os.sep


def user_frame(f: Optional[types.FrameType]) -> Optional[types.FrameType]:
    """The user's frame around Dynamo's compile (the line that called the compiled function):
    the first one outside torch, fusionguard and the standard library (Dynamo's own frames
    pass through ``contextlib``)."""
    first = f = first_user_frame(f)
    while f is not None and _in_stdlib(f.f_code.co_filename):
        f = first_user_frame(f.f_back)
    return f or first


def _in_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "-packages" + os.sep not in filename


def message(fields: Dict[str, Any]) -> str:
    what = f" ({fields['varies']})" if fields.get("varies") else ""
    because = f" Dynamo's reason: {fields['reason']}." if fields.get("reason") else ""
    return (
        f"fusionguard: recompile pressure: {fields['function']} ({fields['file']}:{fields['line']}) holds "
        f"FlexAttention and was compiled {fields['compiles']} of {fields['limit']} times{what}. At "
        f"the recompile limit Dynamo runs it eagerly and FlexAttention falls back to the dense path "
        f"(it materialises the full score matrix).{because} Fix: {fields['fix']}."
    )
