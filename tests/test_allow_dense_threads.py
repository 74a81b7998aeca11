"""``allow_dense()`` allows exactly two things (issue #27, part 1): the dense calls made inside the
block, in its own thread or asyncio task; and the backward of a forward that was allowed, by the
verdict on that forward's autograd ctx, whatever thread runs it. Never another thread's calls: a
thread ``threading`` did not create (``_thread.start_new_thread``, a native or C-extension worker)
is no exception. Real threads, a real backward through the operator call (CPU), real asyncio.
The CUDA side (autograd's device threads) is in tests/gpu/test_allow_dense_threads_cuda.py.
"""

from __future__ import annotations

import _thread
import asyncio
import contextvars
import gc
import threading
import weakref

import pytest
import torch
from conftest import PUBLIC, causal, flex_events, op_call, qkv
from torch.nn.attention.flex_attention import flex_attention

import fusionguard

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def in_native_thread(fn):
    """Run ``fn()`` on a thread made by ``_thread.start_new_thread`` (``threading`` knows it only
    as a dummy): what it returned, or the exception it raised."""
    box = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test's thread
            box["error"] = exc
        finally:
            done.set()

    _thread.start_new_thread(run, ())
    assert done.wait(120), "the native thread hung"
    return box


class HeldOpen:
    """Another ``threading.Thread`` that sits inside ``allow_dense()`` until released: the
    reference computation of the issue's report."""

    def __init__(self):
        self.inside = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._hold, name="fg-holds-allow-dense")

    def _hold(self):
        with fusionguard.allow_dense():
            self.inside.set()
            self.release.wait(120)

    def __enter__(self):
        self.thread.start()
        assert self.inside.wait(30)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def dense_forward():
    q, k, v = qkv()
    with torch.no_grad():
        flex_attention(q, k, v)
    return "ran"


def test_a_native_thread_is_blocked_while_another_thread_holds_allow_dense(guard, math_spy):
    guard(strict=True)
    with HeldOpen():
        got = in_native_thread(dense_forward)
    assert isinstance(got.get("error"), fusionguard.DenseFallbackError), got
    assert math_spy == [], "the dense math ran in a thread that never entered allow_dense()"
    (event,) = flex_events()
    assert (event["action"], event["allowed"]) == ("raise", False)


def test_a_native_thread_is_allowed_inside_its_own_block(guard, math_spy):
    guard(strict=True)

    def own_block():
        with fusionguard.allow_dense():
            return dense_forward()

    assert in_native_thread(own_block) == {"value": "ran"}
    assert len(math_spy) == 1
    assert [e["action"] for e in flex_events()] == ["allow"]
    with pytest.raises(fusionguard.DenseFallbackError):  # and nothing is left open behind it
        dense_forward()


def test_the_backward_of_an_allowed_forward_is_allowed_on_any_thread(guard, math_spy):
    guard(strict=True)
    q, k, v = qkv(requires_grad=True)
    with fusionguard.allow_dense():
        out, *_ = op_call(q, k, v)
    got = in_native_thread(lambda: out.sum().backward())  # no block open anywhere
    assert "error" not in got, got
    assert q.grad is not None and len(math_spy) == 2
    fwd, bwd = flex_events()
    assert (fwd["action"], bwd["action"]) == ("allow", "allow")
    assert bwd["forward_seq"] == fwd["seq"]
    assert bwd["thread"] != fwd["thread"]


def test_the_backward_of_an_unallowed_forward_is_blocked_on_a_native_thread(guard, math_spy):
    """A forward that warned (not allowed), then strict mode: its backward, run by a native
    thread while another thread holds allow_dense() open, is blocked."""
    guard(strict=False)
    q, k, v = qkv(requires_grad=True)
    with pytest.warns(fusionguard.DenseFallbackWarning):
        out, *_ = op_call(q, k, v)
    guard(strict=True)
    with HeldOpen():
        got = in_native_thread(lambda: out.sum().backward())
    assert isinstance(got.get("error"), fusionguard.DenseFallbackError), got
    assert len(math_spy) == 1 and q.grad is None
    assert [e["action"] for e in flex_events()] == ["warn", "raise"]


