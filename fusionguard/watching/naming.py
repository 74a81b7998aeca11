"""Which watched layer a FlexAttention call belongs to: the watched modules by identity
(``STATE.watch``), their names as the user spells them, the layer stack of running forwards
and the backward spans open on this thread."""

from __future__ import annotations

import contextvars
import inspect
import re
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import wrapt

from fusionguard import torch_internals as ti
from fusionguard.core.state import STATE, guarded

# The stack of (qualified name, module class) of the watched modules whose forward is running.
LAYER: contextvars.ContextVar[Tuple[Tuple[str, Optional[type]], ...]] = contextvars.ContextVar("fusionguard_layer", default=())


def clean_name(name: str) -> str:
    """``_orig_mod.layers.0`` -> ``layers.0``: names as the user's own model spells them."""
    return ti.ORIG_MOD_PART.sub("", name).lstrip(".")


def resolve_watched_name(name: str) -> str:
    """Dynamo names modules relative to the frame it compiled (``layers.0.attn`` when a graph
    break made it compile the inner model); map that to the watched model's own spelling
    (``model.layers.0.attn``) when exactly one watched name ends with it, or, for a wrapper
    compiled around the watched model, when a tail of it is a watched name."""
    watched = STATE.watch.names
    if not watched or name in watched:
        return name
    matches = [n for n in watched if n.endswith("." + name)]
    if len(matches) == 1:
        return matches[0]
    # the other way round: a wrapper compiled around the watched model adds a prefix
    # (DistributedDataParallel's ``module.layers.0`` when ``model`` itself is watched); only
    # wrappers' own attribute names are stripped, never a real submodule's (``vision.``)
    parts = name.split(".")
    i = 0
    while i < len(parts) - 1 and parts[i] in _WRAPPER_ATTRS:
        i += 1
        tail = ".".join(parts[i:])
        if tail in watched:
            return tail
    return name


_SOURCE_PART = re.compile(r"\[(?:'([^']*)'|(\d+))\]|\.(\w+)")


def fqn_from_source(text: str) -> str:
    """Dynamo spells module paths as sources (``L['self'].layers[0].attn``; on some releases, 2.9
    among them, ``L['self']._modules['layers']._modules['0']``) or as plain names."""
    if "[" not in text and not text.startswith("L"):
        return text
    # the same submodule, reached through the dict (``._modules[``), or through the instance's own
    # ``__dict__`` (``.__dict__['_modules'][``: a bound method compiled on its own, Lightning's compiled module)
    text = text.replace(f".__dict__['{ti.MODULES}'][", "[").replace(f'.__dict__["{ti.MODULES}"][', "[")
    text = text.replace(f".{ti.MODULES}[", "[")
    if text.startswith("L['"):  # the compiled frame's local holding the root module (self, mod, ...)
        text = text[text.index("]") + 1 :]
    elif text.startswith("G['"):
        return text
    parts = [a or b or c for a, b, c in _SOURCE_PART.findall(text)]
    return ".".join(p for p in parts if p)


def stack_source(entry: Any) -> str:
    """One entry of an FX node's module stack: its source (``(source, class)`` on most releases)."""
    return str(entry[0] if isinstance(entry, (tuple, list)) else entry)


_FLEX_CALL_LINE = re.compile(r"^\s*(\w+) = torch\.ops\.higher_order\.flex_attention(?:_backward)?\(")


def _graph_lines(gm: Any) -> Dict[int, str]:
    """Line of ``gm``'s generated code -> the module path (relative to the compiled frame's root)
    of the FlexAttention call on that line ("" when its node has no module stack); once per graph."""
    table = STATE.caches.graph_lines
    code = type(gm).forward.__code__
    lines = table.get(code)
    if lines is None:
        nodes = {n.name: n for n in gm.graph.nodes}
        lines = {}
        for i, text in enumerate(gm.code.splitlines(), start=1):
            m = _FLEX_CALL_LINE.match(text)
            node = nodes.get(m.group(1)) if m else None
            if node is not None:
                stack = list(ti.module_stack(node.meta).values())
                lines[i] = clean_name(fqn_from_source(stack_source(stack[-1]))) if stack else ""
        if len(table) > 256:
            table.clear()
        table[code] = lines  # (keyed by the code object itself, kept alive: never a reused id)
    return lines


