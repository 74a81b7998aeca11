"""Why did a FlexAttention call run densely? Decided from the dense call's own stack.

Cheap by construction: only dense calls get here (each one costs tens of milliseconds of GPU time
anyway), and the work is one walk up the Python stack plus dictionary look-ups in what Dynamo
already said (``dynamo_signals``). Nothing is re-traced or compiled.

The stack tells the story because Dynamo leaves a mark on every frame it runs compiled code in:
``torch._dynamo.utils.orig_code_map`` maps each transformed code object back to the user's.
- innermost compiled frame is PyTorch's own ``_flex_attention_hop_wrapper`` -> the public
  ``flex_attention`` ran eagerly and PyTorch compiled the operator with ``backend="eager"``:
  *not* traced by the user's ``torch.compile``;
- innermost compiled frame is anything else -> the call sits in a graph of the user's compile;
  a dense kernel at run time then means the backend does not fuse (Inductor has no dense fallback).
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, cast

from fusionguard import torch_internals as ti
from fusionguard.core.frames import first_user_frame, is_torch_file, is_user_file
from fusionguard.core.state import STATE
from fusionguard.dense.dynamo_signals import SIGNALS, clean_reason, is_public_flex
from fusionguard.eventlog.kinds import FIXES


@dataclass
class Diagnosis:
    traced: bool
    cause: str
    evidence: Dict[str, Any] = field(default_factory=dict)
    #: the user's frame that made the call, when the stack walk got that far (saves a second walk)
    site: Optional[types.FrameType] = field(default=None, repr=False, compare=False)

    @property
    def fix(self) -> str:
        return FIXES.get(self.cause, FIXES["unknown"])


_WRAPPER_NAME = ti.FLEX_HOP_WRAPPER


def _orig_code_lookup() -> Callable[[types.CodeType], Optional[types.CodeType]]:
    """Dynamo's transformed code -> original code map, as a lookup function: one C-level dict
    look-up by ``id`` when the map is the ``ExactWeakKeyDictionary`` it has been since torch
    2.0 (hashing a code object walks its bytecode and constants), else the map's own ``get``."""
    orig_code_map = ti.orig_code_map()
    if orig_code_map is None:
        return lambda code: None
    by_id = getattr(orig_code_map, "values", None)
    if isinstance(by_id, dict):
        get = by_id.get
        return lambda code: get(id(code))
    return orig_code_map.get


def _seen_by_dynamo(code: types.CodeType) -> bool:
    """Has Dynamo looked at this code since its last reset? (Stale signals do not count.)"""
    ids = ti.dynamo_seen_code_ids()
    return id(code) in ids if ids is not None else True


def _frame_where(frame: types.FrameType) -> str:
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


def _backend_name(frame: types.FrameType, orig: types.CodeType) -> Optional[str]:
    entry = frame.f_back
    while entry is not None and _kind_entry(entry.f_code)[1] != _COMPILE_ENTRY:
        entry = entry.f_back
    try:
        return ti.backend_name(ti.compiled_code_backend(frame.f_code, orig, entry))
    except Exception:
        return None


_EAGER_STANCES = ("force_eager", "eager_on_recompile", "eager_then_compile")


def _global_disable() -> Optional[Dict[str, Any]]:
    try:
        if ti.dynamo_disabled():
            env = os.environ.get("TORCHDYNAMO_DISABLE")
            return {"switch": "TORCHDYNAMO_DISABLE=1" if env == "1" else "torch._dynamo.config.disable"}
        stance = ti.compiler_stance()
        if stance in _EAGER_STANCES:
            return {"switch": f"torch.compiler.set_stance({stance!r})"}
    except Exception:
        pass
    return None


def _cache_entry_count(code: types.CodeType) -> int:
    try:
        return len(ti.cache_entries(code))
    except Exception:
        return 0


def _last_reason(code: types.CodeType) -> Optional[str]:
    """Dynamo's newest guard-failure reason for ``code`` (recorded whatever its logs say)."""
    try:
        failures = ti.guard_failures(code)
        return clean_reason(failures[-1]) if failures else None
    except Exception:
        return None


def _compiled_limit(code: types.CodeType) -> Optional[int]:
    """The recompile limit in force when a frame holding FlexAttention last compiled (``pressure``)."""
    record = STATE.stats.pressure.get(id(code))
    return record.get("limit") if record is not None and record.get("code") is code else None