def test_a_backward_with_no_forward_record_is_blocked_on_a_native_thread(guard, math_spy):
    """The forward ran before enable(): no verdict on its ctx. Another thread's open block must
    not allow its backward (it did: the old rule for threads ``threading`` did not create)."""
    q, k, v = qkv(requires_grad=True)
    out, *_ = op_call(q, k, v)
    guard(strict=True)
    with HeldOpen():
        got = in_native_thread(lambda: out.sum().backward())
    assert isinstance(got.get("error"), fusionguard.DenseFallbackError), got
    assert len(math_spy) == 1 and q.grad is None
    (event,) = flex_events()
    assert (event["phase"], event["action"]) == ("backward", "raise")


def test_a_backward_run_inside_the_block_on_its_thread_is_allowed(guard, math_spy):
    """A call made inside the block: the backward that this thread runs there (CPU autograd runs
    it on the calling thread), whatever its forward's verdict."""
    q, k, v = qkv(requires_grad=True)
    out, *_ = op_call(q, k, v)
    guard(strict=True)
    with fusionguard.allow_dense():
        out.sum().backward()
    assert q.grad is not None and len(math_spy) == 2
    assert [e["action"] for e in flex_events()] == ["allow"]


def test_an_aot_compiled_backward_follows_its_forwards_verdict_on_any_thread(guard, math_spy, dynamo_reset):
    """AOTAutograd (aot_eager) compiles the backward: no FlexAttentionAutogradOp ctx carries the
    forward's verdict there; the allowed forward's own logsumexp, which that backward receives,
    does. Run on a native thread with no block open: allowed; an unallowed forward's: blocked."""
    attend = torch.compile(lambda q, k, v: op_call(q, k, v)[0], backend="aot_eager")
    guard(strict=True)
    q, k, v = qkv(requires_grad=True)
    with fusionguard.allow_dense():
        out = attend(q, k, v)
    got = in_native_thread(lambda: out.sum().backward())
    assert "error" not in got, got
    assert q.grad is not None and len(math_spy) == 2
    fwd, bwd = flex_events()
    assert (fwd["phase"], fwd["action"], fwd["traced"]) == ("forward", "allow", True)
    assert (bwd["phase"], bwd["action"], bwd["traced"]) == ("backward", "allow", True)

    guard(strict=False)
    q2, k2, v2 = qkv(requires_grad=True, seed=1)
    with pytest.warns(fusionguard.DenseFallbackWarning):
        out2 = attend(q2, k2, v2)
    guard(strict=True)
    with HeldOpen():
        got = in_native_thread(lambda: out2.sum().backward())
    assert isinstance(got.get("error"), fusionguard.DenseFallbackError), got
    assert len(math_spy) == 3 and q2.grad is None
    assert [e["action"] for e in flex_events()][2:] == ["warn", "raise"]


def test_the_marks_of_allowed_forwards_keep_nothing_alive(guard):
    """The weak marks die with the forward's tensors: no memory held, no stale mark left."""
    from fusionguard.dense import guard as guard_module

    guard(strict=True)
    gc.collect()
    before = len(guard_module._ALLOWED_FORWARDS)  # (marks of tensors other tests still hold)
    q, k, v = qkv(requires_grad=True)
    with fusionguard.allow_dense():
        out, lse, *_ = op_call(q, k, v)
    assert len(guard_module._ALLOWED_FORWARDS) == before + 1
    gone = weakref.ref(lse)
    del out, lse, _
    gc.collect()
    assert gone() is None and len(guard_module._ALLOWED_FORWARDS) == before


# -- asyncio: a block entered in one context and left in another -------------------------------


async def allowing_fixture():
    """The shape of an async yield fixture: set-up and teardown run in different tasks."""
    with fusionguard.allow_dense():
        yield


