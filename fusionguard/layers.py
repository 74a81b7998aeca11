"""Layer attribution and per-layer memory: ``fusionguard.watch(model)``.

Why this design:
- The current layer lives in a ``ContextVar`` (a tuple of qualified names): threads and asyncio
  tasks each see their own, there is no global stack to corrupt. Forward pre-/post-hooks push and
  pop it; post-hooks use ``always_call=True`` so a layer that raises still pops.
- A backward carries its forward's layer on the autograd ``ctx`` (see ``guard``), so interleaved
  and checkpointed backward get the right name; a forward that runs *inside* a backward (activation
  checkpointing recompute) is flagged ``recompute`` and not counted as a new forward call.
- Memory comes from the CUDA caching allocator's own counters. A layer's *peak* can only be read
  by resetting the peak counter when the layer starts (``torch.cuda.reset_peak_memory_stats``);
  nested layers fold their peaks into the enclosing ones, and ``fusionguard.peak_memory_allocated()``
  keeps the true process peak, since ``torch.cuda.max_memory_allocated()`` then only reports the
  peak since the last watched layer (announced once, see README). ``watch(model, memory=False)``
  never touches the counters.
- Only *attention layers* are measured: modules whose class has been seen making a FlexAttention
  call (or the classes / names passed as ``layers=``). Everything else costs one ContextVar set.
- Modules inside a ``torch.compile``d module get no hooks (Dynamo would trace them and recompile);
  their fused calls are attributed at compile time from the FX node's ``nn_module_stack``, dense
  ones by the module whose forward is on the stack (``layer_from_stack``). Hooks Dynamo does
  trace (fusionguard could not know) are the same function objects at every watch() entry, so
  re-entering does not recompile (see ``_Hooks``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import re
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ._state import STATE, internal_error

# The stack of (qualified name, module class) of the watched modules whose forward is running.
_LAYER: contextvars.ContextVar[Tuple[Tuple[str, Optional[type]], ...]] = contextvars.ContextVar("fusionguard_layer", default=())
_OPEN: contextvars.ContextVar[Tuple["_Measure", ...]] = contextvars.ContextVar("fusionguard_open_measures", default=())
_is_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)
_ORIG_MOD = re.compile(r"(^|\.)_orig_mod(?=\.|$)")


def clean_name(name: str) -> str:
    """``_orig_mod.layers.0`` -> ``layers.0``: names as the user's own model spells them."""
    return _ORIG_MOD.sub("", name).lstrip(".")


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


# attributes through which wrappers hold the wrapped module: DDP, torch.compile, FSDP1,
# activation checkpointing
_WRAPPER_ATTRS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def flex_layer(frame: Any = None) -> Optional[str]:
    """The layer a FlexAttention call made now belongs to: the innermost watched module whose
    forward is running, or in a backward (no forward hooks run there) the innermost open
    backward span; given the caller's ``frame`` (the dense and rescue paths), else the watched
    module whose forward is on the stack (``layer_from_stack``)."""
    stack = _LAYER.get()
    name = stack[-1][0] if stack else None
    return (
        name
        or (backward_layer() if in_backward() else None)
        or (layer_from_stack(frame) if frame is not None else None)
    )


def note_flex_call(frame: Any = None) -> Optional[str]:
    """``flex_layer()``, and remember that the innermost watched module's class makes
    FlexAttention calls (it becomes an attention layer: measured, with backward spans). Called
    for a dense run and for a compiled graph with one FlexAttention call (a graph of several
    layers' calls was compiled around a container)."""
    stack = _LAYER.get()
    if stack:
        cls = stack[-1][1]
        classes = STATE.stats.flex_classes
        if cls is not None and cls not in classes:
            classes.add(cls)
    return flex_layer(frame)


# The user's modules under an active watch(), by identity: STATE.watch (_tables.WatchRegistry).


