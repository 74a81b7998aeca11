"""``Watch`` and ``watch()``: which modules get hooks, what each hook records, backward spans."""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

from fusionguard import torch_internals as ti
from fusionguard.core.frames import warn_at_user_line
from fusionguard.core.state import STATE, internal_error
from fusionguard.watching.hooks import Frame, Hooks, frames_of, span_inputs
from fusionguard.watching.memory import cuda_device, cuda_ready, dense_count, measure_start, measure_stop, record, tensors
from fusionguard.watching.naming import (
    LAYER,
    builtin_module,
    bw_pop,
    bw_push,
    clean_name,
    compiled_inside,
    decrement,
    in_backward,
    name_module,
    under,
    unname_modules,
    wrapper_chain,
)

_builtin = builtin_module


def _layers(layers: Any) -> List[Union[type, str]]:
    """``layers=``, checked (read once: a generator is fine): module classes and qualified names."""
    what = (
        "fusionguard.watch(): layers must be a list of module classes or qualified names "
        '(e.g. layers=[MyAttention] or layers=["layers.0.attn"])'
    )
    if isinstance(layers, (str, bytes)) or isinstance(layers, type):
        raise TypeError(f"{what}; got the single {type(layers).__name__} {layers!r}: put it in a list")
    try:
        items = list(layers)
    except TypeError:
        raise TypeError(f"{what}; got {type(layers).__name__} {layers!r}") from None
    for x in items:
        if not (isinstance(x, str) or (isinstance(x, type) and issubclass(x, torch.nn.Module))):
            raise TypeError(f"{what}; got {type(x).__name__} {x!r} in it")
    return items


