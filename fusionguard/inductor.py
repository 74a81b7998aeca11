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
import weakref
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from . import torch_internals as ti
from ._state import STATE, count, internal_error
from .layers import (
    clean_name,
    flex_layer,
    in_backward,
    note_flex_call,
    resolve_watched_name,
    watched_name,
    watching,
)
from .torch_internals import compiled_graph_text

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
    from torch._inductor.virtualized import V

    from .dynamo_signals import is_torch_file

    node = getattr(V.graph, "current_node", None)
    trace = (getattr(node, "meta", None) or {}).get("stack_trace") or ""
    site = None
    for m in _STACK_LINE.finditer(trace):
        if not is_torch_file(m.group("file")):
            site = {"file": m.group("file"), "line": int(m.group("line")), "function": m.group("function")}
    if site is None:
        # torch.compile(flex_attention) compiled directly: the graph holds only torch frames, but
        # the compile runs inside the user's first call, so the live stack has their line.
        from .causes import user_call_site

        site = user_call_site(sys._getframe(1))
    return site


def _node_layer() -> Optional[str]:
    """The layer of the FlexAttention call being lowered: the watched module around the compile
    (``watch``) joined with the innermost module Dynamo recorded on the FX node."""
    from torch._inductor.virtualized import V

    outer = flex_layer() or ""  # (learning the layer class is record_compiled_graph's)
    inner = ""
    node = getattr(V.graph, "current_node", None)
    meta = getattr(node, "meta", None) or {}
    # backward nodes carry their forward node's stack (AOTAutograd copies it by seq_nr)
    stack = meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack") or {}
    if stack:
        last = list(stack.values())[-1]
        fqn = last[0] if isinstance(last, (tuple, list)) else str(last)
        inner = clean_name(_fqn_from_source(str(fqn)))
    name = ".".join(x for x in (outer, inner) if x)
    return name or None  # mapped to the watched model's spelling when the record is emitted


_SOURCE_PART = re.compile(r"\[(?:'([^']*)'|(\d+))\]|\.(\w+)")


def _fqn_from_source(text: str) -> str:
    """Dynamo spells module paths as sources (``L['self'].layers[0].attn``; on some releases, 2.9
    among them, ``L['self']._modules['layers']._modules['0']``) or as plain names."""
    if "[" not in text and not text.startswith("L"):
        return text
    text = text.replace("._modules[", "[")  # the same submodule, reached through the dict
    if text.startswith("L['"):  # the compiled frame's local holding the root module (self, mod, ...)
        text = text[text.index("]") + 1 :]
    elif text.startswith("G['"):
        return text
    parts = [a or b or c for a, b, c in _SOURCE_PART.findall(text)]
    return ".".join(p for p in parts if p)


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


def _stack_source(entry: Any) -> str:
    return str(entry[0] if isinstance(entry, (tuple, list)) else entry)


def dynamo_names() -> Optional[Tuple[List[str], Optional["_FrameLocal"], Any]]:
    """In a Dynamo compile: the module path of each FlexAttention call in the frame's FX graph
    (relative to the frame's root module, graph order), a finder for that module at run time,
    and the module now (or None where the calls are not under one module local)."""
    found = ti.dynamo_frame_graph()
    if found is None:
        return None
    import torch

    f_locals, code, graph = found
    hop = torch.ops.higher_order.flex_attention
    rels: List[str] = []
    roots = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not hop:
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        if stack:
            m = _ROOT_LOCAL.match(_stack_source(stack[0]))
            roots.add(m.group(1) if m else None)
        else:  # called by the frame's own module (a method of it): no module entered
            roots.add("self" if isinstance(f_locals.get("self"), torch.nn.Module) else None)
        rels.append(clean_name(_fqn_from_source(_stack_source(stack[-1]))) if stack else "")
    local = roots.pop() if len(roots) == 1 else None
    root = f_locals.get(local) if local else None
    if local is None or not isinstance(root, torch.nn.Module):
        return rels, None, None
    return rels, _FrameLocal((code.co_name,), code.co_filename, local), root