def make_wrapper_init(original: Callable[..., None]) -> Callable[..., None]:
    """``OptimizedModule.__init__``, also noting the modules it wraps.

    Why: users often compile ``model`` and hand ``watch()`` the same ``model``. Hooks on modules
    that run inside the compiled graph never run there, yet Dynamo traces them (a warm compile
    x1.3-1.5 for an 8-layer stack on an H200) and guards on them. Known as compiled, they are
    treated as under ``watch(compiled)``: no hooks (unless named in ``layers=``); fused calls
    named from compile records, dense ones by their forward frame (``layer_from_stack``). Only
    while the wrapper lives; ``torch.compiler.disable(module)`` (the same class) is not a
    compile."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            if type(self.__dict__.get("dynamo_ctx")).__name__ == "DisableContext":
                return
            inner = self.__dict__.get("_orig_mod") or self.__dict__.get("_modules", {}).get("_orig_mod")
            if isinstance(inner, torch.nn.Module):
                ref = weakref.ref(self)
                inside = STATE.watch.compiled_inside
                for m in inner.modules():
                    inside[m] = ref
        except Exception as exc:
            internal_error("torch.compile wrapper note", exc)

    return __init__


def _compiled_inside(module: torch.nn.Module) -> bool:
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


def _under(raw_name: str, prefixes: List[str]) -> bool:
    return any(not p or raw_name == p or raw_name.startswith(p + ".") for p in prefixes)


def watched_name(module: Any) -> Optional[str]:
    """The watched name of ``module`` (``''`` for a watched model itself), None if not watched.
    Names a compiled frame's ``self`` (``inductor.dynamo_names``): its graph names modules relative to it."""
    key = id(module)
    w = STATE.watch
    entry = w.modules.get(key)
    if entry is not None and entry[0]() is module:
        return entry[1]
    root = w.roots.get(key)
    if root is not None and root[0]() is module:
        return ""
    return None


def watching() -> bool:
    w = STATE.watch
    return bool(w.modules or w.roots)


def _name_module(module: torch.nn.Module, name: str) -> Optional[int]:
    """Known by identity under watch() (a root, named '', is not a layer: kept in STATE.watch.roots)."""
    key = id(module)
    w = STATE.watch
    if not name:
        with w.lock:
            root = w.roots.get(key)
            count = root[1] + 1 if root is not None and root[0]() is module else 1
            w.roots[key] = (weakref.ref(module), count)
        return -key - 1  # (negative: a root's key, see _unname_modules)
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


def _decrement(table: Dict[Any, int], key: Any) -> None:
    left = table.get(key, 1) - 1
    if left <= 0:
        table.pop(key, None)
    else:
        table[key] = left


def _unname_modules(keys: List[int]) -> None:
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
                _decrement(w.forward_codes, id(code))
                _decrement(w.forward_sites, (code.co_filename, code.co_firstlineno))


def layer_from_stack(frame: Any, limit: int = 200) -> Optional[str]:
    """The watched module whose forward (innermost) is on the stack of a dense call that no
    hook named: inside a ``torch.compile``d module, hooks never run (Dynamo traced them, or
    there are none), yet a graph break, a ``torch.compiler.disable``d forward or the recompile
    limit runs the module's forward eagerly, densely, and that is the call users need named.
    Only on the dense path. Locals are read only from frames running a watched class's own
    forward, and only the innermost such frame (before Python 3.13 reading them leaves a
    snapshot on the frame until it returns: the attention forward's own, whose tensors are
    alive anyway)."""
    w = STATE.watch
    modules = w.modules
    if not modules:
        return None
    codes, sites = w.forward_codes, w.forward_sites
    f = frame
    while f is not None and limit > 0:
        limit -= 1
        c = f.f_code
        if id(c) in codes or (c.co_filename, c.co_firstlineno) in sites:
            obj = f.f_locals.get("self")
            entry = modules.get(id(obj))
            if entry is not None and entry[0]() is obj:
                classes = STATE.stats.flex_classes
                if type(obj) not in classes:
                    classes.add(type(obj))
                return entry[1]
        f = f.f_back
    return None


# Backward spans open on this thread (the autograd engine runs a device's backward on one
# thread, hooks and kernels alike): names the layer of a backward that carries no forward
# context, e.g. the AOTAutograd backward of a compiled flex_attention.
_BW_OPEN = threading.local()


def _graph_task() -> int:
    try:
        return torch._C._current_graph_task_id()
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


