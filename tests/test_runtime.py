"""enable()'s settings travel by call (#24): one frozen ``Runtime`` per enable(), held by the one
holder the installed wrappers close over (``STATE.runtime``), swapped in one assignment by a
second enable(), back to the defaults at disable(). Proved with real threads making real eager
FlexAttention calls and mask builds while another thread calls enable() with other options."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
from collections import Counter

import pytest
import torch
from conftest import PUBLIC as FLEX
from conftest import causal, op_args, qkv
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard
from fusionguard import _testing
from fusionguard import torch_internals as ti
from fusionguard.core import state as _state
from fusionguard.core.config import Runtime
from fusionguard.errors import DenseFallbackError, DenseFallbackWarning

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore::fusionguard.DenseFallbackWarning"),
]


def _dense_wrapper():
    return ti.hop("flex_attention").py_kernels[ti.dense_key()]


def test_enable_builds_one_frozen_runtime_that_the_wrappers_close_over(guard):
    holder = _state.STATE.runtime
    guard(strict=True, mask_limit=123, recompile_warn_at=5, fsync="always")
    first = holder.now
    assert first == Runtime(enabled=True, strict=True, mode="strict", fsync="always", rescue=False, mask_limit=123, recompile_warn_at=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.strict = False  # type: ignore[misc]
    wrapper = _dense_wrapper()
    assert inspect.getclosurevars(wrapper).nonlocals["runtime"] is holder  # no global lookup per call
    q, k, v = qkv()
    with torch.no_grad(), pytest.raises(DenseFallbackError) as blocked:
        flex_attention(q, k, v)
    assert (blocked.value.event["mode"], blocked.value.event["action"]) == ("strict", "raise")

    guard(mode="warn")  # a second enable(): new settings, the same wrappers (nothing reinstalled)
    assert _dense_wrapper() is wrapper and _state.STATE.runtime is holder
    # (what it does not name stays: #32 point 10)
    assert holder.now is not first and (holder.now.strict, holder.now.mode, holder.now.mask_limit) == (False, "warn", 123)
    assert first.strict and first.mask_limit == 123  # the old object is never changed
    with torch.no_grad(), pytest.warns(DenseFallbackWarning):
        flex_attention(q, k, v)
    assert [(e["mode"], e["action"]) for e in fusionguard.events("flex_call")][-2:] == [("strict", "raise"), ("warn", "warn")]

    fusionguard.disable()  # nothing of this enable()'s options stays behind
    assert _state.STATE.runtime is holder and holder.now == Runtime()
    logged = len(fusionguard.events())
    with torch.no_grad():
        wrapper(*op_args(q, k, v))  # a wrapper someone still holds: the original call, no check
    assert len(fusionguard.events()) == logged
    _testing.reset_for_tests()
    assert _state.STATE.runtime is holder and holder.now == Runtime()


def test_on_or_off_is_part_of_the_one_runtime_read(guard):
    """#33: a wrapper reads on/off and the settings from one object (``runtime.now``): switching the
    runtime's ``enabled`` (the benchmarks' ``set_guarding``) turns every wrapper into a pass-through,
    settings kept, and ``is_enabled()`` follows it."""
    holder = _state.STATE.runtime
    assert not holder.now.enabled and not fusionguard.is_enabled()
    guard(strict=True)
    assert holder.now.enabled and fusionguard.is_enabled()
    q, k, v = qkv()
    _testing.set_guarding(False)
    try:
        assert not holder.now.enabled and holder.now.strict and not fusionguard.is_enabled()
        with torch.no_grad():
            flex_attention(q, k, v)  # strict, but off: PyTorch's own call, nothing checked
        assert fusionguard.events("flex_call") == []
    finally:
        _testing.set_guarding(True)
    assert holder.now.enabled and holder.now.strict and fusionguard.is_enabled()
    with torch.no_grad(), pytest.raises(DenseFallbackError):
        flex_attention(q, k, v)
    fusionguard.disable()
    assert holder.now == Runtime() and not holder.now.enabled and not fusionguard.is_enabled()


STRICT = {"strict": True, "mask_limit": 0}  # every mask build over the limit: blocked
WARN = {"mode": "warn", "mask_limit": 1 << 60}  # every mask build under it: logged only
WORKERS = 3
ROUNDS = 60  # per worker: one dense call and one mask build each


def _enable_during(call, code, options):
    """Run ``call`` in a worker thread; when its check reaches ``code`` (a profile hook sees the
    call), this thread calls ``enable(**options)`` while the worker waits, then the worker goes
    on: a second enable() landing in the middle of a call, every time. -> what the worker got."""
    asked, swapped = threading.Event(), threading.Event()
    out: dict = {}

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is code and not asked.is_set():
            asked.set()
            swapped.wait(30)

    def work():
        sys.setprofile(hook)
        try:
            with torch.no_grad():
                call()
            out["ran"] = True
        except DenseFallbackError as err:
            out["error"] = err.event
        except BaseException as exc:
            out["failure"] = repr(exc)
        finally:
            sys.setprofile(None)

    worker = threading.Thread(target=work, name="fg-runtime-mid")
    worker.start()
    try:
        assert asked.wait(30), f"the check never reached {code.co_name}"
        fusionguard.enable(**options)
    finally:
        swapped.set()
        worker.join(30)
    assert not worker.is_alive() and "failure" not in out, out
    return out


def test_an_enable_in_the_middle_of_a_call_decides_only_the_next_call(guard):
    """Another thread's enable() lands while a dense call is being checked (at its memory
    prediction, before its verdict) and while a mask build is (at its size estimate, before its
    limit and verdict): that call is decided wholly by the settings it started with, the next
    one wholly by the new ones."""
    from fusionguard.dense import memory

    common = {"keep_all": True, "fsync": False}
    log = str(guard(**common, **STRICT))
    q, k, v = qkv()
    got = _enable_during(lambda: flex_attention(q, k, v), memory.predict_dense.__code__, {"log_path": log, **common, **WARN})
    assert (got["error"]["mode"], got["error"]["action"], got["error"].get("blocked_by")) == ("strict", "raise", None)
    assert _state.STATE.runtime.now.mode == "warn"
    with torch.no_grad():
        flex_attention(q, k, v)  # the next call: warn, as set
    assert [(e["mode"], e["action"]) for e in fusionguard.events("flex_call")] == [("strict", "raise"), ("warn", "warn")]

    build = lambda: create_block_mask(causal, 1, 1, 16, 16, device="cpu")  # noqa: E731
    got = _enable_during(build, memory.mask_build_bytes.__code__, {"log_path": log, **common, **STRICT})
    assert got == {"ran": True}  # started under warn with a huge limit: logged, never blocked
    with torch.no_grad(), pytest.raises(DenseFallbackError) as blocked:
        build()  # the next build: strict, limit 0
    assert [(e["mode"], e["mask_limit"], e["action"]) for e in fusionguard.events("mask_build")] == [
        ("warn", 1 << 60, "log"),
        ("strict", 0, "raise"),
    ]
    assert blocked.value.event["seq"] == fusionguard.events("mask_build")[-1]["seq"]


def test_a_second_enable_from_another_thread_never_mixes_two_option_sets(guard):
    """Worker threads make real eager flex_attention calls (dense on CPU) and eager
    dense mask builds (the module's ``create_mask``, the function fusionguard wraps and
    ``create_block_mask`` calls) while the main thread calls enable() again and again, alternating
    strict with mask_limit=0 and warn with a huge mask_limit. Every call must be decided by one
    option set: the mode its event records, its action, its mask_limit and what the thread got
    (DenseFallbackError or a normal return) all agree; a torn read (the strict verdict and the warn
    mode's oom label, the strict limit with the warn action) is a failure. The switch interval is
    cut to a microsecond so that threads change over inside the wrappers.
    (Not ``create_block_mask`` in the threads, nor flex_attention without a block mask: both reach
    ``torch.fx.traceback.annotate``, which edits one process-wide dict, and threads racing there
    raised PyTorch's own ``KeyError('custom')``, fusionguard uninvolved.)"""
    q0, k0, v0 = qkv()
    with torch.no_grad():  # PyTorch's own eager wrappers warmed up before the guard is on
        block_mask = create_block_mask(causal, 1, 1, 16, 16, device="cpu")
        flex_attention(q0, k0, v0, block_mask=block_mask)
        FLEX.create_mask(causal, 1, 1, 16, 16, device="cpu")
    common = {"keep_all": True, "max_events": 1_000_000, "fsync": False}
    log = guard(**common, **STRICT)
    start = threading.Barrier(WORKERS + 1)
    done = threading.Event()
    failures: list = []
    got: dict = {}  # thread name -> [(kind, "raised" / "ran", the error's event or None)]

    def work(index: int) -> None:
        name = threading.current_thread().name
        out = got.setdefault(name, [])
        q, k, v = qkv(seed=index)
        try:
            start.wait(timeout=30)
            for _ in range(ROUNDS):
                with torch.no_grad():
                    try:
                        flex_attention(q, k, v, block_mask=block_mask)
                        out.append(("flex", "ran", None))
                    except DenseFallbackError as err:
                        out.append(("flex", "raised", err.event))
                    try:
                        FLEX.create_mask(causal, 1, 1, 16, 16, device="cpu")
                        out.append(("mask", "ran", None))
                    except DenseFallbackError as err:
                        out.append(("mask", "raised", err.event))
        except BaseException as exc:  # reported in the test's thread
            failures.append((name, repr(exc)))

    threads = [threading.Thread(target=work, args=(n,), name=f"fg-runtime-{n}") for n in range(WORKERS)]
    old_interval = sys.getswitchinterval()
    enables = 0
    try:
        for t in threads:
            t.start()
        sys.setswitchinterval(1e-6)
        start.wait(timeout=30)
        while any(t.is_alive() for t in threads):
            fusionguard.enable(log_path=str(log), **common, **(WARN if enables % 2 == 0 else STRICT))
            enables += 1
        done.set()
    finally:
        sys.setswitchinterval(old_interval)
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert failures == []

    events = fusionguard.events()
    calls = [e for e in events if e["event"] == "flex_call" and e.get("path") == "dense"]
    builds = [e for e in events if e["event"] == "mask_build"]
    assert len(calls) == len(builds) == WORKERS * ROUNDS  # keep_all: every call and build logged

    # each event: one option set
    assert Counter((e["mode"], e["action"], e.get("blocked_by")) for e in calls).keys() <= {
        ("strict", "raise", None),
        ("warn", "warn", None),
    }
    assert Counter((e["mode"], e["mask_limit"], e["action"]) for e in builds).keys() <= {("strict", 0, "raise"), ("warn", 1 << 60, "log")}

    # what each thread got is what its event says
    for kind, logged in (("flex", calls), ("mask", builds)):
        outcomes = [o for out in got.values() for o in out if o[0] == kind]
        raised = [ev for _, what, ev in outcomes if what == "raised"]
        assert all(ev["mode"] == "strict" and ev["action"] == "raise" for ev in raised), kind
        assert {ev["seq"] for ev in raised} == {e["seq"] for e in logged if e["action"] == "raise"}, kind
        assert sum(what == "ran" for _, what, _ in outcomes) == sum(e["action"] != "raise" for e in logged), kind

    # both option sets were in force, and they changed under running workers many times
    for logged in (calls, builds):
        modes = Counter(e["mode"] for e in logged)
        assert modes["strict"] >= 10 and modes["warn"] >= 10, modes
    by_thread: dict = {}
    for e in calls:
        by_thread.setdefault(e["thread"], []).append(e["mode"])
    changes = sum(sum(a != b for a, b in zip(seq, seq[1:])) for seq in by_thread.values())
    assert enables >= 20 and changes >= 10, (enables, changes)