def join_names(prefix: Optional[str], rels: List[str], outer: str = "") -> List[Optional[str]]:
    """Full names of calls at ``rels``: under the watched module ``prefix`` ('' for a watched
    model), else (a frame rooted outside the watched models) joined to the hook layer around
    the compile and mapped to the watched spelling (``resolve_watched_name``)."""
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
    ``sys._getframe`` and one locals read; after 8 misses in a row it stops looking."""

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
        if self.misses >= 8:
            return None
        f = sys._getframe(1)
        d = 1
        while f is not None and d < 80:
            if self._match(f):
                self.depth, self.code, self.misses = d, f.f_code, 0
                return f.f_locals.get(self.local)
            f, d = f.f_back, d + 1
        self.misses += 1
        return None

    def _match(self, f: Any) -> bool:
        c = f.f_code
        return c.co_name in self.names and self.file in c.co_filename and self.local in c.co_varnames


class _WatchedSelf(_FrameLocal):
    """The nearest frame whose ``self`` is a watched module: for a graph compiled before
    ``enable()``, whose frame is unknown (found once per graph, then kept like any other)."""

    def __init__(self) -> None:
        super().__init__((), "", "self")

    def _match(self, f: Any) -> bool:
        return "self" in f.f_code.co_varnames and watched_name(f.f_locals.get("self")) is not None


def _aot_ctx() -> "_FrameLocal":
    """AOTAutograd's autograd ``ctx``: shared by a forward run and its backward."""
    return _FrameLocal(("forward", "backward", "_backward_impl", "_fwd_fn", "_bwd_fn", "call_compiled_backward"), ti.AOT_RUNTIME_DIR, "ctx")


_CTX_FIELD = "_fusionguard_layers"  # on AOTAutograd's ctx: the forward run's full names


def _ctx_names(ctx: Any, n: int, backward: bool) -> Optional[Tuple[Optional[str], ...]]:
    """The names a forward run left on ``ctx``, in the order of a backward graph's calls
    (reverse: gradients flow back through the calls last to first)."""
    names = getattr(ctx, _CTX_FIELD, None) if ctx is not None else None
    if not names or len(names) != n:
        return None
    return tuple(reversed(names)) if backward else tuple(names)