def _bw_push(name: str) -> None:
    spans = getattr(_BW_OPEN, "spans", None)
    if spans is None:
        spans = _BW_OPEN.spans = []
    task = _graph_task()
    if len(spans) >= 64:  # drop spans left open by earlier backward passes
        spans[:] = [s for s in spans if s[1] == task]
    spans.append((name, task))


def _bw_pop(name: str) -> None:
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


def _span_inputs(args: Any, kwargs: Any) -> List[torch.Tensor]:
    """The tensors a layer's backward span ends on: its positional inputs, else the
    ``hidden_states`` keyword (Hugging Face), else every keyword tensor. Keyword tensors shared by
    all layers (``encoder_hidden_states``, a T5 ``position_bias``) would keep every earlier
    layer's span open until the last layer's backward."""
    found = _tensors(args)
    if found:
        return found
    if isinstance(kwargs, dict) and kwargs.get("hidden_states") is not None:
        found = _tensors(kwargs["hidden_states"])
        if found:
            return found
    return _tensors(kwargs)


def in_backward() -> bool:
    return _graph_task() != -1


# -- memory --------------------------------------------------------------------------------------


_ORDER = itertools.count()


class _Measure:
    __slots__ = ("device", "alloc", "peak", "order")

    def __init__(self, device: int, alloc: int) -> None:
        self.device, self.alloc, self.peak = device, alloc, alloc
        self.order = next(_ORDER)


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _fold(device: int, peak: int, opened_before: Optional[int] = None) -> None:
    """Raise the peaks of the open measures by ``peak``. When a measure stops, only those opened
    before it enclose it: backward spans of consecutive layers overlap by a hook's width, and a
    later-opened one must not inherit its predecessor's peak."""
    for m in _OPEN.get():
        if m.device == device and peak > m.peak and (opened_before is None or m.order < opened_before):
            m.peak = peak
    if peak > STATE.stats.peak.get(device, 0):
        STATE.stats.peak[device] = peak


def _cuda_device(obj: Any) -> Optional[int]:
    """The CUDA device of the first tensor in obj (or of a module's first parameter)."""
    if isinstance(obj, torch.nn.Module):
        for p in obj.parameters(recurse=True):
            return p.device.index if p.device.type == "cuda" else None
        return None
    for t in _tensors(obj):
        return (t.device.index if t.device.index is not None else torch.cuda.current_device()) if t.is_cuda else None
    return None


def measure_start(where: Any = None) -> Optional[_Measure]:
    """Start measuring on the CUDA device of ``where`` (tensors or a module); None on CPU."""
    if not _cuda_ready():
        return None
    if isinstance(where, int):
        device: Optional[int] = where
    else:
        device = _cuda_device(where) if where is not None else torch.cuda.current_device()
    if device is None:
        return None
    _fold(device, torch.cuda.max_memory_allocated(device))
    if not STATE.stats.warned_reset:
        STATE.stats.warned_reset = True
        warnings.warn(
            "fusionguard.watch resets torch.cuda peak memory stats around each attention layer to "
            "measure per-layer peaks: torch.cuda.max_memory_allocated() now reports the peak since "
            "the last watched layer; use fusionguard.peak_memory_allocated() for the run's peak, or "
            "watch(model, memory=False)",
            RuntimeWarning,
            stacklevel=4,
        )
    torch.cuda.reset_peak_memory_stats(device)
    m = _Measure(device, torch.cuda.memory_allocated(device))
    _OPEN.set(_OPEN.get() + (m,))
    return m


def measure_stop(m: Optional[_Measure]) -> Tuple[Optional[int], Optional[int]]:
    if m is None:
        return None, None
    stack = _OPEN.get()
    if stack and stack[-1] is m:
        _OPEN.set(stack[:-1])
    else:
        _OPEN.set(tuple(x for x in stack if x is not m))
    peak = torch.cuda.max_memory_allocated(m.device)
    if peak > m.peak:
        m.peak = peak
    _fold(m.device, m.peak, opened_before=m.order)
    return torch.cuda.memory_allocated(m.device) - m.alloc, m.peak - m.alloc


