"""watch()'s hook pool: one pre/post hook pair per module, the same objects at every entry;
the per-thread frames that pair a pre-hook with its post-hook; the hooks kept out of Dynamo's
sight while it compiles; the trace-time note."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from fusionguard import torch_internals as ti
from fusionguard.core.frames import warn_at_user_line
from fusionguard.core.state import STATE, guarded, internal_error, nothing
from fusionguard.watching.memory import Measure, tensors

if TYPE_CHECKING:
    from fusionguard.watching.watcher import Watch


_is_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)
_PRE_HOOKS = ti.FORWARD_PRE_HOOKS


def span_inputs(args: Any, kwargs: Any) -> List[torch.Tensor]:
    """The tensors a layer's backward span ends on: its positional inputs, else the
    ``hidden_states`` keyword (Hugging Face), else every keyword tensor. Keyword tensors shared by
    all layers (``encoder_hidden_states``, a T5 ``position_bias``) would keep every earlier
    layer's span open until the last layer's backward."""
    found = tensors(args)
    if found:
        return found
    if isinstance(kwargs, dict) and kwargs.get("hidden_states") is not None:
        found = tensors(kwargs["hidden_states"])
        if found:
            return found
    return tensors(kwargs)


class Frame:
    __slots__ = ("owner", "name", "token", "measure", "recompute", "grad_inputs", "dense_before", "flex_before", "root")
    owner: "Watch"
    name: str
    token: Any
    measure: Optional[Measure]
    recompute: bool
    grad_inputs: Optional[List[torch.Tensor]]
    dense_before: int
    flex_before: int  # FlexAttention calls counted when a watched model's forward began (-1: not checked)
    root: Any  # that watched model


#: What a hook of watch()'s becomes in a copy of its module: a stdlib no-op (any arguments, returns None).
INERT = contextlib.nullcontext.__exit__


class _Hook(functools.partial):
    """A hook of watch()'s: ``pre_hook`` / ``post_hook`` bound to its slot. Pickled or copied
    (``torch.save(model)``, ``copy.deepcopy(model)`` while it is on), it becomes ``INERT``
    (``contextlib.nullcontext.__exit__``: traced by Dynamo without a graph break), so the copy
    loads and runs where fusionguard is not installed; a watch() of the copy takes those off."""

    __slots__ = ()

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return (getattr, (contextlib.nullcontext, "__exit__"))


def pre_hook(slot: "Hooks", mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
    """watch()'s forward pre-hook (with kwargs), bound to its slot by a ``functools.partial``."""
    if _is_dynamo_compiling():
        slot.traced()
        return
    slot.calls.append(None)
    owner = slot.owner
    # (only on the watched module: a module holding these hooks in a dict of its own, say
    # a model saved with an older fusionguard, is never counted as it)
    if owner is not None and mod.__dict__.get(_PRE_HOOKS) is slot.home():
        owner._pre(slot, mod, args, kwargs)