def graph_layer(frame: Any) -> Optional[str]:
    """The watched layer of a dense call made by a compiled graph that runs its operators eagerly
    (``backend="aot_eager"``, a custom backend running AOTAutograd's graph): named from the FX
    node that made it, by its module stack, as the fused path names its calls (Dynamo's path
    relative to the compiled frame, spelled as the watched model spells it). None when no such
    graph is running, or the name is not one of a watched module."""
    if not STATE.watch.names:
        return None
    found = ti.running_graph(frame)
    if found is None:
        return None
    rel = _graph_lines(found[0]).get(found[1])
    if not rel:
        return None
    name = resolve_watched_name(rel)
    return name if name in STATE.watch.names else None


# attributes through which wrappers hold the wrapped module: DDP, torch.compile, FSDP1,
# activation checkpointing
_WRAPPER_ATTRS = ti.WRAPPER_ATTRS


def wrapper_chain(top: torch.nn.Module) -> List[torch.nn.Module]:
    """``top`` and the modules its wrappers wrap, outermost first: the one rule for unwrapping a
    model (``watcher.unwrap`` for a session's model, the names without ``watch()``): a module whose
    only child sits under a wrapper's attribute (``_WRAPPER_ATTRS``: DataParallel / DDP / FSDP1's
    ``module``, torch.compile's ``_orig_mod``, activation checkpointing's) wraps it; the last is the
    model the user wrote, whose ``named_modules()`` the names follow."""
    chain = [top]
    for _ in range(8):
        children = list(top.__dict__.get(ti.MODULES, {}).items())
        if len(children) != 1 or children[0][0] not in _WRAPPER_ATTRS or children[0][1] is None:
            break
        top = children[0][1]
        chain.append(top)
    return chain


def flex_layer(frame: Any = None) -> Optional[str]:
    """The layer a FlexAttention call made now belongs to: the innermost watched module whose
    forward is running, or in a backward (no forward hooks run there) the innermost open
    backward span; given the caller's ``frame`` (the dense and rescue paths), else the watched
    module whose forward is on the stack (``layer_from_stack``)."""
    stack = LAYER.get()
    name = stack[-1][0] if stack else None
    return name or (backward_layer() if in_backward() else None) or (layer_from_stack(frame) if frame is not None else None)


def counting_layer() -> Optional[str]:
    """The running watched layer whose hooks count its calls (``summary()``'s ``calls``): an
    attention layer, its class known to make FlexAttention calls, or in a backward the innermost
    open backward span (only such layers open one). Not any hooked module on the stack: a
    container's or a projection's hooks count nothing."""
    stack = LAYER.get()
    if not stack:
        return backward_layer() if in_backward() else None
    classes = STATE.stats.flex_classes
    for name, cls in reversed(stack):
        if cls is not None and cls in classes:
            return name
    return None


def note_flex_call(frame: Any = None) -> Optional[str]:
    """``flex_layer()``, and remember that the innermost watched module's class makes
    FlexAttention calls (it becomes an attention layer: measured, with backward spans). Called
    for a dense run and for a compiled graph with one FlexAttention call (a graph of several
    layers' calls was compiled around a container)."""
    stack = LAYER.get()
    if stack:
        cls = stack[-1][1]
        classes = STATE.stats.flex_classes
        if cls is not None and cls not in classes:
            classes.add(cls)
    return flex_layer(frame)


# The user's modules under an active watch(), by identity: STATE.watch (core.tables.WatchRegistry).


