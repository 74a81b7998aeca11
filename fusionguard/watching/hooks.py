"""watch()'s hook pool: one pre/post hook pair per module, the same objects at every entry;
the per-thread frames that pair a pre-hook with its post-hook; the trace-time note."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch

from fusionguard import torch_internals as ti
from fusionguard.core.state import STATE, internal_error
from fusionguard.core.frames import warn_at_user_line
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


class Hooks:
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
        self.handles: List[Tuple[Any, Tuple[Any, ...]]] = []  # (pre, post): (handle, ti.hook_marks)
        self.home: Callable[[], Any] = lambda: None  # the module's pre-hook dict, weakly
        slot = self  # the hooks hold the slot, never the module (the module holds the hooks)
        traced = ti.at_trace_time(lambda: _hooks_traced(slot))

        def pre_hook(mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if _is_dynamo_compiling():
                traced()
                return
            owner = slot.owner
            # (a deepcopy of the model made during watch() carries these hooks in dicts of its
            # own: not the watched module, never counted as it)
            if owner is not None and mod.__dict__.get(_PRE_HOOKS) is slot.home():
                owner._pre(slot, mod, args, kwargs)

        def post_hook(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if _is_dynamo_compiling():
                return
            stack = frames_of(mod)
            if stack:
                frame = stack.pop()
                frame.owner._post(frame, mod, args, kwargs, output)

        self.pre: Callable[..., Any] = pre_hook
        self.post: Callable[..., Any] = post_hook

    @classmethod
    def attach(cls, module: torch.nn.Module, owner: "Watch", name: str, compiled: bool) -> "Hooks":
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
        if self.handles and all(ti.reinsert_hook(h, fn, marks) for fn, (h, marks) in zip(fns, self.handles)):
            return
        for h, _ in self.handles:  # (a partial re-insert)
            h.remove()
        # with_kwargs: Hugging Face layers take their tensors as keyword arguments
        pre = module.register_forward_pre_hook(self.pre, with_kwargs=True)
        self.handles = [(pre, ti.hook_marks(pre))]
        self.home = ti.hooks_home(pre)
        post = module.register_forward_hook(self.post, with_kwargs=True, always_call=True)
        self.handles.append((post, ti.hook_marks(post)))

    def detach(self) -> None:
        with STATE.watch.lock:
            self.owner = None
            for h, _ in self.handles:
                h.remove()  # the handles stay, to put the same hooks back under the same ids


WATCH_TRACED_ADVICE = (
    "fusionguard.watch() put hooks on modules that run inside torch.compile and Dynamo traced "
    "them (they never run inside the graph), which makes the compile longer (x1.3-1.5 measured). "
    "fusionguard could not tell: the model is called from a compiled function, or its "
    "torch.compile wrapper was made before fusionguard.enable(), or watch() was entered before "
    "torch.compile (or module.compile()). Compile the module (model = torch.compile(model)) after enable() and before "
    "watch()."
)


def _hooks_traced(slot: "Hooks") -> int:
    """Runs at trace time: once per process, say that watch()'s hooks are being compiled."""
    name = slot.name
    try:
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