def test_a_block_left_in_another_asyncio_context_raises_nothing_and_ends(guard, math_spy):
    guard(strict=True)
    setup_ctx = contextvars.copy_context()
    outcomes = []

    async def call():
        try:
            dense_forward()
            outcomes.append("ran")
        except fusionguard.DenseFallbackError:
            outcomes.append("blocked")

    async def main():
        fixture = allowing_fixture()
        await asyncio.create_task(anext(fixture), context=setup_ctx)  # enter, in setup's context
        await asyncio.create_task(call(), context=setup_ctx)  # inside the block: allowed
        with pytest.raises(StopAsyncIteration):  # teardown in a context of its own
            await asyncio.create_task(anext(fixture), context=contextvars.copy_context())
        await asyncio.create_task(call(), context=setup_ctx)  # after the block: blocked again
        await asyncio.create_task(call())

    asyncio.run(main())
    assert outcomes == ["ran", "blocked", "blocked"]
    assert len(math_spy) == 1
    assert [e["action"] for e in flex_events()] == ["allow", "raise", "raise"]


def test_tasks_see_only_their_own_blocks(guard, math_spy):
    """A task's block allows that task's calls (and a thread it hands work to with
    asyncio.to_thread, which copies its context) while open; a sibling task is blocked; a
    child task that outlives the block is blocked once the block is closed."""
    guard(strict=True)
    outcomes = {}

    async def attempt(name, fn=dense_forward):
        try:
            fn()
            outcomes[name] = "ran"
        except fusionguard.DenseFallbackError:
            outcomes[name] = "blocked"

    async def main():
        opened, closed = asyncio.Event(), asyncio.Event()
        late = {}

        async def holder():
            with fusionguard.allow_dense():
                await attempt("holder")
                outcomes["to_thread"] = await asyncio.to_thread(dense_forward)
                late["task"] = asyncio.create_task(wait_then(closed, "late child"))
                opened.set()
                await asyncio.sleep(0.01)
            closed.set()

        async def wait_then(event, name):
            await event.wait()
            await attempt(name)

        async def sibling():
            await opened.wait()
            await attempt("sibling")

        await asyncio.gather(holder(), sibling())
        await late["task"]

    asyncio.run(main())
    assert outcomes == {"holder": "ran", "to_thread": "ran", "sibling": "blocked", "late child": "blocked"}
    assert len(math_spy) == 2


def test_nested_blocks_and_an_inner_one_left_elsewhere(guard, math_spy):
    """Leaving an inner block in another context closes that block only: the outer one still
    allows, and closing it ends the allowance."""
    guard(strict=True)
    outer = fusionguard.allow_dense()
    outer.__enter__()
    try:
        inner = fusionguard.allow_dense()
        inner.__enter__()
        contextvars.copy_context().run(inner.__exit__, None, None, None)  # left elsewhere
        dense_forward()  # the outer block is still open
    finally:
        outer.__exit__(None, None, None)
    with pytest.raises(fusionguard.DenseFallbackError):
        dense_forward()
    assert [e["action"] for e in flex_events()] == ["allow", "raise"]


# -- a checkpoint re-run forward blocked on a thread autograd (not Python) started -------------

HINT = "torch.autograd.set_multithreading_enabled(False)"