def make_wrapper_init(original: Callable[..., None]) -> wrapt.FunctionWrapper:
    """``OptimizedModule.__init__``, also noting the modules it wraps.

    Why: users often compile ``model`` and hand ``watch()`` the same ``model``. Hooks on modules
    that run inside the compiled graph never run there, yet Dynamo traces them (a warm compile
    x1.3-1.5 for an 8-layer stack on an H200) and guards on them. Known as compiled, they are
    treated as under ``watch(compiled)``: no hooks (unless named in ``layers=``); fused calls
    named from compile records, dense ones by their forward frame (``layer_from_stack``). Only
    while the wrapper lives; ``torch.compiler.disable(module)`` (the same class) is not a
    compile."""

    def __init__(wrapped: Callable[..., None], self: Any, args: tuple, kwargs: dict) -> None:
        wrapped(*args, **kwargs)
        with guarded("torch.compile wrapper note"):
            inner = ti.wrapped_module(self)
            if isinstance(inner, torch.nn.Module):
                ref = weakref.ref(self)
                inside = STATE.watch.compiled_inside
                for m in inner.modules():
                    inside[m] = ref

    return wrapt.FunctionWrapper(original, __init__)


def compiled_inside(module: torch.nn.Module) -> bool:
    try:
        ref = STATE.watch.compiled_inside.get(module)
    except TypeError:  # unhashable module class
        return False
    return ref is not None and ref() is not None


def _forward_code(module: torch.nn.Module) -> Any:
    """The code object of the module's own forward, under decorators (``functools.wraps``
    chains: ``torch.compiler.disable``, Hugging Face's keyword-argument shims)."""
    try:
        fn = inspect.unwrap(type(module).forward)
        return getattr(fn, "__code__", None)
    except Exception:
        return None


def under(raw_name: str, prefixes: List[str]) -> bool:
    return any(not p or raw_name == p or raw_name.startswith(p + ".") for p in prefixes)


def watched_name(module: Any) -> Optional[str]:
    """The watched name of ``module`` (``''`` for a watched model itself), None if not watched.
    Names a compiled frame's ``self`` (``compiled.dynamo_names``): its graph names modules relative to it."""
    key = id(module)
    w = STATE.watch
    entry = w.modules.get(key)
    if entry is not None and entry[0]() is module:
        return entry[1]
    root = w.roots.get(key)
    if root is not None and root[0]() is module:
        return ""
    return None


def builtin_module(module: Any) -> bool:
    """torch.nn's own modules (Linear, norms, containers): never named by identity under ``watch()``."""
    mod = type(module).__module__ or ""
    return mod.startswith(("torch.nn.", "torch.ao.")) and mod != "torch.nn.utils.parametrize"


def outside_watched(module: Any) -> bool:
    """A compiled frame's root module known to lie outside every watched model: a module of the
    user's own class, not watched by identity (every such module inside a watched model is), and
    no wrapper around one (DDP's ``module``, ``_orig_mod``). Its graph's paths may spell the
    watched names (a compiled teacher, EMA or reference copy of the same architecture); they
    are not the watched model's."""
    if not isinstance(module, torch.nn.Module) or builtin_module(module) or watched_name(module) is not None:
        return False
    return not any(watched_name(m) is not None for m in wrapper_chain(module)[1:])


def is_watching() -> bool:
    w = STATE.watch
    return bool(w.modules or w.roots)


def name_module(module: torch.nn.Module, name: str) -> Optional[int]:
    """Known by identity under watch() (a root, named '', is not a layer: kept in STATE.watch.roots)."""
    key = id(module)
    w = STATE.watch
    if not name:
        with w.lock:
            root = w.roots.get(key)
            count = root[1] + 1 if root is not None and root[0]() is module else 1
            w.roots[key] = (weakref.ref(module), count)
        return -key - 1  # (negative: a root's key, see unname_modules)
    with w.lock:
        entry = w.modules.get(key)
        if entry is not None and entry[0]() is module:
            w.modules[key] = entry[:2] + (entry[2] + 1, entry[3])  # the first watch()'s name
        else:
            code = _forward_code(module)
            w.modules[key] = (weakref.ref(module), name, 1, code)
            if code is not None:
                w.forward_codes[id(code)] = w.forward_codes.get(id(code), 0) + 1
                site = (code.co_filename, code.co_firstlineno)
                w.forward_sites[site] = w.forward_sites.get(site, 0) + 1
    return key