class Watch:
    """``with fusionguard.watch(model): ...`` or ``@fusionguard.watch(model)``."""

    def __init__(
        self,
        *models: torch.nn.Module,
        memory: bool = True,
        layers: Iterable[Union[type, str]] = (),
        expect_flex: bool = True,
        hooks: bool = True,
    ) -> None:
        if not models:
            raise TypeError("fusionguard.watch() needs at least one torch.nn.Module")
        for m in models:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"fusionguard.watch() takes nn.Module objects, got {type(m).__name__}")
        if not isinstance(memory, bool):
            raise TypeError(f"fusionguard.watch(): memory must be True or False, not {memory!r}")
        if not isinstance(expect_flex, bool):
            raise TypeError(f"fusionguard.watch(): expect_flex must be True or False, not {expect_flex!r}")
        chosen = _layers(layers)
        self.models = models
        self.memory = memory
        self.expect_flex = expect_flex
        self._roots: Dict[int, Any] = {}  # id(hook slot) -> a weak reference to the watched model it checks (expect_flex)
        # hooks=False: names only, every module treated as compiled (no hooks Dynamo could trace):
        # for a caller that knows the model will be compiled after watch() starts (a framework
        # that compiles it itself, e.g. TrainingArguments(torch_compile=True))
        self.hooks = hooks
        self.layer_types = tuple(x for x in chosen if isinstance(x, type))
        self.layer_names = {x for x in chosen if isinstance(x, str)}
        self._slots: List["Hooks"] = []
        self._names: List[str] = []
        self._ids: List[int] = []
        self._bw_handles: Dict[object, List[Any]] = {}  # backward spans still waiting to end
        self._depth = 0
        self._lock = threading.Lock()
        #: called with the module at each forward begin of a watched model's root (eager, not a
        #: checkpoint re-run): a session's step_on_forward()
        self.on_forward: Optional[Callable[[torch.nn.Module], None]] = None

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

    def release(self) -> "Watch":
        """Hold the models no more (their hooks stay until the exit, which needs none of them): for
        an owner that a model may hold, kept by a registry (a session stored on its own model), so
        the model can still be collected. It cannot be entered again after its exit."""
        self.models = ()
        return self

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
            # Modules that get no hooks: those inside a torch.compile wrapper (named by identity,
            # and watched names as the compile records spell them), and those a wrapper holds or compiled in place
            # (watch(model) beside compiled = torch.compile(model); module.compile(), torchtitan's
            # per-block compile), whose names stay watched: records of a wrapper compiled around
            # them map to them. Either kind is named by identity for a dense call it runs
            # eagerly (layer_from_stack).
            wrapped: List[str] = []  # prefixes inside torch.compile wrappers
            held: List[str] = []  # prefixes of modules held by a wrapper or compiled in place
            root_slot: Optional[Hooks] = None
            for raw_name, module in model.named_modules():
                name = clean_name(raw_name)
                if under(raw_name, wrapped):
                    if name:  # (named as the compile records name them: ``net.layers.0`` for ``self.net = torch.compile(net)``)
                        watched[name] = watched.get(name, 0) + 1
                        self._names.append(name)
                    if not _builtin(module):
                        self._name(module, name)
                        if name:
                            STATE.watch.unhooked[id(self)] = True
                    continue
                compiled = False
                if not under(raw_name, held):
                    compiled = ti.is_compile_wrapper(module)
                    if compiled:
                        wrapped.append(f"{raw_name}.{ti.ORIG_MOD}" if raw_name else ti.ORIG_MOD)
                    elif compiled_inside(module) or ti.compiled_in_place(module):
                        held.append(raw_name)
                if name:
                    watched[name] = watched.get(name, 0) + 1
                    self._names.append(name)
                if not compiled and (not name or not _builtin(module)):  # (roots: see watched_name)
                    self._name(module, name)
                asked = bool(self.layer_types and isinstance(module, self.layer_types)) or name in self.layer_names
                if not self.hooks or (not asked and (_builtin(module) or under(raw_name, held))):
                    # torch.nn's own modules (Linear, norms, containers) never call FlexAttention;
                    # a hook would make Dynamo trace their whole __call__ under torch.compile
                    if name and not _builtin(module):
                        STATE.watch.unhooked[id(self)] = True
                    continue
                self._slots.append(Hooks.attach(module, self, name, compiled))
                if not raw_name:
                    root_slot = self._slots[-1]
            if self.expect_flex and self.hooks and not told_no_flex(model):  # hooks=False: no hook at all
                self._check_root(model, root_slot)

    def _check_root(self, model: torch.nn.Module, slot: Optional[Hooks]) -> None:
        """Check each forward of ``model`` for FlexAttention calls (``expect_flex``): on its own
        hooks, or, when it runs inside a ``torch.compile`` wrapper (no hooks inside), on the
        wrapper's, which run outside the graph. A module compiled in place (``module.compile()``)
        runs its hooks inside its graph: not checked."""
        if slot is None:
            target: Optional[torch.nn.Module] = model
            if compiled_inside(model):
                ref = STATE.watch.compiled_inside.get(model)
                target = ref() if ref is not None else None
            elif ti.compiled_in_place(model):
                target = None
            if target is None:
                return
            slot = Hooks.attach(target, self, "", target is not model)
            self._slots.append(slot)
        inner = ti.wrapped_module(model) if ti.is_compile_wrapper(model) else None
        self._roots[id(slot)] = weakref.ref(inner if isinstance(inner, torch.nn.Module) else model)

    def _name(self, module: torch.nn.Module, name: str) -> None:
        key = name_module(module, name)
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
        self._roots = {}
        STATE.watch.unhooked.pop(id(self), None)
        ids, self._ids = self._ids, []
        unname_modules(ids)
        names, self._names = self._names, []
        for n in names:
            decrement(STATE.watch.names, n)

    def _pre(self, slot: "Hooks", mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
        # A torch.compile wrapper is never the attention layer (measuring it would time the
        # whole compiled model: +13 % step time on an H200): no class to learn on the stack.
        name = slot.name
        frame = Frame()
        frame.owner = self
        frame.name = name
        frame.token = LAYER.set(LAYER.get() + ((name, None if slot.compiled else type(mod)),))
        frame.measure = None
        frame.recompute = in_backward()
        frame.grad_inputs = None
        frame.dense_before = dense_count(name, "forward")
        frame.flex_before = -1
        frame.root = None
        try:  # (here and below a plain try, not guarded(): the hooks run on every layer call, and a try is free)
            if not name and self.on_forward is not None and not frame.recompute:
                self.on_forward(mod)
            if self._roots and not frame.recompute:
                ref = self._roots.get(id(slot))
                root = ref() if ref is not None else None
                if root is not None and not told_no_flex(root):
                    frame.root, frame.flex_before = root, flex_calls()
            if self._is_layer(mod, name):
                inputs = span_inputs(args, kwargs)
                if self.memory:
                    frame.measure = measure_start(inputs if inputs else mod)
                if torch.is_grad_enabled() and not frame.recompute:
                    frame.grad_inputs = [t for t in inputs if t.requires_grad]
        except Exception as exc:
            internal_error("watch pre-hook", exc)
        frames_of(mod).append(frame)

    def _post(self, frame: "Frame", mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = frame.name
        try:
            LAYER.reset(frame.token)
        except ValueError:  # reset from another context (should not happen): fall back
            cur = LAYER.get()
            LAYER.set(cur[:-1] if cur and cur[-1][0] == name else cur)
        try:  # (plain try: per layer call)
            if frame.flex_before >= 0 and sys.exc_info()[0] is None and flex_calls() == frame.flex_before:
                no_flex_calls(frame.root)  # (a forward that raised is not a completed one)
            if frame.measure is not None or self._is_layer(mod, name):
                alloc, peak = measure_stop(frame.measure)
                record(name, "forward", alloc, peak, frame.recompute, frame.dense_before)
                if frame.grad_inputs is None and torch.is_grad_enabled() and not frame.recompute:
                    # first call of a layer class: known as a layer only now; its backward counts
                    frame.grad_inputs = [t for t in span_inputs(args, kwargs) if t.requires_grad]
                if frame.grad_inputs and output is not None:
                    self._watch_backward(name, output, frame.grad_inputs)
        except Exception as exc:
            internal_error("watch post-hook", exc)

    def _watch_backward(self, name: str, output: Any, inputs: Sequence[torch.Tensor]) -> None:
        outs = [t for t in tensors(output) if t.requires_grad and t.grad_fn is not None]
        if not outs or not inputs:
            return
        # The hooks must not hold the tensors (tensor -> grad_fn -> hook -> closure -> tensor is a
        # cycle through C++ that gc cannot free): close over a device index, and remove both
        # hooks when the span ends or when watch() exits.
        device = cuda_device(outs) if self.memory and cuda_ready() else None
        box: Dict[str, Any] = {}
        handles: List[Any] = []
        key = object()
        pending = self._bw_handles

        def start(*_: Any) -> None:
            try:  # (plain try: per layer backward)
                if "started" not in box:
                    box["started"] = True
                    bw_push(name)
                    box["dense_before"] = dense_count(name, "backward")
                    box["m"] = measure_start(device) if device is not None else None
            except Exception as exc:
                internal_error("watch backward start", exc)

        def end(*_: Any) -> None:
            try:  # (plain try: per layer backward)
                if box.pop("started", None):
                    bw_pop(name)
                    alloc, peak = measure_stop(box.pop("m", None))
                    record(name, "backward", alloc, peak, dense_before=box.pop("dense_before", -1))
                for h in handles:
                    h.remove()
                pending.pop(key, None)
            except Exception as exc:
                internal_error("watch backward end", exc)

        handles.append(torch.autograd.graph.register_multi_grad_hook(outs, start, mode="any"))
        handles.append(torch.autograd.graph.register_multi_grad_hook(list(inputs), end, mode="all"))
        pending[key] = handles


def watch(*models: torch.nn.Module, memory: bool = True, layers: Iterable[Union[type, str]] = (), expect_flex: bool = True) -> Watch:
    """Attribute FlexAttention events to layers and measure each attention layer's memory.

    Use as a context manager (``with fusionguard.watch(model): ...``) around a step or the whole
    training loop, or as a decorator. ``layers``: module classes or qualified names to measure
    from the first call (by default, classes are measured once seen calling FlexAttention).
    ``expect_flex`` (default True): the first forward of a watched model that completes without
    any FlexAttention call writes one ``no_flex_calls`` event and one warning (its attention ran
    another way, e.g. SDPA), once per model; False for models that may skip attention.
    A copy of the model made inside (``copy.deepcopy``, ``torch.save``) carries a stdlib no-op
    in place of each hook (``contextlib.nullcontext.__exit__``): it loads without fusionguard.
    """
    return Watch(*models, memory=memory, layers=layers, expect_flex=expect_flex)


NO_FLEX_FIX = (
    "make the model use FlexAttention (for a Hugging Face model: load it with "
    "attn_implementation=\"flex_attention\"), or, if this model may run without attention, "
    "watch it with fusionguard.watch(model, expect_flex=False)"
)


def flex_calls() -> int:
    """FlexAttention forward calls so far, all paths (dense, fused graph runs, rescued): three
    dictionary reads, once per watched model's forward."""
    counts = STATE.counts
    return counts.get("dense_forward", 0) + counts.get("fused_runs_forward", 0) + counts.get("rescued", 0)


def told_no_flex(model: torch.nn.Module) -> bool:
    ref = STATE.stats.no_flex_told.get(id(model))
    return ref is not None and ref() is model


def no_flex_calls(model: torch.nn.Module) -> None:
    """A forward of ``model`` completed without any FlexAttention call: say it once per model."""
    if told_no_flex(model):
        return
    try:
        STATE.stats.no_flex_told[id(model)] = weakref.ref(model)
    except TypeError:  # a module class without weak references: told once per process then
        STATE.stats.no_flex_told[id(model)] = lambda: model
    impl = ti.attn_implementation(model)
    name = type(model).__qualname__
    fields: Dict[str, Any] = {"model": name, "module": type(model).__module__, "attn_implementation": impl, "fix": NO_FLEX_FIX}
    STATE.log.emit("warning", "no_flex_calls", **fields)
    hf = f" Its config._attn_implementation is {impl!r}." if impl is not None else ""
    message = (
        f"fusionguard: a forward of the watched model {name} completed without any FlexAttention "
        f"call: its attention ran another way (SDPA, eager), not through FlexAttention.{hf} Fix: {NO_FLEX_FIX}."
    )
    try:
        warn_at_user_line(message, None, RuntimeWarning)
    except Warning:  # the user's filters made it an error: the forward already ran; the event is logged
        pass


def unwrap(model: Any) -> Any:
    """The model a session watches: ``model`` under its wrappers (``wrapper_chain``: DataParallel,
    DDP, FSDP1, ...), up to a ``torch.compile`` wrapper, which is kept: ``watch()`` names through
    it and hooks nothing inside."""
    if not isinstance(model, torch.nn.Module):
        return model
    chain = wrapper_chain(model)
    return next((m for m in chain if ti.is_compile_wrapper(m)), chain[-1])