def make_lowering_wrapper(phase: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def fusionguard_flex_lowering(*args: Any, **kwargs: Any) -> Any:
        record: Dict[str, Any] = {"phase": phase, "template": None}
        previous = getattr(_TL, "current", None)
        _TL.current = record
        try:
            result = original(*args, **kwargs)
        finally:
            _TL.current = previous
        try:
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
        except Exception as exc:
            internal_error("inductor lowering record", exc)
        return result

    fusionguard_flex_lowering.__wrapped__ = original  # type: ignore[attr-defined]
    return fusionguard_flex_lowering


def make_selector_wrapper(template: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps an Inductor helper that picks a non-default template (CPU, decode, FLASH)."""

    def fusionguard_template_selector(*args: Any, **kwargs: Any) -> Any:
        record = getattr(_TL, "current", None)
        if record is not None and record.get("template") is None:
            record["template"] = template
        return original(*args, **kwargs)

    fusionguard_template_selector.__wrapped__ = original  # type: ignore[attr-defined]
    return fusionguard_template_selector


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
            from .dynamo_signals import is_torch_file

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
                "phase": "backward" if op.endswith("_backward") else "forward",
                "q_shape": q[1] if q else None,
                "kv_shape": k[1] if k else None,
                "dtype": q[0] if q else None,
                "device": q[2] if q else None,
                "source_site": last_site,
            }
        )
    return calls


def record_compiled_graph(compiled: Any, source: Optional[str] = None) -> Tuple[List[Dict[str, Any]], Optional["_Namer"]]:
    """Log a ``flex_compile`` record per FlexAttention call of a compiled graph; returns them and
    the graph's run-time namer. ``source``: "lowering" / "cache" (found out here) or
    "before_enable" (a graph found living in the process at ``enable()``)."""
    from .guard import scores_bytes

    found = source == "before_enable"
    text = compiled_graph_text(compiled)
    calls = _parse_graph(text) if "flex_attention" in text else []
    pending = _pending()
    records, pending[:] = list(pending), []
    by_phase: Dict[Optional[str], List[dict]] = {}
    for r in records:
        by_phase.setdefault(r["phase"], []).append(r)
    graph = getattr(compiled, "cache_key", None) or getattr(compiled, "_fx_graph_cache_key", None)
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
    if not calls and found and "flex_attention" in (getattr(compiled, "source_code", "") or ""):
        calls = [{"phase": "forward"}]  # (no graph text, no lowering seen: a count unknown, one at least)
    # The watched layer around the compile (hooks), if any: names a call nothing else names.
    around = flex_layer() if calls and not found else None
    from .causes import user_call_site

    live_site = user_call_site(sys._getframe(1)) if calls and not found else None  # compiles run inside the user's call
    names, named_from, namer = _compile_names(calls, source, around)
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


def log_compile_record(fields: Dict[str, Any]) -> None:
    count(f"fused_compile_{fields['phase']}")
    STATE.log.emit("info", "flex_compile", **fields)


def _compile_names(calls: List[Dict[str, Any]], source: Optional[str], around: Optional[str]) -> Tuple[Optional[List[Optional[str]]], Optional[str], Optional["_Namer"]]:
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
        return None, None, _Namer(phase, len(calls), [""] * len(calls), _WatchedSelf(), "")
    dyn = dynamo_names()
    outer = flex_layer() or ""
    if dyn is not None and len(dyn[0]) == len(calls):
        rels, finder, root = dyn
        if phase == "backward":
            rels = rels[::-1]
        prefix = watched_name(root) if root is not None else None
        return join_names(prefix, rels, outer), "nn_module_stack", _Namer(phase, len(calls), rels, finder, outer)
    namer = _Namer(phase, len(calls), None, None, around or "")
    if phase == "backward":
        names = _ctx_names(_aot_ctx().get(), len(calls), True)
        if names is not None:
            return list(names), "forward_run", namer
    return None, None, namer


class _Namer:
    """Names a compiled graph's calls at each run under ``watch()``; results built once per set of
    names (a run looks them up). Forward: the compile-time paths joined to the watched name of
    the module the frame runs for now (read from the running frame, ``_FrameLocal``); the names
    go on AOTAutograd's ``ctx`` for the backward. Backward: the names its forward left on the
    ``ctx``. A graph with one call and nothing better: the layer running now (hooks, backward
    span; ``_hook_names``)."""

    __slots__ = ("phase", "n", "rels", "root", "outer", "ctx", "built")

    def __init__(self, phase: str, n: int, rels: Optional[List[str]], root: Optional[_FrameLocal], outer: str) -> None:
        self.phase, self.n, self.rels, self.root, self.outer = phase, n, rels, root, outer
        self.ctx = _aot_ctx()
        self.built: Dict[Any, Any] = {}

    def names(self) -> Optional[Tuple[Optional[str], ...]]:
        if self.phase == "backward":
            return _ctx_names(self.ctx.get(), self.n, True)
        if self.rels is None or self.root is None:
            return None  # (a frame of no module: a function compiled, called from the layers)
        module = self.root.get()
        prefix = watched_name(module) if module is not None else None
        names = self.built.get(prefix)
        if names is None:
            names = self.built[prefix] = tuple(join_names(prefix, self.rels, self.outer))
        return names

    def run(self, fixed: Tuple[Optional[str], ...]) -> Tuple[Optional[str], ...]:
        """This run's names (``fixed``: the compile-time ones), left on the ctx for a backward."""
        names = self.names()
        if names is None or not any(names):
            names = _hook_names(fixed)
        self._to_backward(names)
        return names

    def _to_backward(self, names: Tuple[Optional[str], ...]) -> None:
        """A forward run leaves its names on AOTAutograd's ctx (none in an inference graph)."""
        if self.phase == "forward" and any(names):
            ctx = self.ctx.get()
            if ctx is not None:
                try:
                    setattr(ctx, _CTX_FIELD, names)
                except Exception:
                    pass


def _sidecar_path(graph: Optional[str]) -> Optional[str]:
    if not graph or not re.fullmatch(r"[\w-]+", str(graph)):
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layout
        from torch._inductor.runtime.runtime_utils import cache_dir
    return os.path.join(cache_dir(), "fusionguard", f"{graph}.json")


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
    source = getattr(compiled, "source_code", "") or ""
    if device == "cpu" or "cpp_fused" in source and "flex_attention" in source:
        return "cpp"
    if "cutedsl" in source.lower():
        return "flash"
    if "flex_decoding" in source:
        return "triton_decode"
    return "triton"


def _hook_names(fixed: Tuple[Optional[str], ...]) -> Tuple[Optional[str], ...]:
    """One compiled flex_attention often serves every layer (``torch.compile(flex_attention)``
    called from eager modules): its compile-time layer is the first caller's. For a graph with one
    FlexAttention call, the layer running it now (forward hooks, or the open backward span),
    unless the compile-time name is a more specific module inside it."""
    if len(fixed) != 1:
        return fixed
    now = flex_layer()
    known = fixed[0]
    if not now or known and known.startswith(now + "."):
        return fixed
    return (now,)


def _run_events(fields: Dict[str, Any], names: Tuple[Optional[str], ...]) -> Tuple[List[Dict[str, Any]], Tuple[Tuple[str, int], ...]]:
    """The ``flex_run`` events of a graph run whose calls have ``names``, and its per-layer counts
    (for ``summary()``): one event per layer, so that the log's per-(layer, phase) counters stay
    exact when one graph holds several layers' calls (``flex_calls`` of the layer, ``graph_calls``
    of the run); unnamed calls share one event with ``layer: null``."""
    counts: Dict[Optional[str], int] = {}
    for x in names:
        counts[x] = counts.get(x, 0) + 1
    if len(counts) == 1:
        ((x, k),) = counts.items()
        events = [{**fields, "layer": x, "layers": [x] if x else None}]
    else:
        events = [{**fields, "layer": x, "layers": [x] if x else None, "flex_calls": k, "graph_calls": len(names)} for x, k in counts.items()]
    return events, tuple((x, k) for x, k in counts.items() if x)


def count_runs(compiled: Any, records: List[Dict[str, Any]], namer: Optional[_Namer] = None) -> None:
    """Per-call evidence for a compiled graph holding fused FlexAttention: count its executions.

    The fused kernels run without any Python call into the operator, but every execution of the
    compiled graph goes through ``CompiledFxGraph.current_callable`` (also a CUDA-graph replay,
    which is started from there). Wrapping that one callable costs one Python call per graph
    execution, not per kernel, and never changes which launcher runs. Each execution logs a
    ``flex_run`` event (sampled like every fused per-call event: the first few per layer and
    phase, then counters) with the number of fused FlexAttention calls it made, named per run
    under ``watch()`` (``_Namer``). The wrapper goes in through the patch registry, so
    ``disable()`` puts the graph's own callable back."""
    fn = getattr(compiled, "current_callable", None)
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
            "cudagraphs": bool(getattr(compiled, "cudagraph_info", None)) or None,
        }
        for phase, rs in per_phase.items()
    ]

    # Built once: per run, only a counter, the naming of the run (under watch(); its events are
    # built once per set of names) and the (sampled) events remain on the fused path.
    runs: List[Tuple[str, int, Dict[str, Any], Tuple[Any, ...], Dict[Any, Any]]] = [(f"fused_runs_{s['phase']}", s["flex_calls"], s, tuple(r.get("layer") for r in per_phase[s["phase"]]), {}) for s in summaries]
    if len(runs) != 1:
        namer = None
    unlogged = [r["record"] for r in records if r.get("record", {}).get("source") == "before_enable"]

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if STATE.enabled:
            try:
                for key, n, fields, names, cache in runs:
                    count(key, n)
                    if namer is not None:
                        if watching():
                            names = namer.run(names)
                    elif n == 1:
                        names = _hook_names(names)
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
                        STATE.stats.on_fused(per_layer, fields["phase"])
                    for event in events:
                        STATE.log.emit_fields("info", "flex_run", event)
            except Exception as exc:
                internal_error("fused run count", exc)
        return out

    counted._fusionguard_records = summaries  # type: ignore[attr-defined]
    counted.__wrapped__ = fn  # type: ignore[attr-defined]
    if "current_callable" not in getattr(compiled, "__dict__", {}):  # (not reversible: not wrapped)
        return
    table = _GraphAttrs(compiled)
    # (keyed by the table, which the registry keeps alive: its id is never reused meanwhile)
    STATE.patches.apply(f"graph {id(table)}.current_callable", table, "current_callable", lambda _: counted)


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