def decrement(table: Dict[Any, int], key: Any) -> None:
    left = table.get(key, 1) - 1
    if left <= 0:
        table.pop(key, None)
    else:
        table[key] = left


def unname_modules(keys: List[int]) -> None:
    w = STATE.watch
    with w.lock:
        for key in keys:
            if key < 0:
                root = w.roots.get(-key - 1)
                if root is not None and root[1] > 1:
                    w.roots[-key - 1] = (root[0], root[1] - 1)
                else:
                    w.roots.pop(-key - 1, None)
                continue
            entry = w.modules.get(key)
            if entry is None:
                continue
            if entry[2] > 1:
                w.modules[key] = entry[:2] + (entry[2] - 1, entry[3])
                continue
            del w.modules[key]
            code = entry[3]
            if code is not None:
                decrement(w.forward_codes, id(code))
                decrement(w.forward_sites, (code.co_filename, code.co_firstlineno))


def layer_from_stack(frame: Any, limit: int = 200) -> Optional[str]:
    """The watched module whose forward (innermost) is on the stack of a dense call that no
    hook named: inside a ``torch.compile``d module, hooks never run (Dynamo traced them, or
    there are none), yet a graph break, a ``torch.compiler.disable``d forward or the recompile
    limit runs the module's forward eagerly, densely, and that is the call users need named.
    Only on the dense path. Locals are read only from frames running a watched class's own
    forward, and only the innermost such frame (before Python 3.13 reading them leaves a
    snapshot on the frame until it returns: the attention forward's own, whose tensors are
    alive anyway)."""
    if not STATE.watch.modules:
        return None
    f = frame
    while f is not None and limit > 0:
        limit -= 1
        found = watched_forward(f)
        if found is not None:
            classes = STATE.stats.flex_classes
            if type(found[1]) not in classes:
                classes.add(type(found[1]))
            return found[0]
        f = f.f_back
    return None


def watched_forward(f: Any) -> Optional[Tuple[str, Any]]:
    """(watched name, module) when the frame ``f`` runs a watched layer's own ``forward`` (never a
    model's: a model is not a layer), else None. Tested by its code first (a watched forward's
    code object, or its file and first line: Dynamo runs a rewritten copy), so locals are read
    only from a frame running a watched class's forward: ``layer_from_stack`` and the fused
    path's finder of the watched forward that called a compiled function (``fused.runs``)."""
    w = STATE.watch
    c = f.f_code
    if id(c) in w.forward_codes or (c.co_filename, c.co_firstlineno) in w.forward_sites:
        obj = f.f_locals.get("self")
        entry = w.modules.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1], obj
    return None


# Backward spans open on this thread (the autograd engine runs a device's backward on one
# thread, hooks and kernels alike): names the layer of a backward that carries no forward
# context, e.g. the AOTAutograd backward of a compiled flex_attention.
_BW_OPEN = threading.local()
_graph_task_id = ti.graph_task_id()


def _graph_task() -> int:
    try:
        return _graph_task_id()
    except Exception:
        return -1


def backward_layer() -> Optional[str]:
    """The innermost backward span open in *this* backward pass (spans of a backward that raised,
    or whose inputs' gradients were never asked for, never end: they belong to another pass)."""
    spans = getattr(_BW_OPEN, "spans", None)
    if not spans:
        return None
    task = _graph_task()
    for name, span_task in reversed(spans):
        if span_task == task:
            return name
    return None


def bw_push(name: str) -> None:
    spans = getattr(_BW_OPEN, "spans", None)
    if spans is None:
        spans = _BW_OPEN.spans = []
    task = _graph_task()
    if len(spans) >= 64:  # drop spans left open by earlier backward passes
        spans[:] = [s for s in spans if s[1] == task]
    spans.append((name, task))


def bw_pop(name: str) -> None:
    spans = getattr(_BW_OPEN, "spans", None) or []
    task = _graph_task()
    for i in range(len(spans) - 1, -1, -1):
        if spans[i] == (name, task):
            del spans[i]
            return
    for i in range(len(spans) - 1, -1, -1):
        if spans[i][0] == name:
            del spans[i]
            return


def in_backward() -> bool:
    return _graph_task() != -1