def _recompile_limit_value() -> Optional[int]:
    try:
        return ti.recompile_limit_value()
    except Exception:
        return None


_OTHER, _TORCH_WRAPPER, _COMPILE_ENTRY, _DISABLE_WRAPPER, _CANDIDATE, _COMPILED = range(6)
# What each code object on a dense call's stack is, worked out once (STATE.caches.code_kinds):
# the stack walk is on the dense path, ahead of the kernel, and its string tests dominated the
# guard's cost.
# Keyed by id(): hashing a code object (or comparing two) walks its bytecode and constants, about
# 0.6 us a frame; the code object is kept in the value, so an id is never reused while cached.
# Dynamo registers the code it generates in orig_code_map before that code first runs, so a code
# object found running outside the map is never in it later: _COMPILED is decided once too.


def _code_kind(code: types.CodeType) -> Tuple[types.CodeType, int, Optional[types.CodeType], bool]:
    """(code, kind, original code of a Dynamo-generated one, is the user's code)."""
    user = is_user_file(code.co_filename)
    orig = _orig_code_lookup()(code)
    if orig is not None:
        kind = _COMPILED
    elif code.co_name == _WRAPPER_NAME and is_torch_file(code.co_filename):
        kind = _TORCH_WRAPPER
    elif ti.is_compile_entry(code):
        kind = _COMPILE_ENTRY
    elif ti.is_disable_wrapper(code):
        kind = _DISABLE_WRAPPER
    elif user or (is_public_flex(code.co_name, code.co_filename) and not code.co_filename.startswith("<")):
        # PyTorch's public flex_attention is a candidate too: torch.compile(flex_attention)
        # compiles that very frame, and it is the one that hits the recompile limit.
        kind = _CANDIDATE
    else:
        kind = _OTHER
    kinds = STATE.caches.code_kinds
    if len(kinds) > 50_000:
        kinds.clear()
    entry = kinds[id(code)] = (code, kind, orig, user)
    return entry


def _kind_entry(code: types.CodeType) -> Tuple[types.CodeType, int, Optional[types.CodeType], bool]:
    entry = STATE.caches.code_kinds.get(id(code))
    if entry is None or entry[0] is not code:
        entry = _code_kind(code)
    return entry


