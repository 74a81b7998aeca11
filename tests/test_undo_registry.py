"""One undo registry: everything enable() installs is an entry, and disable() puts every original back."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import torch
from conftest import PUBLIC, qkv

import fusionguard
from fusionguard import _testing
from fusionguard import torch_internals as ti
from fusionguard.core import state as _state
from fusionguard.core.registry import Hook, Patch, PatchRegistry
from fusionguard.eventlog import crash


def _host_slots() -> dict:
    """The host-visible objects fusionguard replaces or adds to, read directly."""
    from torch._dynamo.callback import callback_handler

    op, op_bw, autograd = ti.hop("flex_attention"), ti.hop("flex_attention_backward"), vars(ti.autograd_op())
    slots = {
        "dense forward kernel": op.py_kernels.get(ti.dense_key()),
        "dense backward kernel": op_bw.py_kernels.get(ti.dense_key()),
        "FlexAttentionAutogradOp": (autograd["forward"], autograd["backward"]),
        "inductor lowerings": [
            ti.lowerings().get(o) for o in (torch.ops.higher_order.flex_attention, torch.ops.higher_order.flex_attention_backward)
        ],
        "CompiledFxGraph.post_compile": vars(ti.compiled_fx_graph())["post_compile"],
        "TORCH_LOGS=fusionguard": ti.torch_log_registered("fusionguard"),
        "sys.excepthook": sys.excepthook,
        "threading.excepthook": threading.excepthook,
        "signal.SIGTERM": signal.getsignal(signal.SIGTERM),
        "OptimizedModule.__init__": vars(ti.optimized_module())["__init__"],
        "dynamo log handlers": list(logging.getLogger("torch._dynamo.convert_frame").handlers),
        "dynamo end callbacks": list(callback_handler.end_callbacks),
    }
    cls, name = ti.flex_trace_method()
    slots["Dynamo's FlexAttention tracing (recompile pressure)"] = vars(cls)[name]
    mod = ti.public_module()
    if mod is not None and "setup_compilation_env" in mod.__dict__:
        slots["setup_compilation_env"] = mod.__dict__["setup_compilation_env"]
    return slots


def _same(a: object, b: object) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


def test_every_registry_entry_is_undone_by_disable(guard, dynamo_reset):
    before = _host_slots()
    assert not before["TORCH_LOGS=fusionguard"], "torch._logging knows fusionguard before enable(): an earlier test left it"
    guard()
    q, k, v = qkv()
    torch.compile(PUBLIC.flex_attention)(q, k, v)  # a compiled graph whose callable gets counted
    entries = _state.STATE.patches.entries()
    names = {e.name for e in entries}
    expected = {
        "crash: recording",
        "sys.excepthook",
        "threading.excepthook",
        "signal.SIGTERM",
        "OptimizedModule.__init__",
        "logging:torch._dynamo.convert_frame",
        "torch._dynamo.callback.on_compile_end",
        "inductor.CompiledFxGraph.post_compile",
        "FlexAttentionAutogradOp.forward",
        "FlexAttentionAutogradOp.backward",
        "flex_attention.CompositeExplicitAutograd",
        "flex_attention_backward.CompositeExplicitAutograd",
        "torch._logging.register_log(fusionguard)",
        f"FlexAttentionHigherOrderVariable.{ti.flex_trace_method()[1]}",
    }
    if "setup_compilation_env" in before:
        expected.add("flex_attention.setup_compilation_env")
    assert expected <= names, expected - names
    assert any(n.startswith("graph ") for n in names), "the compiled graph's callable is not in the registry"
    during = _host_slots()
    assert [k for k in before if _same(before[k], during[k])] == []
    assert not any(e.restored() for e in entries)

    fusionguard.disable()
    assert _state.STATE.patches.entries() == []
    assert not _testing.crash_hooks_installed() and crash.CRASH.emit is None  # (by its entry: nothing runs after the registry)
    unrestored = [e.name for e in entries if not e.restored()]
    assert unrestored == []
    after = _host_slots()
    assert [k for k in before if not _same(before[k], after[k])] == []
    for e in entries:  # removing twice does nothing
        e.remove()
        assert e.restored(), e.name


def test_hook_entries_undo_once():
    calls = []
    reg = PatchRegistry()
    assert reg.add_hook("h", lambda: calls.append(1), lambda: bool(calls))
    assert not reg.add_hook("h", lambda: calls.append(2), lambda: True)  # a known name is left alone
    table = {"x": 1}
    reg.apply("p", table, "x", lambda orig: orig + 1)
    assert reg.names() == ["p"] and [type(e) for e in reg.entries()] == [Hook, Patch]
    reg.remove("h")
    reg.remove("h")
    reg.remove_all()
    reg.remove_all()
    assert calls == [1] and table == {"x": 1} and reg.entries() == []


def test_reenable_after_a_host_replaced_our_excepthook(guard):
    original = sys.excepthook
    guard()

    def theirs(*args):
        pass

    sys.excepthook = theirs  # the host installs its own on top of ours
    try:
        guard()  # ours goes back on top of theirs, and its undo is the registry's entry
        assert sys.excepthook is crash._sys_hook and crash.CRASH.prev_sys is theirs
        fusionguard.disable()
        assert sys.excepthook is theirs
    finally:
        sys.excepthook = original