def post_hook(slot: "Hooks", mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    """watch()'s forward hook (with kwargs, always called)."""
    if _is_dynamo_compiling():
        return
    try:
        slot.calls.pop()
    except IndexError:  # (its pre-hook ran before this watch() began)
        pass
    stack = frames_of(mod)
    if stack:
        frame = stack.pop()
        frame.owner._post(frame, mod, args, kwargs, output)


class Hooks:
    """watch()'s pre/post hook pair on one module: two function objects made once per module
    (and per nesting level), registered when a watch() of the module starts and removed when it
    ends; they forward to ``owner``, the Watch now entered. The hooks are ``functools.partial``
    objects of ``pre_hook`` / ``post_hook`` over the slot (``_Hook``), so a model that holds them pickles.

    Why the same objects every time: Dynamo guards on the hooks of a module it compiles (when
    fusionguard cannot know the module runs inside a graph). New hook functions at every entry
    recompiled the model at every step, until the recompile limit sent it to eager, dense
    FlexAttention; the same functions re-registered pass the guards: at most one graph with
    the hooks and one without. Nothing stays on the module after watch() exits (pickling and
    ``torch.jit.script`` after it are unaffected). A copy made *during* watch() (``copy.deepcopy``,
    ``torch.save`` then ``torch.load``) carries, in place of each hook, ``contextlib.nullcontext.__exit__``:
    a stdlib no-op that never counts it as the watched module and needs no fusionguard; a watch() of the
    copy takes those off (``_register``), so saving and loading while watched never piles them up.

    Dynamo never sees them where it can be helped: ``out_of_sight`` takes them out of their
    module's hook dicts while Dynamo compiles a frame. The guards and the reuse above matter
    where it cannot (a module with forward hooks of its own).
    """

    __slots__ = ("owner", "name", "compiled", "handles", "home", "pre", "post", "calls", "traced", "__weakref__")

    def __init__(self) -> None:
        self.owner: Optional["Watch"] = None
        self.name = ""
        self.compiled = False
        self.handles: List[Tuple[Any, Tuple[Any, ...]]] = []  # (pre, post): (handle, ti.hook_marks)
        self.home: Callable[[], Any] = nothing  # the module's pre-hook dict, weakly
        # one entry per eager forward of the module between this pair's pre- and post-hook, on
        # any thread (list append and pop are atomic): such a module keeps its hooks in sight
        self.calls: List[None] = []
        # The hooks hold the slot, never the module (the module holds the hooks). Partials of
        # module-level functions, not closures: a model holding them pickles (torch.save,
        # copy.deepcopy), each hook as an inert stdlib no-op (_Hook.__reduce__).
        slot = self  # (a function, not a partial: Dynamo runs a marked function, it inlines a partial)
        self.traced: Callable[[], int] = ti.at_trace_time(lambda: _hooks_traced(slot))
        self.pre: Callable[..., Any] = _Hook(pre_hook, self)
        self.post: Callable[..., Any] = _Hook(post_hook, self)
        if not _SIGHT.codes_skipped:
            # The hooks of a module Dynamo does not trace run as frames of their own under its
            # frame callback (the compiled module's own, the module of a graph break): each
            # compiled to an empty graph, 0.04-0.08 s apiece on CPU. Skipped as frames, with
            # what they call (fusionguard's code only); a traced frame still inlines them.
            _SIGHT.codes = (pre_hook.__code__, post_hook.__code__)
            _SIGHT.codes_skipped = ti.skip_frames(_SIGHT.codes, _SIGHT.on)

    def __reduce__(self) -> Tuple[Any, Tuple[()]]:
        """A slot copied or pickled alone is a fresh one that no watch() owns (a hook pickles without it: ``_Hook``)."""
        return (Hooks, ())

    @classmethod
    def attach(cls, module: torch.nn.Module, owner: "Watch", name: str, compiled: bool) -> "Hooks":
        out_of_sight()  # (outside the watch lock: the registry's lock comes first, as in disable())
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
            slot.calls.clear()
            try:
                slot._register(module)
            except BaseException:
                slot.detach()
                raise
            STATE.watch.hooked[id(slot)] = slot
            return slot

    def _register(self, module: torch.nn.Module) -> None:
        fns = (self.pre, self.post)
        if self.handles and all(ti.reinsert_hook(h, fn, marks) for fn, (h, marks) in zip(fns, self.handles)):
            return
        for h, _ in self.handles:  # (a partial re-insert)
            h.remove()
        with guarded("watch: a copy's inert hooks"):  # (a model saved and loaded while watched, again and again: never piled up)
            ti.drop_hooks(module, INERT)
        # with_kwargs: Hugging Face layers take their tensors as keyword arguments
        pre = module.register_forward_pre_hook(self.pre, with_kwargs=True)
        self.handles = [(pre, ti.hook_marks(pre))]
        self.home = ti.hooks_home(pre)
        post = module.register_forward_hook(self.post, with_kwargs=True, always_call=True)
        self.handles.append((post, ti.hook_marks(post)))

    def detach(self) -> None:
        with STATE.watch.lock:
            self.owner = None
            STATE.watch.hooked.pop(id(self), None)  # (out of sight now: never put back)
            for h, _ in self.handles:
                h.remove()  # the handles stay, to put the same hooks back under the same ids


# -- out of Dynamo's sight ---------------------------------------------------------------------
#
# A module with forward hooks makes Dynamo trace ``Module.__call__`` and ``_call_impl`` around
# its forward (the hooks, the kwargs and always-called bookkeeping, a closure) and guard on every
# hook dict: for an 8-block model, +7-10 % of Dynamo's Python calls (torch 2.7-2.15), a third
# more guards, two more frames; a warm compile x1.2-1.5 on the H200, for hooks that never run
# inside the graph. Without hooks Dynamo inlines ``forward`` directly
# and, under ``skip_nnmodule_hook_guards`` (its default), guards on no empty hook dict. So while
# Dynamo compiles a frame (its compile start/end callbacks, outermost compile only), watch()'s
# hook entries are taken out of their module's hook dicts and put back, in order and under the
# same ids, when the compile ends: the compile, its graph and its guards are those of the model
# without watch(), and a later watch() entry or exit recompiles nothing. Left in sight: a
# module with forward hooks of its own (Dynamo guards on that dict's length), a module whose
# forward is running eagerly on some thread (its post-hook must run), and every module when
# ``skip_nnmodule_hook_guards`` is off or this torch has no compile callbacks (traced as
# before, ``watch_traced`` says so).


class _Sight:
    """The compile now running (the depth of Dynamo's start/end callbacks) and the hook dict
    entries taken out for it: [(dict, [(hook id, value), ...]), ...] per module."""

    def __init__(self) -> None:
        self.on = True
        self.depth = 0
        self.saved: List[List[Tuple[Dict[Any, Any], List[Tuple[Any, Any]]]]] = []
        self.codes: Tuple[Any, ...] = ()
        self.codes_skipped = False


_SIGHT = _Sight()
OUT_OF_SIGHT = "torch._dynamo.callback: watch() hooks out of sight while compiling"


def out_of_sight() -> None:
    """Register the compile callbacks that hide watch()'s hooks (at each hook attach: cheap, and
    ``torch._dynamo.reset()`` clears them); ``disable()`` removes them (the registry)."""
    added = False
    with guarded("watch hooks out of sight (register)"):
        added = not ti.compile_callback_registered(_compile_started) and ti.add_compile_callbacks(_compile_started, _compile_ended)
    if added:
        STATE.patches.add_hook(OUT_OF_SIGHT, _unregister, lambda: not ti.compile_callback_registered(_compile_started))


def _unregister() -> None:
    with STATE.watch.lock:
        _put_back()
        _SIGHT.depth = 0
    ti.remove_compile_callbacks(_compile_started, _compile_ended)


@guarded("watch hooks out of sight")
def _compile_started(*args: Any) -> None:
    w = STATE.watch
    with w.lock:
        _SIGHT.depth += 1
        # (other triggers, where the callbacks carry one: AOTAutograd's backward compiled at
        # its first run, a CUDA graph recorded; Dynamo traces nothing there)
        trigger = ti.compile_trigger(args)
        if _SIGHT.depth == 1 and trigger == "DYNAMO" and _SIGHT.on and w.hooked and ti.hook_guards_skipped():
            _hide(list(w.hooked.values()))


@guarded("watch hooks put back")
def _compile_ended(*_: Any) -> None:
    with STATE.watch.lock:
        if _SIGHT.depth == 0:  # (registered during this compile)
            return
        _SIGHT.depth -= 1
        if _SIGHT.depth == 0:
            _put_back()


def _hook_dicts(slot: "Hooks") -> Optional[List[Dict[Any, Any]]]:
    """The dicts registering the pair wrote in (pre-hooks, forward hooks, their with_kwargs and
    always_call dicts), through its handles; None if the module is gone or the handles differ."""
    if len(slot.handles) != 2:
        return None
    (pre, _), (post, _) = slot.handles
    (pre_home, *pre_extra), (post_home, *post_extra) = ti.hook_dicts(pre), ti.hook_dicts(post)
    dicts = [pre_home, post_home, *pre_extra, *post_extra]
    return None if any(d is None for d in dicts) else dicts


def _hide(slots: List["Hooks"]) -> None:
    ours = {h.id for s in slots for h, _ in s.handles}
    modules: Dict[int, List[Hooks]] = {}
    for s in slots:
        modules.setdefault(id(s.home()), []).append(s)
    for group in modules.values():
        with guarded("watch hooks out of sight"):
            dicts = _hook_dicts(group[0])
            if dicts is None or any(s.calls for s in group):
                continue
            if any(k not in ours for d in dicts[:2] for k in d):
                continue  # the user's own forward hooks: Dynamo guards on these dicts' length
            saved = [(d, [(k, v) for k, v in d.items() if k in ours]) for d in dicts]
            _SIGHT.saved.append(saved)  # (before any is taken out)
            for d, items in saved:
                for k, _ in items:
                    del d[k]


def _put_back() -> None:
    saved, _SIGHT.saved = _SIGHT.saved, []
    live = {h.id for s in STATE.watch.hooked.values() for h, _ in s.handles}  # (not a watch() that ended meanwhile)
    for module in saved:
        for d, items in module:
            for k, v in items:
                if k in live:
                    d.setdefault(k, v)


WATCH_TRACED_ADVICE = (
    "fusionguard.watch() put hooks on modules that run inside torch.compile and Dynamo traced "
    "them (they never run inside the graph), which makes the compile longer (x1.2-1.5 measured). "
    "fusionguard keeps its hooks out of Dynamo's sight while it compiles, but not on a module "
    "with forward hooks of its own (Dynamo guards on those) nor with "
    "torch._dynamo.config.skip_nnmodule_hook_guards=False, nor in the first compile after a "
    "torch._dynamo.reset() inside watch(). Compile the module (model = torch.compile(model)) after enable() and before "
    "watch()."
)


def _hooks_traced(slot: "Hooks") -> int:
    """Runs at trace time: once per process, say that watch()'s hooks are being compiled; hide
    them from the next compiles (callbacks that ``torch._dynamo.reset()`` cleared)."""
    name = slot.name
    try:  # (not guarded(): a Warning that a filter raises is caught first, never raised into Dynamo's trace)
        out_of_sight()
        if not STATE.stats.told_traced:
            STATE.stats.told_traced = True
            STATE.log.emit("warning", "watch_traced", layer=name or None, advice=WATCH_TRACED_ADVICE)
            warn_at_user_line(WATCH_TRACED_ADVICE, None, RuntimeWarning)  # at the user's line, not this file
    except Warning:  # filters say error: never raised into Dynamo's trace (the event is logged)
        pass
    except Exception as exc:
        internal_error("watch traced note", exc)
    return 0


_FRAMES = threading.local()


def frames_of(module: torch.nn.Module) -> List[Frame]:
    # Per thread and per module: pre/post hooks of one module call pair up LIFO.
    d = getattr(_FRAMES, "d", None)
    if d is None:
        d = _FRAMES.d = {}
    key = id(module)
    s = d.get(key)
    if s is None:
        s = d[key] = []
    return s
