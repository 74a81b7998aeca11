"""Compile-time records: which fused template Inductor gave each FlexAttention call.

Two choke points, because one is not enough:
- the Inductor *lowerings* of ``flex_attention`` / ``flex_attention_backward`` run when a graph is
  really compiled and tell us the template (CPU C++, Triton, Triton decode, FLASH);
- ``CompiledFxGraph.post_compile`` runs after every compile *and* after every cache hit (FX graph
  cache, AOTAutograd cache, in-process or from disk), where no lowering runs at all: the normal
  case for a user re-running a script. It reads the post-grad graph Inductor keeps with the
  compiled code to find the FlexAttention calls, their shapes and the user's source line.

Inductor has no run-time fallback to the dense kernels: a graph that compiled these calls runs
them fused. Nothing here runs per call.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import wrapt

from fusionguard import torch_internals as ti
from fusionguard.core.frames import is_torch_file, user_call_site
from fusionguard.core.state import STATE, guarded
from fusionguard.core.tensors import scores_bytes
from fusionguard.fused.runs import Namer, compile_names, count_runs, counted_before, fqn_from_source, log_compile_record
from fusionguard.torch_internals import compiled_graph_text
from fusionguard.watching.naming import clean_name, flex_layer, note_flex_call, resolve_watched_name

_TL = threading.local()

_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "f8e4m3fn": "float8_e4m3fn"}
_ANNOTATION = re.compile(r"(\w+): \"(\w+)\[([^\]]*)\]\[[^\]]*\]([\w]+(?::\d+)?)\"")
_FLEX_CALL = re.compile(r"= torch\.ops\.higher_order\.(flex_attention(?:_backward)?)\(([^)]*)")
_FILE_COMMENT = re.compile(r"# File: (.+?):(\d+) in ([^,]+)")


def _pending() -> List[dict]:
    pending = getattr(_TL, "pending", None)
    if pending is None:
        pending = _TL.pending = []
    return pending


def _buffer_class(result: Any) -> Optional[str]:
    node = result[0] if isinstance(result, (tuple, list)) and result else result
    for _ in range(6):
        name = type(node).__name__
        if "Buffer" in name or "Template" in name:
            return name
        nxt = getattr(node, "data", None)
        if nxt is None:
            break
        node = nxt
    return type(node).__name__ if node is not None else None


def _device_type(args: tuple) -> Optional[str]:
    try:
        return args[0].get_device().type
    except Exception:
        return None


_STACK_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


def _ir_tensor_fields(args: tuple) -> Dict[str, Any]:
    """Shapes, dtype and device of the lowered call's query and key, for releases whose compiled
    graph keeps no graph text to read them from (2.7): saved with the sidecar for cache hits."""

    def shape(node: Any) -> Optional[list]:
        try:
            return [int(d) if getattr(d, "is_number", True) else str(d) for d in node.get_size()]
        except Exception:
            return None

    dtype: Optional[str] = None
    device: Optional[str] = None
    try:
        dtype = str(args[0].get_dtype()).replace("torch.", "")
        device = str(args[0].get_device())
    except Exception:
        pass
    return {"q_shape": shape(args[0]), "kv_shape": shape(args[1]) if len(args) > 1 else None, "dtype": dtype, "device": device}


def _node_call_site() -> Optional[Dict[str, Any]]:
    """The user's line, from the stack trace Dynamo stored on the FX node being lowered."""
    node = ti.lowering_node()
    trace = (getattr(node, "meta", None) or {}).get("stack_trace") or ""
    site = None
    for m in _STACK_LINE.finditer(trace):
        if not is_torch_file(m.group("file")):
            site = {"file": m.group("file"), "line": int(m.group("line")), "function": m.group("function")}
    if site is None:
        # torch.compile(flex_attention) compiled directly: the graph holds only torch frames, but
        # the compile runs inside the user's first call, so the live stack has their line.
        site = user_call_site(sys._getframe(1))
    return site