def checkpointed_step():
    """A forward under non-reentrant activation checkpointing inside the block, its backward
    after the block: the backward re-runs the dense forward outside any block."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = qkv(requires_grad=True)
    with fusionguard.allow_dense():
        out = checkpoint(lambda q, k, v: op_call(q, k, v)[0], q, k, v, use_reentrant=False)
    out.sum().backward()
    return "ran"


def test_a_recompute_blocked_on_a_native_thread_names_the_single_threaded_backward(guard, math_spy):
    """On CUDA the re-run happens on autograd's device thread, which Python did not create; here
    the same event on CPU, from a ``_thread.start_new_thread`` thread (autograd runs a CPU
    backward on the calling thread): the error says how to run that backward inside the block."""
    guard(strict=True)
    got = in_native_thread(checkpointed_step)
    error = got.get("error")
    assert isinstance(error, fusionguard.DenseFallbackError), got
    assert len(math_spy) == 1, "the re-run forward's dense math ran"
    fwd, rerun = flex_events()
    assert (fwd["action"], rerun["action"], rerun["phase"]) == ("allow", "raise", "forward")
    assert rerun["recompute"] is True and rerun["native_thread"] is True
    assert HINT in str(error) and "activation checkpointing" in str(error)
    assert "to let this call run dense on purpose: `with fusionguard.allow_dense(): ...`" not in str(error)
    assert error.event["native_thread"] is True


def test_a_recompute_blocked_on_a_python_thread_keeps_the_plain_hint(guard, math_spy):
    """The same re-run on a thread ``threading`` knows (this test's): not autograd's own thread,
    so the message keeps the usual hint and the event has no ``native_thread``."""
    guard(strict=True)
    with pytest.raises(fusionguard.DenseFallbackError) as info:
        checkpointed_step()
    rerun = flex_events()[-1]
    assert rerun["recompute"] is True and "native_thread" not in rerun
    assert HINT not in str(info.value)
    assert "`with fusionguard.allow_dense(): ...`" in str(info.value)


# -- create_block_mask follows the same rule (issue #25 part 2 guard, fixed after #27) ---------

MASK_LIMIT = 200_000  # bytes: a 256 x 256 block mask (655 KB estimated) is above it


def dense_mask():
    PUBLIC.create_block_mask(causal, 1, 1, 256, 256, device="cpu")
    return "ran"


def mask_actions():
    return [e["action"] for e in fusionguard.events("mask_build")]


def test_a_mask_build_in_a_context_copied_inside_a_block_closed_elsewhere_is_blocked(guard):
    """The block is entered in one context and left in another: the first context still holds
    the (closed) block, which must allow nothing there any more."""
    guard(strict=True, mask_limit=MASK_LIMIT)
    setup_ctx = contextvars.copy_context()
    outcomes = []

    def call():
        try:
            outcomes.append(dense_mask())
        except fusionguard.DenseFallbackError:
            outcomes.append("blocked")

    async def main():
        fixture = allowing_fixture()
        await asyncio.create_task(anext(fixture), context=setup_ctx)
        setup_ctx.run(call)  # inside the open block: allowed
        with pytest.raises(StopAsyncIteration):
            await asyncio.create_task(anext(fixture), context=contextvars.copy_context())
        setup_ctx.run(call)  # the context still holds the closed block: blocked

    asyncio.run(main())
    assert outcomes == ["ran", "blocked"]
    assert mask_actions() == ["allow", "raise"]


def test_a_task_created_in_a_block_that_builds_a_mask_after_it_closed_is_blocked(guard):
    guard(strict=True, mask_limit=MASK_LIMIT)
    outcomes = {}

    async def attempt(name):
        try:
            outcomes[name] = dense_mask()
        except fusionguard.DenseFallbackError:
            outcomes[name] = "blocked"

    async def main():
        closed = asyncio.Event()

        async def late():
            await closed.wait()
            await attempt("late task")

        with fusionguard.allow_dense():
            await attempt("inside")
            task = asyncio.create_task(late())  # copies the context: holds the block
        closed.set()
        await task

    asyncio.run(main())
    assert outcomes == {"inside": "ran", "late task": "blocked"}
    assert mask_actions() == ["allow", "raise"]


def test_a_mask_build_on_another_thread_is_blocked_while_a_block_is_open(guard):
    guard(strict=True, mask_limit=MASK_LIMIT)
    with HeldOpen():
        got = in_native_thread(dense_mask)
    assert isinstance(got.get("error"), fusionguard.DenseFallbackError), got
    assert mask_actions() == ["raise"]