def diagnose_forward(frame: Optional[types.FrameType]) -> Diagnosis:
    """Walk outward from the dense kernel's caller and explain the call."""
    internal: Optional[str] = None  # "compiled" | "plain" when PyTorch's eager wrapper is seen
    disabled_fn: Optional[str] = None
    disabled_in_compile = False
    user_frames: list = []
    depth_of_entries: list = []
    depth = 0
    site: Optional[types.FrameType] = None
    kinds = STATE.caches.code_kinds
    f = frame
    while f is not None:
        depth += 1
        code = f.f_code
        # _kind_entry, inlined: this loop runs for every frame of every dense forward
        entry = kinds.get(id(code))
        if entry is None or entry[0] is not code:
            entry = _code_kind(code)
        kind = entry[1]
        if kind == _OTHER:  # most frames (PyTorch's and libraries' own; never the user's)
            f = f.f_back
            continue
        if site is None and entry[3]:
            site = f
        if kind == _COMPILED:
            orig = cast(types.CodeType, entry[2])  # (the original code of a _COMPILED frame: always set)
            if orig.co_name == _WRAPPER_NAME:
                internal = "compiled"
            elif disabled_fn is not None:
                disabled_in_compile = True  # a compiled region called a torch.compiler.disable'd function
                break
            elif internal is None:
                # Inside a graph of the user's compile: dense at run time = non-fusing backend.
                backend = _backend_name(f, orig)
                ev: Dict[str, Any] = {"compiled_frame": _frame_where(f), "backend": backend}
                if is_torch_file(orig.co_filename):
                    # Dynamo compiled PyTorch's flex_attention as a frame of its own: the user's
                    # frame around it broke the graph or was skipped.
                    outer = first_user_frame(f.f_back)
                    if outer is not None:
                        _, info = SIGNALS.lookup(outer.f_code.co_filename, outer.f_code.co_firstlineno)
                        ev["outer_frame"] = _frame_where(outer)
                        if info:
                            ev["outer_frame_failure"] = info
                return Diagnosis(True, "non_inductor_backend", ev, site)
            else:
                # PyTorch's eager wrapper ran inside a frame the user compiled: the call itself
                # was left out of the graph.
                cause, info = SIGNALS.lookup(orig.co_filename, orig.co_firstlineno)
                return Diagnosis(False, "graph_break", {"compiled_frame": _frame_where(f), "dynamo": info}, site)
        else:
            if kind == _TORCH_WRAPPER:
                internal = internal or "plain"
            elif kind == _COMPILE_ENTRY:
                depth_of_entries.append(depth)
                if disabled_fn is not None:
                    disabled_in_compile = True
            elif kind == _DISABLE_WRAPPER:
                fn = f.f_locals.get("fn")
                fn_code = getattr(fn, "__code__", None)
                if fn_code is not None and disabled_fn is None and is_user_file(fn_code.co_filename):
                    disabled_fn = f"{getattr(fn, '__qualname__', fn_code.co_name)} ({fn_code.co_filename}:{fn_code.co_firstlineno})"
            elif kind == _CANDIDATE:
                user_frames.append((f, depth))
        f = f.f_back
    # A user frame can only have slid to eager because of Dynamo if it runs under a
    # torch.compile entry (a wrapper frame further out) and Dynamo saw its code since its reset.
    outermost_entry = max(depth_of_entries) if depth_of_entries else 0
    live = [uf for uf, d in user_frames if d < outermost_entry and _seen_by_dynamo(uf.f_code)]

    if internal == "plain":
        if ti.debug_flag_on():
            return Diagnosis(False, "debug_flag", {"flag": "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG=True"}, site)
    switch = _global_disable()
    if switch is not None:
        return Diagnosis(False, "compiler_disabled", switch, site)
    if disabled_fn is not None and disabled_in_compile:
        return Diagnosis(False, "compiler_disabled", {"switch": "torch.compiler.disable", "function": disabled_fn}, site)
    if live:
        try:
            SIGNALS.refresh()  # a recompile-limit hit Dynamo recorded but did not log (logs silenced)
        except Exception:
            pass
    for uf in live:
        code = uf.f_code
        cause, info = SIGNALS.lookup(code.co_filename, code.co_firstlineno)
        if cause is not None:
            return Diagnosis(False, cause, dict(info or {}, frame=_frame_where(uf)), site)
    limit = _recompile_limit_value() if live else None
    for uf in live:
        code = uf.f_code
        n = _cache_entry_count(code)
        # the limit its compiles ran under (PyTorch's own flex compile raises the limit around
        # the eager call), else the current one
        lim = _compiled_limit(code) or limit
        if lim and n >= lim:
            reason = _last_reason(code)
            info = {
                "function": code.co_name,
                "file": code.co_filename,
                "line": code.co_firstlineno,
                "limit": lim,
                "reason": reason,
                "source": "cache_entries",
            }
            try:
                SIGNALS.note_limit(info)  # the recompile_limit event, once per frame, if Dynamo's log was not heard
            except Exception:
                pass
            return Diagnosis(
                False,
                "recompile_limit",
                {"frame": _frame_where(uf), "cache_entries": n, "limit": lim, "reason": reason},
                site,
            )
    if internal == "compiled":
        return Diagnosis(False, "eager_call", {"how": "public flex_attention called eagerly"}, site)
    if internal is None:
        return Diagnosis(False, "eager_call", {"how": "flex_attention operator called directly"}, site)
    # PyTorch's wrapper ran uncompiled, and no compile of the user's is live around the call: still
    # an eager call. (Dynamo runs that wrapper's code plainly once a compile of it failed, e.g.
    # after a score_mod that breaks the graph, until torch._dynamo.reset(); seen on 2.6 to 2.8.)
    return Diagnosis(
        False,
        "eager_call",
        {"how": "public flex_attention called eagerly", "internal_compile": "skipped by Dynamo"},
        site,
    )


def diagnose_backward(origin: Optional[Dict[str, Any]], frame: Optional[types.FrameType]) -> Diagnosis:
    """A dense backward inherits its forward's verdict; otherwise the stack says where it came from."""
    if origin:
        return Diagnosis(bool(origin.get("traced")), origin.get("cause") or "unknown", dict(origin.get("evidence") or {}))
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if ti.AOT_RUNTIME_DIR in fn:
            return Diagnosis(True, "non_inductor_backend", {"how": "backward graph compiled by AOTAutograd without Inductor"})
        f = f.f_back
    return Diagnosis(False, "eager_call", {"how": "flex_attention_backward operator called directly"})