def make_post_compile_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if STATE.enabled:
            try:
                count_runs(self, *record_compiled_graph(self))
            except Exception as exc:
                internal_error("inductor post_compile record", exc)
        return result

    post_compile.__wrapped__ = original  # type: ignore[attr-defined]
    return post_compile


UNSEEN_FIX = (
    "call fusionguard.enable() before the first torch.compile (or torch._dynamo.reset() after "
    "enable(): those frames then compile again, mostly from Inductor's caches, and every call is named)"
)


def live_flex_graphs() -> Tuple[List[Any], float]:
    """Compiled graphs holding FlexAttention that already live in the process (compiled before
    ``enable()``: by another instance of the model, a warm-up, a library on import), and the
    milliseconds the search took. Dynamo reuses them for any instance of the same class."""
    import time

    t0 = time.perf_counter()
    found = []
    for g in ti.found_compiled_graphs():
        fn = getattr(g, "current_callable", None)
        if getattr(fn, "_fusionguard_records", None) is not None:
            continue
        text = getattr(g, "inductor_post_grad_graph_str", None) or getattr(g, "runnable_graph_str", None) or getattr(g, "source_code", None) or ""
        if "flex_attention" in text:
            found.append(g)
    return found, (time.perf_counter() - t0) * 1e3


def _flex_call_count(g: Any) -> int:
    text = getattr(g, "inductor_post_grad_graph_str", None) or getattr(g, "runnable_graph_str", None) or ""
    return len(_FLEX_CALL.findall(text)) if text else 1