def peak_memory_allocated(device: Union[int, torch.device, None] = None) -> int:
    """The true peak of allocated CUDA memory, also across the resets ``watch`` makes."""
    if not torch.cuda.is_available():
        return 0
    idx = torch.cuda.current_device() if device is None else torch.device("cuda", device).index if isinstance(device, int) else device.index
    idx = idx if idx is not None else torch.cuda.current_device()
    return max(STATE.stats.peak.get(idx, 0), torch.cuda.max_memory_allocated(idx))


def _record(layer: str, phase: str, alloc: Optional[int], peak: Optional[int], recompute: bool = False, dense_before: int = -1) -> None:
    with STATE.stats.lock:
        row = STATE.stats.row(layer, phase)
        # dense if a dense kernel of this layer and phase ran during the span
        path = "dense" if dense_before >= 0 and row.dense + row.dense_recompute > dense_before else "fused"
        if recompute:
            row.recompute += 1
        else:
            row.calls += 1
        if alloc is not None and peak is not None:
            row.measured += 1
            row.alloc_delta_last, row.peak_delta_last = alloc, peak
            row.alloc_delta_max = alloc if row.alloc_delta_max is None else max(row.alloc_delta_max, alloc)
            row.peak_delta_max = peak if row.peak_delta_max is None else max(row.peak_delta_max, peak)
    if alloc is not None:
        STATE.log.emit(
            "info", "layer_memory", layer=layer, phase=phase, path=path, alloc_delta=alloc, peak_delta=peak, recompute=recompute
        )


# -- hooks ---------------------------------------------------------------------------------------