def _node_layer() -> Optional[str]:
    """The layer of the FlexAttention call being lowered: the watched module around the compile
    (``watch``) joined with the innermost module Dynamo recorded on the FX node."""
    outer = flex_layer() or ""  # (learning the layer class is record_compiled_graph's)
    inner = ""
    node = ti.lowering_node()
    meta = getattr(node, "meta", None) or {}
    # backward nodes carry their forward node's stack (AOTAutograd copies it by seq_nr)
    stack = ti.module_stack(meta)
    if stack:
        last = list(stack.values())[-1]
        fqn = last[0] if isinstance(last, (tuple, list)) else str(last)
        inner = clean_name(fqn_from_source(str(fqn)))
    name = ".".join(x for x in (outer, inner) if x)
    return name or None  # mapped to the watched model's spelling when the record is emitted


def make_lowering_wrapper(phase: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def fusionguard_flex_lowering(*args: Any, **kwargs: Any) -> Any:
        record: Dict[str, Any] = {"phase": phase, "template": None}
        previous = getattr(_TL, "current", None)
        _TL.current = record
        try:
            result = original(*args, **kwargs)
        finally:
            _TL.current = previous
        with guarded("inductor lowering record"):
            ir = _buffer_class(result)
            device = _device_type(args)
            if record["template"] is None:
                if ir and "Cpp" in ir or device == "cpu":
                    record["template"] = "cpp"
                elif ir and "CuteDSL" in ir:
                    record["template"] = "flash"
                else:
                    record["template"] = "triton"
            record["ir"] = ir
            record["device_type"] = device
            record.update(_ir_tensor_fields(args))
            record["call_site"] = _node_call_site()
            record["layer"] = _node_layer()
            _pending().append(record)
        return result

    fusionguard_flex_lowering.__wrapped__ = original  # type: ignore[attr-defined]
    return fusionguard_flex_lowering


def make_selector_wrapper(template: str, original: Callable[..., Any]) -> wrapt.FunctionWrapper:
    """Wraps an Inductor helper that picks a non-default template (CPU, decode, FLASH)."""

    def fusionguard_template_selector(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
        record = getattr(_TL, "current", None)
        if record is not None and record.get("template") is None:
            record["template"] = template
        return wrapped(*args, **kwargs)

    return wrapt.FunctionWrapper(original, fusionguard_template_selector)


def _parse_graph(text: str) -> List[Dict[str, Any]]:
    """FlexAttention calls in an Inductor post-grad graph dump, with shapes and source lines."""
    tensors: Dict[str, tuple] = {}
    calls = []
    last_site: Optional[Dict[str, Any]] = None
    top = False
    for line in text.splitlines():
        # The outer module's forward is indented 4 spaces; nested subgraph modules (score_mod,
        # mask_mod) are classes at that level whose code, deeper, reuses names like arg0_1.
        if line.startswith("    def forward("):
            top = True
        elif line.startswith("    class "):
            top = False
        if not top:
            continue
        for m in _ANNOTATION.finditer(line):
            name, dtype, shape, device = m.groups()
            dims: List[Any] = []
            for d in shape.split(","):
                d = d.strip()
                if d:
                    dims.append(int(d) if d.lstrip("-").isdigit() else d)
            tensors.setdefault(name, (_DTYPES.get(dtype, dtype), dims, device))
        fm = _FILE_COMMENT.search(line)
        if fm:
            if not is_torch_file(fm.group(1)):
                last_site = {"file": fm.group(1), "line": int(fm.group(2)), "function": fm.group(3).strip()}
            continue
        cm = _FLEX_CALL.search(line)
        if not cm:
            continue
        op, arg_text = cm.groups()
        names = [a.strip() for a in arg_text.split(",")[:3]]
        q = tensors.get(names[0]) if names else None
        k = tensors.get(names[1]) if len(names) > 1 else None
        calls.append(
            {
                "phase": "backward" if op == "flex_attention_backward" else "forward",
                "q_shape": q[1] if q else None,
                "kv_shape": k[1] if k else None,
                "dtype": q[0] if q else None,
                "device": q[2] if q else None,
                "source_site": last_site,
            }
        )
    return calls


def record_compiled_graph(compiled: Any, source: Optional[str] = None) -> Tuple[List[Dict[str, Any]], Optional["Namer"]]:
    """Log a ``flex_compile`` record per FlexAttention call of a compiled graph; returns them and
    the graph's run-time namer. ``source``: "lowering" / "cache" (found out here) or
    "before_enable" (a graph found living in the process at ``enable()``)."""
    found = source == "before_enable"
    text = compiled_graph_text(compiled)
    calls = _parse_graph(text) if "flex_attention" in text else []
    pending = _pending()
    records, pending[:] = list(pending), []
    by_phase: Dict[Optional[str], List[dict]] = {}
    for r in records:
        by_phase.setdefault(r["phase"], []).append(r)
    graph = ti.graph_cache_key(compiled)
    if records:
        _save_sidecar(graph, records)
        source = "lowering"
    else:
        # what the lowering saw (template, call site), never its layer: that was the layer of
        # the run that filled the cache, not of this one
        records = [{k: v for k, v in r.items() if k != "layer"} for r in _load_sidecar(graph)]
        source = source or "cache"
        for r in records:
            by_phase.setdefault(r.get("phase"), []).append(r)
    if not calls and records:
        # no graph text kept (torch 2.7): what the lowerings saw, now or when the cached graph
        # was compiled (the sidecar), names the calls
        calls = [{k: r.get(k) for k in ("phase", "q_shape", "kv_shape", "dtype", "device")} for r in records]
    if not calls and found and "flex_attention" in ti.graph_source(compiled):
        calls = [{"phase": "forward"}]  # (no graph text, no lowering seen: a count unknown, one at least)
    # The watched layer around the compile (hooks), if any: names a call nothing else names.
    around = flex_layer() if calls and not found else None
    live_site = user_call_site(sys._getframe(1)) if calls and not found else None  # compiles run inside the user's call
    names, named_from, namer = compile_names(calls, source, around)
    emitted: List[Dict[str, Any]] = []
    for i, call in enumerate(calls):
        rec = by_phase.get(call["phase"], [])
        lowering = rec.pop(0) if rec else None
        template = lowering["template"] if lowering else _template_from_source(compiled, call.get("device"))
        site = (lowering or {}).get("call_site") or call.get("source_site") or live_site
        q_shape, kv_shape = call.get("q_shape"), call.get("kv_shape")
        try:
            size = scores_bytes(q_shape, kv_shape) if q_shape and all(isinstance(d, int) for d in q_shape + (kv_shape or [])) else None
        except Exception:
            size = None
        layer, how = (names[i], named_from) if names is not None else (None, None)
        if layer is None and lowering is not None and lowering.get("layer"):
            layer, how = resolve_watched_name(lowering["layer"]), "lowering"
        elif layer is None and around:
            layer, how = resolve_watched_name(around), "hooks"
        if len(calls) == 1 and around and layer == resolve_watched_name(around):
            note_flex_call()  # the hooked layer around made the call: an attention layer (measured)
        fields = dict(
            phase=call["phase"],
            path="fused",
            traced=True,
            cause=None,
            layer=layer,
            named_from=how if layer else None,
            template=template,
            source=source,
            graph=graph,
            q_shape=q_shape,
            kv_shape=kv_shape,
            dtype=call.get("dtype"),
            device=call.get("device"),
            scores_bytes=size,
            call_site=site,
        )
        emitted.append({"phase": call["phase"], "layer": layer, "template": template, "graph": graph, "record": fields})
        if source != "before_enable":  # (those are logged at their first run: a graph found may be garbage)
            log_compile_record(fields)
    return emitted, namer


def _sidecar_path(graph: Optional[str]) -> Optional[str]:
    if not graph or not re.fullmatch(r"[\w-]+", str(graph)):
        return None
    return os.path.join(ti.inductor_cache_dir(), "fusionguard", f"{graph}.json")


def _save_sidecar(graph: Optional[str], records: List[dict]) -> None:
    """Keep what the lowerings saw next to Inductor's cache, for processes that hit the cache."""
    path = _sidecar_path(graph)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            # (no layer: a cache hit is named by this run's compile, never by the filling run)
            keys = ("phase", "template", "ir", "call_site", "q_shape", "kv_shape", "dtype", "device")
            json.dump([{k: r.get(k) for k in keys} for r in records], fh)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache dir only costs us the template name on cache hits


def _load_sidecar(graph: Optional[str]) -> List[dict]:
    path = _sidecar_path(graph)
    if path is None or not os.path.exists(path):
        return []
    try:
        with open(path) as fh:
            data = json.load(fh)
        return [dict(r) for r in data if isinstance(r, dict)]
    except (OSError, ValueError):
        return []


def _template_from_source(compiled: Any, device: Optional[str]) -> str:
    source = ti.graph_source(compiled)
    if device == "cpu" or "cpp_fused" in source and "flex_attention" in source:
        return "cpp"
    if "cutedsl" in source.lower():
        return "flash"
    if "flex_decoding" in source:
        return "triton_decode"
    return "triton"


def make_post_compile_wrapper(original: Callable[..., Any]) -> wrapt.FunctionWrapper:
    def post_compile(wrapped: Callable[..., Any], graph: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        if STATE.enabled:
            with guarded("inductor post_compile record"):
                count_runs(graph, *record_compiled_graph(graph))
        return result

    return wrapt.FunctionWrapper(original, post_compile)


UNSEEN_FIX = (
    "call fusionguard.enable() before the first torch.compile (or torch._dynamo.reset() after "
    "enable(): those frames then compile again, mostly from Inductor's caches, and every call is named)"
)


def live_flex_graphs() -> Tuple[List[Any], float]:
    """Compiled graphs holding FlexAttention that already live in the process (compiled before
    ``enable()``: by another instance of the model, a warm-up, a library on import), and the
    milliseconds the search took. Dynamo reuses them for any instance of the same class. A graph
    an earlier ``enable()`` of this process counted is one whatever its text (torch 2.7 keeps no
    graph text, and its CPU template's code never names flex_attention: a second session saw none)."""

    t0 = time.perf_counter()
    found = []
    for g in ti.found_compiled_graphs():
        if getattr(ti.graph_callable(g), "_fusionguard_records", None) is not None:
            continue
        if counted_before(g) is not None or "flex_attention" in ti.compiled_graph_text(g, source=True):
            found.append(g)
    return found, (time.perf_counter() - t0) * 1e3


def _flex_call_count(g: Any) -> int:
    text = ti.compiled_graph_text(g)
    return len(_FLEX_CALL.findall(text)) if text else 1


def unseen_graphs(graphs: List[Any]) -> int:
    """Of the graphs found at ``enable()``: those whose runs cannot be counted (no
    ``current_callable`` of their own) or whose calls cannot be named per layer (several)."""
    return sum(1 for g in graphs if not ti.graph_callable_is_own(g) or (_flex_call_count(g) != 1 and counted_before(g) is None))


def adopt_live_graphs(graphs: List[Any], search_ms: float) -> Dict[str, Any]:
    """Record the graphs ``live_flex_graphs`` found (``source: "before_enable"``) and count their
    runs from now on. Their calls carry no module path (the FX graph that had it is gone): a
    graph with one call is named by the layer running it (hooks), others stay unnamed; those,
    and any whose runs cannot be counted, are the ``unseen`` ones. A graph an earlier
    ``enable()`` counted keeps the names it had (``counted_before``)."""
    counted = 0
    for g in graphs:
        kept = counted_before(g)  # (counted by an earlier enable(): its names kept)
        emitted, namer = kept if kept is not None else record_compiled_graph(g, source="before_enable")
        count_runs(g, emitted, namer)
        if getattr(ti.graph_callable(g), "_fusionguard_records", None) is not None:
            counted += 1
    unseen = unseen_graphs(graphs)
    info: Dict[str, Any] = {"graphs": len(graphs), "counted": counted, "unseen_graphs": unseen, "search_ms": round(search_ms, 2)}
    if graphs:
        STATE.log.emit("warning" if unseen else "info", "compiled_before_enable", **info, fix=UNSEEN_FIX if unseen else None)
    return info