def unseen_graphs(graphs: List[Any]) -> int:
    """Of the graphs found at ``enable()``: those whose runs cannot be counted (no
    ``current_callable`` of their own) or whose calls cannot be named per layer (several)."""
    return sum(1 for g in graphs if "current_callable" not in getattr(g, "__dict__", {}) or _flex_call_count(g) != 1)


def adopt_live_graphs(graphs: List[Any], search_ms: float) -> Dict[str, Any]:
    """Record the graphs ``live_flex_graphs`` found (``source: "before_enable"``) and count their
    runs from now on. Their calls carry no module path (the FX graph that had it is gone): a
    graph with one call is named by the layer running it (hooks), others stay unnamed; those,
    and any whose runs cannot be counted, are the ``unseen`` ones."""
    counted = 0
    for g in graphs:
        emitted, namer = record_compiled_graph(g, source="before_enable")
        count_runs(g, emitted, namer)
        if getattr(getattr(g, "current_callable", None), "_fusionguard_records", None) is not None:
            counted += 1
    unseen = unseen_graphs(graphs)
    info: Dict[str, Any] = {"graphs": len(graphs), "counted": counted, "unseen_graphs": unseen, "search_ms": round(search_ms, 2)}
    if graphs:
        STATE.log.emit("warning" if unseen else "info", "compiled_before_enable", **info, fix=UNSEEN_FIX if unseen else None)
    return info