def _tensors(obj: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            out.extend(_tensors(x))
    elif isinstance(obj, dict):
        for x in obj.values():
            out.extend(_tensors(x))
    elif hasattr(obj, "to_tuple") and callable(obj.to_tuple):  # Hugging Face ModelOutput
        out.extend(_tensors(obj.to_tuple()))
    return out


class _Frame:
    __slots__ = ("owner", "name", "token", "measure", "recompute", "grad_inputs", "dense_before")
    owner: "Watch"
    name: str
    token: Any
    measure: Optional[_Measure]
    recompute: bool
    grad_inputs: Optional[List[torch.Tensor]]
    dense_before: int


class _Hooks:
    """watch()'s pre/post hook pair on one module: two function objects made once per module
    (and per nesting level), registered when a watch() of the module starts and removed when it
    ends; they forward to ``owner``, the Watch now entered.

    Why the same objects every time: Dynamo guards on the hooks of a module it compiles (when
    fusionguard cannot know the module runs inside a graph). New hook functions at every entry
    recompiled the model at every step, until the recompile limit sent it to eager, dense
    FlexAttention; the same functions re-registered pass the guards: at most one graph with
    the hooks and one without. Nothing stays on the module after watch() exits (pickling and
    ``torch.jit.script`` after it are unaffected; a copy made *during* watch() carries the hooks,
    which never count it as the watched module).
    """

    __slots__ = ("owner", "name", "compiled", "handles", "home", "pre", "post", "__weakref__")

    def __init__(self) -> None:
        self.owner: Optional["Watch"] = None
        self.name = ""
        self.compiled = False
        self.handles: List[Tuple[Any, Tuple[Any, ...]]] = []  # (pre, post): (handle, _marks)
        self.home: Callable[[], Any] = lambda: None  # the module's pre-hook dict, weakly
        slot = self  # the hooks hold the slot, never the module (the module holds the hooks)
        traced = _at_trace_time(lambda: _hooks_traced(slot))

        def pre_hook(mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if _is_dynamo_compiling():
                traced()
                return
            owner = slot.owner
            # (a deepcopy of the model made during watch() carries these hooks in dicts of its
            # own: not the watched module, never counted as it)
            if owner is not None and mod.__dict__.get("_forward_pre_hooks") is slot.home():
                owner._pre(slot, mod, args, kwargs)

        def post_hook(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if _is_dynamo_compiling():
                return
            stack = _stack(mod)
            if stack:
                frame = stack.pop()
                frame.owner._post(frame, mod, args, kwargs, output)

        self.pre: Callable[..., Any] = pre_hook
        self.post: Callable[..., Any] = post_hook

    @classmethod
    def attach(cls, module: torch.nn.Module, owner: "Watch", name: str, compiled: bool) -> "_Hooks":
        pairs = STATE.watch.pairs
        with STATE.watch.lock:
            try:
                pool = pairs.get(module)
                if pool is None:
                    pool = pairs[module] = []
            except TypeError:  # a module class that made itself unhashable: a pair of its own
                pool = []
            slot = next((x for x in pool if x.owner is None), None)
            if slot is None:
                slot = cls()
                pool.append(slot)
            slot.owner, slot.name, slot.compiled = owner, name, compiled
            try:
                slot._register(module)
            except BaseException:
                slot.detach()
                raise
            return slot

    def _register(self, module: torch.nn.Module) -> None:
        fns = (self.pre, self.post)
        if self.handles and all(_reinsert(h, fn, marks) for fn, (h, marks) in zip(fns, self.handles)):
            return
        for h, _ in self.handles:  # (a partial re-insert)
            h.remove()
        # with_kwargs: Hugging Face layers take their tensors as keyword arguments
        pre = module.register_forward_pre_hook(self.pre, with_kwargs=True)
        self.handles = [(pre, _marks(pre))]
        self.home = pre.hooks_dict_ref
        post = module.register_forward_hook(self.post, with_kwargs=True, always_call=True)
        self.handles.append((post, _marks(post)))

    def detach(self) -> None:
        with STATE.watch.lock:
            self.owner = None
            for h, _ in self.handles:
                h.remove()  # the handles stay, to put the same hooks back under the same ids


def _marks(handle: Any) -> Tuple[Any, ...]:
    """What registering put in the handle's extra dicts (with_kwargs, always_call) under its id."""
    try:
        return tuple((ref, ref()[handle.id]) for ref in handle.extra_dict_ref if handle.id in (ref() or {}))
    except Exception:
        return ()


def _reinsert(handle: Any, fn: Callable[..., Any], marks: Tuple[Any, ...]) -> bool:
    """Put a removed hook back under its old id, as registering put it (the hook in the
    handle's dict, the same values in its extra dicts). Why: Dynamo guards on the ids of
    always-called hooks, so a new registration (a new id) at each watch() entry recompiled
    every step. False where the handle does not look like that (another torch): the caller
    registers anew."""
    try:
        hooks = handle.hooks_dict_ref()
        if hooks is None or not marks or any(ref() is None for ref, _ in marks):
            return False
        hooks[handle.id] = fn
        for ref, value in marks:
            ref()[handle.id] = value
        return True
    except Exception:
        return False


def _dense_count(layer: str, phase: str) -> int:
    row = STATE.stats.rows.get((layer, phase))
    return 0 if row is None else row.dense + row.dense_recompute


def _builtin(module: torch.nn.Module) -> bool:
    mod = type(module).__module__ or ""
    return mod.startswith(("torch.nn.", "torch.ao.")) and mod != "torch.nn.utils.parametrize"


class Watch:
    """``with fusionguard.watch(model): ...`` or ``@fusionguard.watch(model)``."""

    def __init__(self, *models: torch.nn.Module, memory: bool = True, layers: Iterable[Union[type, str]] = ()) -> None:
        if not models:
            raise TypeError("fusionguard.watch() needs at least one torch.nn.Module")
        for m in models:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"fusionguard.watch() takes nn.Module objects, got {type(m).__name__}")
        self.models = models
        self.memory = memory
        self.layer_types = tuple(x for x in layers if isinstance(x, type))
        self.layer_names = {x for x in layers if isinstance(x, str)}
        self._slots: List["_Hooks"] = []
        self._names: List[str] = []
        self._ids: List[int] = []
        self._bw_handles: Dict[object, List[Any]] = {}  # backward spans still waiting to end
        self._depth = 0
        self._lock = threading.Lock()

    # context manager / decorator
    def __enter__(self) -> "Watch":
        with self._lock:
            if self._depth == 0:
                try:
                    self._install()
                except Exception:
                    self._remove()
                    raise
            self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._remove()

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper

    # hooks
    def _is_layer(self, module: torch.nn.Module, name: str) -> bool:
        return (
            type(module) in STATE.stats.flex_classes
            or (self.layer_types and isinstance(module, self.layer_types))
            or name in self.layer_names
        )

    def _install(self) -> None:
        watched = STATE.watch.names
        for model in self.models:
            # Modules that get no hooks: those inside a torch.compile wrapper (Dynamo's names,
            # known to us by identity only), and those a wrapper holds or compiled in place
            # (watch(model) beside compiled = torch.compile(model); module.compile(), torchtitan's
            # per-block compile), whose names stay watched: records of a wrapper compiled around
            # them map to them. Either kind is named by identity for a dense call it runs
            # eagerly (layer_from_stack).
            wrapped: List[str] = []  # prefixes inside torch.compile wrappers
            held: List[str] = []  # prefixes of modules held by a wrapper or compiled in place
            for raw_name, module in model.named_modules():
                name = clean_name(raw_name)
                if _under(raw_name, wrapped):
                    if not _builtin(module):
                        self._name(module, name)
                    continue
                compiled = False
                if not _under(raw_name, held):
                    compiled = hasattr(module, "_orig_mod") and hasattr(module, "_torchdynamo_orig_callable")
                    if compiled:
                        wrapped.append(f"{raw_name}._orig_mod" if raw_name else "_orig_mod")
                    elif _compiled_inside(module) or getattr(module, "_compiled_call_impl", None) is not None:
                        held.append(raw_name)
                if name:
                    watched[name] = watched.get(name, 0) + 1
                    self._names.append(name)
                if not compiled and (not name or not _builtin(module)):  # (roots: see watched_name)
                    self._name(module, name)
                asked = bool(self.layer_types and isinstance(module, self.layer_types)) or name in self.layer_names
                if not asked and (_builtin(module) or _under(raw_name, held)):
                    # torch.nn's own modules (Linear, norms, containers) never call FlexAttention;
                    # a hook would make Dynamo trace their whole __call__ under torch.compile
                    continue
                self._slots.append(_Hooks.attach(module, self, name, compiled))

    def _name(self, module: torch.nn.Module, name: str) -> None:
        key = _name_module(module, name)
        if key is not None:
            self._ids.append(key)

    def _remove(self) -> None:
        slots, self._slots = self._slots, []
        for slot in slots:
            slot.detach()
        pending, self._bw_handles = self._bw_handles, {}
        for hs in pending.values():
            for h in hs:
                h.remove()
        ids, self._ids = self._ids, []
        _unname_modules(ids)
        names, self._names = self._names, []
        for n in names:
            _decrement(STATE.watch.names, n)

    def _pre(self, slot: "_Hooks", mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
        # A torch.compile wrapper is never the attention layer (measuring it would time the
        # whole compiled model: +13 % step time on an H200): no class to learn on the stack.
        name = slot.name
        frame = _Frame()
        frame.owner = self
        frame.name = name
        frame.token = _LAYER.set(_LAYER.get() + ((name, None if slot.compiled else type(mod)),))
        frame.measure = None
        frame.recompute = in_backward()
        frame.grad_inputs = None
        frame.dense_before = _dense_count(name, "forward")
        try:
            if self._is_layer(mod, name):
                inputs = _span_inputs(args, kwargs)
                if self.memory:
                    frame.measure = measure_start(inputs if inputs else mod)
                if torch.is_grad_enabled() and not frame.recompute:
                    frame.grad_inputs = [t for t in inputs if t.requires_grad]
        except Exception as exc:
            internal_error("watch pre-hook", exc)
        _stack(mod).append(frame)

    def _post(self, frame: "_Frame", mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = frame.name
        try:
            _LAYER.reset(frame.token)
        except ValueError:  # reset from another context (should not happen): fall back
            cur = _LAYER.get()
            _LAYER.set(cur[:-1] if cur and cur[-1][0] == name else cur)
        try:
            if frame.measure is not None or self._is_layer(mod, name):
                alloc, peak = measure_stop(frame.measure)
                _record(name, "forward", alloc, peak, frame.recompute, frame.dense_before)
                if frame.grad_inputs is None and torch.is_grad_enabled() and not frame.recompute:
                    # first call of a layer class: known as a layer only now; its backward counts
                    frame.grad_inputs = [t for t in _span_inputs(args, kwargs) if t.requires_grad]
                if frame.grad_inputs and output is not None:
                    self._watch_backward(name, output, frame.grad_inputs)
        except Exception as exc:
            internal_error("watch post-hook", exc)

    def _watch_backward(self, name: str, output: Any, inputs: Sequence[torch.Tensor]) -> None:
        outs = [t for t in _tensors(output) if t.requires_grad and t.grad_fn is not None]
        if not outs or not inputs:
            return
        # The hooks must not hold the tensors (tensor -> grad_fn -> hook -> closure -> tensor is a
        # cycle through C++ that gc cannot free): close over a device index, and remove both
        # hooks when the span ends or when watch() exits.
        device = _cuda_device(outs) if self.memory and _cuda_ready() else None
        box: Dict[str, Any] = {}
        handles: List[Any] = []
        key = object()
        pending = self._bw_handles

        def start(*_: Any) -> None:
            try:
                if "started" not in box:
                    box["started"] = True
                    _bw_push(name)
                    box["dense_before"] = _dense_count(name, "backward")
                    box["m"] = measure_start(device) if device is not None else None
            except Exception as exc:
                internal_error("watch backward start", exc)

        def end(*_: Any) -> None:
            try:
                if box.pop("started", None):
                    _bw_pop(name)
                    alloc, peak = measure_stop(box.pop("m", None))
                    _record(name, "backward", alloc, peak, dense_before=box.pop("dense_before", -1))
                for h in handles:
                    h.remove()
                pending.pop(key, None)
            except Exception as exc:
                internal_error("watch backward end", exc)

        handles.append(torch.autograd.graph.register_multi_grad_hook(outs, start, mode="any"))
        handles.append(torch.autograd.graph.register_multi_grad_hook(list(inputs), end, mode="all"))
        pending[key] = handles


def _at_trace_time(fn: Callable[[], int]) -> Callable[[], int]:
    """``fn`` run for real when Dynamo traces a call to it (the result baked in as a constant);
    without that Dynamo support, a function that does nothing."""
    try:
        return torch._dynamo.assume_constant_result(fn)
    except Exception:  # pragma: no cover - very old torch
        return lambda: 0


WATCH_TRACED_ADVICE = (
    "fusionguard.watch() put hooks on modules that run inside torch.compile and Dynamo traced "
    "them (they never run inside the graph), which makes the compile longer (x1.3-1.5 measured). "
    "fusionguard could not tell: the model is called from a compiled function, or its "
    "torch.compile wrapper was made before fusionguard.enable(), or watch() was entered before "
    "torch.compile (or module.compile()). Compile the module (model = torch.compile(model)) after enable() and before "
    "watch()."
)


def _hooks_traced(slot: "_Hooks") -> int:
    """Runs at trace time: once per process, say that watch()'s hooks are being compiled."""
    name = slot.name
    try:
        if not STATE.stats.told_traced:
            STATE.stats.told_traced = True
            STATE.log.emit("warning", "watch_traced", layer=name or None, advice=WATCH_TRACED_ADVICE)
            from .guard import _warn

            _warn(WATCH_TRACED_ADVICE, None, RuntimeWarning)  # at the user's line, not this file
    except Warning:  # filters say error: never raised into Dynamo's trace (the event is logged)
        pass
    except Exception as exc:
        internal_error("watch traced note", exc)
    return 0


_FRAMES = threading.local()


def _stack(module: torch.nn.Module) -> List[_Frame]:
    # Per thread and per module: pre/post hooks of one module call pair up LIFO.
    d = getattr(_FRAMES, "d", None)
    if d is None:
        d = _FRAMES.d = {}
    key = id(module)
    s = d.get(key)
    if s is None:
        s = d[key] = []
    return s


def watch(*models: torch.nn.Module, memory: bool = True, layers: Iterable[Union[type, str]] = ()) -> Watch:
    """Attribute FlexAttention events to layers and measure each attention layer's memory.

    Use as a context manager (``with fusionguard.watch(model): ...``) around a step or the whole
    training loop, or as a decorator. ``layers``: module classes or qualified names to measure
    from the first call (by default, classes are measured once seen calling FlexAttention).
    """
    return Watch(*models, memory=memory, layers=layers)
