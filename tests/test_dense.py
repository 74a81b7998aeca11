"""Dense executions on CPU: seen, logged durably, raised before the math runs, bit-identical."""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings

import forkserver
import pytest
import torch
from conftest import PUBLIC, causal, child_env, flex_events, in_own_process, op_call, qkv, read_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard
from fusionguard import _testing

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

FIELDS = (
    "event",
    "phase",
    "path",
    "traced",
    "cause",
    "layer",
    "q_shape",
    "kv_shape",
    "dtype",
    "device",
    "scores_bytes",
    "ts",
    "seq",
    "pid",
    "rank",
    "thread",
)


def test_eager_call_is_logged_and_warned(guard):
    log = guard()
    q, k, v = qkv(L=16, KV=24, HQ=4, HKV=2)
    with pytest.warns(fusionguard.DenseFallbackWarning, match="dense FlexAttention forward") as rec:
        line = sys._getframe().f_lineno + 1
        flex_attention(q, k, v, enable_gqa=True)
    ours = [w for w in rec if issubclass(w.category, fusionguard.DenseFallbackWarning)]
    assert (ours[0].filename, ours[0].lineno) == (__file__, line), "the warning points at the user's line"
    (event,) = flex_events()
    for key in FIELDS:
        assert key in event, key
    assert event["phase"] == "forward" and event["path"] == "dense"
    assert event["traced"] is False and event["cause"] == "eager_call"
    assert event["q_shape"] == [1, 4, 16, 8] and event["kv_shape"] == [1, 2, 24, 8]
    assert event["scores_bytes"] == 1 * 4 * 16 * 24 * 4
    assert event["call_site"]["file"] == __file__
    assert event["action"] == "warn" and event["allowed"] is False
    on_disk = [e for e in read_jsonl(log) if e["event"] == "flex_call"]
    assert on_disk[0]["seq"] == event["seq"]


def test_every_dense_call_is_logged_not_once_per_process(guard):
    guard()
    q, k, v = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            flex_attention(q, k, v)
    assert len(flex_events()) == 3


def test_strict_raises_before_the_dense_math_runs(guard, math_spy):
    log = guard(strict=True)
    q, k, v = qkv(L=32)
    with pytest.raises(fusionguard.DenseFallbackError) as err:
        flex_attention(q, k, v)
    assert math_spy == [], "the dense math ran although strict mode raised"
    text = str(err.value)
    assert text.splitlines()[0].startswith("fusionguard: dense FlexAttention forward blocked")
    assert f"{__file__}:" in text and "cause:    eager_call" in text and "fix:" in text
    assert "8.19 KB" in text  # 1*2*32*32*4 = 8192 bytes
    assert err.value.event["cause"] == "eager_call"
    # the event was on disk before the raise
    assert [e["action"] for e in read_jsonl(log) if e["event"] == "flex_call"] == ["raise"]


def test_warn_mode_runs_the_dense_math(guard, math_spy):
    guard()
    q, k, v = qkv()
    with pytest.warns(fusionguard.DenseFallbackWarning):
        flex_attention(q, k, v)
    assert len(math_spy) == 1


def test_allow_dense_lets_strict_mode_run(guard, math_spy):
    guard(strict=True)
    q, k, v = qkv()
    with fusionguard.allow_dense():
        flex_attention(q, k, v)
    (event,) = flex_events()
    assert event["allowed"] is True and event["action"] == "allow"
    assert len(math_spy) == 1
    with pytest.raises(fusionguard.DenseFallbackError):
        flex_attention(q, k, v)


def test_operator_with_grad_logs_forward_and_backward_once_each(guard, math_spy):
    guard()
    q, k, v = qkv(requires_grad=True)
    with pytest.warns(fusionguard.DenseFallbackWarning):
        out, lse, *_ = op_call(q, k, v)
        out.sum().backward()
    fwd, bwd = flex_events()
    assert (fwd["phase"], bwd["phase"]) == ("forward", "backward")
    assert fwd["autograd"] is True and bwd["autograd"] is True
    assert bwd["forward_seq"] == fwd["seq"]
    assert bwd["cause"] == fwd["cause"] == "eager_call"
    assert bwd["call_site"] == fwd["call_site"]
    assert q.grad is not None and len(math_spy) == 2


def test_strict_backward_raises_before_the_dense_backward(guard, math_spy):
    guard(strict=True)
    q, k, v = qkv(requires_grad=True)
    with fusionguard.allow_dense():
        out, *_ = op_call(q, k, v)
    out.sum().backward()  # allowed: the forward was allowed
    assert [e["action"] for e in flex_events()] == ["allow", "allow"]
    fusionguard.enable(strict=True, log_path=False)
    q2, k2, v2 = qkv(requires_grad=True, seed=1)
    with pytest.raises(fusionguard.DenseFallbackError):
        op_call(q2, k2, v2)
    assert len(math_spy) == 2


def test_strict_backward_of_an_unguarded_forward(guard, math_spy):
    """Forward ran before enable(strict=True): the backward is still stopped before its math."""
    q, k, v = qkv(requires_grad=True)
    out, *_ = op_call(q, k, v)
    guard(strict=True)
    with pytest.raises(fusionguard.DenseFallbackError, match="dense FlexAttention backward"):
        out.sum().backward()
    assert len(math_spy) == 1  # the forward only


@settings(max_examples=12, deadline=None)
@given(
    b=st.integers(1, 2),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    d=st.sampled_from([4, 8, 16]),
    transpose=st.booleans(),
)
def test_results_are_bit_identical_with_the_guard(b, hkv, group, q_len, kv_len, d, transpose):
    q = torch.randn(b, hkv * group, q_len, d)
    k = torch.randn(b, hkv, kv_len, d)
    v = torch.randn(b, hkv, kv_len, d)
    if transpose:  # odd layout: non-contiguous inputs
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    kw = dict(enable_gqa=group > 1)
    plain = flex_attention(q, k, v, **kw)
    fusionguard.enable(log_path=False)  # (not the guard fixture: hypothesis runs every example in one test)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            guarded = flex_attention(q, k, v, **kw)
        events = flex_events()
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()  # as the guard fixture does: events() spans enable() cycles, a process's history
    assert torch.equal(plain, guarded)
    assert [e["q_shape"] for e in events] == [list(q.shape)]  # this example's call only
    assert fusionguard.events() == [], "left for the next test on this worker (3 flex_call events for 2 once)"


def test_gradients_are_bit_identical_with_the_guard(guard):
    q, k, v = qkv(requires_grad=True, HQ=4, HKV=2)
    out, *_ = op_call(q, k, v)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    guard()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out2, *_ = op_call(q, k, v)
        out2.square().sum().backward()
    assert torch.equal(out, out2)
    for g, t in zip(grads, (q, k, v)):
        assert torch.equal(g, t.grad)


def test_decode_shape_autocast_and_block_mask(guard):
    guard()
    q, k, v = qkv(L=1, KV=40)
    mask = create_block_mask(lambda b, h, qi, ki: ki <= 39, None, None, 1, 40, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_attention(q, k, v, block_mask=mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            flex_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    decode, auto = flex_events()
    assert decode["q_shape"][-2] == 1 and decode["scores_bytes"] == 1 * 2 * 1 * 40 * 4
    assert auto["dtype"] == "bfloat16"


def test_two_threads_at_once(guard):
    log = guard()
    errors = []

    def work(seed):
        try:
            q, k, v = qkv(seed=seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(5):
                    flex_attention(q, k, v)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), name=f"worker-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    events = [e for e in read_jsonl(log) if e["event"] == "flex_call"]
    assert len(events) == 10
    assert {e["thread"] for e in events} == {"worker-0", "worker-1"}
    assert len({e["seq"] for e in events}) == 10


def test_a_compile_on_another_thread_hides_no_dense_call(guard, dynamo_reset, math_spy):
    """``torch.compiler.is_compiling()`` is one process-wide flag, held True by Dynamo for the whole
    of a compile (2.13+) whatever thread compiles: the guard must not step aside on it. A compile
    held open on one thread (its backend waits) while this thread runs dense: still blocked."""
    log = guard(strict=True, mask_limit=1)
    q, k, v = qkv()
    with fusionguard.allow_dense(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_attention(q, k, v)  # flex's internal compile done here: the call below needs no compile
    math_spy.clear()
    inside, release = threading.Event(), threading.Event()

    def held(gm, example_inputs):
        inside.set()
        release.wait(60)
        return gm.forward

    compiled = torch.compile(lambda x: x * 2, backend=held)
    other = threading.Thread(target=compiled, args=(torch.ones(3),), name="compiling")
    other.start()
    try:
        assert inside.wait(60), "the other thread's compile never reached its backend"
        with pytest.raises(fusionguard.DenseFallbackError) as err:
            flex_attention(q, k, v)
        with pytest.raises(fusionguard.DenseFallbackError) as mask_err:
            PUBLIC.create_block_mask(causal, 1, 1, 64, 64, device="cpu")
    finally:
        release.set()
        other.join(60)
    assert math_spy == [], "the dense math ran although strict mode blocks it"
    assert err.value.event["cause"] == "eager_call" and err.value.event["thread"] == "MainThread"
    assert mask_err.value.event["action"] == "raise"
    on_disk = read_jsonl(log)
    assert [e["action"] for e in on_disk if e["event"] == "flex_call"] == ["allow", "raise"]
    assert [e["action"] for e in on_disk if e["event"] == "mask_build"] == ["raise"]


# Threads behind a barrier making their first eager call at once, each round in a fresh Dynamo
# (torch._dynamo.reset()): every thread compiles flex's internal wrapper, one after the other under
# Dynamo's compile lock, while the others already run dense. One line per round on stdout.
_FIRST_CALLS = r"""
import json, os, sys, threading, warnings
import torch
from torch.nn.attention.flex_attention import flex_attention
import fusionguard

hop = sys.modules["torch._higher_order_ops.flex_attention"]  # (the module: its package re-exports the operator by that name)

warnings.simplefilter("ignore")  # (not thread-safe to filter per thread; the log is what counts)
math = []
inner = hop._math_attention_inner

def spy(*args, **kwargs):  # counts real runs of the dense math; PyTorch's own function runs
    math.append(1)
    return inner(*args, **kwargs)

hop._math_attention_inner = spy
THREADS, CALLS = 2, {"warn": 5, "strict": 3}
for n, mode in enumerate(sys.argv[2:]):
    torch._dynamo.reset()
    log = os.path.join(sys.argv[1], f"{n}-{mode}.jsonl")
    fusionguard.enable(strict=mode == "strict", log_path=log)
    barrier = threading.Barrier(THREADS)
    outcomes = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
        barrier.wait()
        for _ in range(CALLS[mode]):
            try:
                flex_attention(q, k, v)
                outcomes.append("ran")
            except fusionguard.DenseFallbackError:
                outcomes.append("blocked")

    threads = [threading.Thread(target=work, args=(i,), name=f"worker-{i}") for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fusionguard.disable()
    print(json.dumps({"mode": mode, "log": log, "outcomes": sorted(outcomes), "math": len(math)}), flush=True)
    math.clear()
"""


def test_threads_making_their_first_dense_calls_at_once_are_all_logged_and_blocked(tmp_path):
    """The first eager call of each thread compiles flex's internal wrapper; a guard that stepped
    aside while *any* thread compiled (``is_compiling()``, process-wide) lost the other threads'
    calls meanwhile: missing from the log in warn mode, run dense in strict mode. Every round
    failed that way before the fix (2 threads, 5 or 3 calls each)."""
    rounds = ["warn", "strict"] * 3
    p = forkserver.run(  # (a process of its own, forked: torch imported, nothing compiled, no fusionguard)
        [sys.executable, "-c", _FIRST_CALLS, str(tmp_path), *rounds],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["mode"] for r in results] == rounds
    for r in results:
        calls = [e for e in read_jsonl(r["log"]) if e["event"] == "flex_call"]
        if r["mode"] == "warn":
            assert r["outcomes"] == ["ran"] * 10 and r["math"] == 10
            assert [e["action"] for e in calls] == ["warn"] * 10, f"{len(calls)} of 10 dense calls logged"
        else:
            assert r["outcomes"] == ["blocked"] * 6, "a dense call ran in strict mode"
            assert r["math"] == 0
            assert [e["action"] for e in calls] == ["raise"] * 6
        assert {e["thread"] for e in calls} == {"worker-0", "worker-1"}
        assert len({e["seq"] for e in calls}) == len(calls)


def test_nested_tensor_inputs_get_torchs_own_error_unchanged(guard):
    """torch 2.13 refuses NestedTensor inputs itself; the guard must not change that error."""
    guard(strict=True)

    def mk():
        parts = [torch.randn(5, 2, 8), torch.randn(7, 2, 8)]
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)

    q, k, v = mk(), mk(), mk()
    try:
        flex_attention(q, k, v)
    except Exception as exc:  # whatever torch raises, it must be torch's, not ours
        assert not isinstance(exc, fusionguard.DenseFallbackError) or exc.event.get("layout") == "nested"
    assert not fusionguard.events("internal_error")


@in_own_process
def test_dynamos_frame_hook_never_compiles_the_guard(guard, dynamo_reset):
    """After one call with Dynamo disabled, torch 2.7 runs flex_attention's internal
    ``torch.compile(fullgraph=True)`` wrapper uncompiled with Dynamo's frame hook still set (until
    the process ends): every frame below it not seen before is compiled with fullgraph=True. The
    guard's frames must run there as PyTorch's own do: every later call works and is reported."""
    q, k, v = qkv()
    with torch._dynamo.config.patch(disable=True):
        try:
            flex_attention(q, k, v)
        except RuntimeError:  # 2.13: "no compiled frames", PyTorch's own error
            pass
    torch._dynamo.reset()
    guard()

    def jagged():
        parts = [torch.randn(5, 2, 8), torch.randn(7, 2, 8)]
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_attention(q, k, v)
        try:  # 2.7 to 2.12 run it dense; 2.13+ refuse it (PyTorch's NotImplementedError), and so
            flex_attention(jagged(), jagged(), jagged())  # does 2.11 in this state (Dynamo's
        except (NotImplementedError, torch._dynamo.exc.Unsupported):  # Unsupported, with or without fusionguard)
            pass
        flex_attention(q, k, v)
    calls = flex_events()
    assert len(calls) in (2, 3) and calls[-1]["cause"] == "eager_call" and calls[-1].get("layout") is None
    assert all(e.get("layout") == "nested" for e in calls[1:-1])
    assert not fusionguard.events("internal_error")


@pytest.fixture
def fsync_spy(monkeypatch):
    """Counts os.fsync calls (and still makes them)."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    return synced


@pytest.mark.parametrize("fsync, expected", [(True, 1), ("always", 3), (False, 0)])
def test_repeated_dense_calls_are_fsynced_once_per_site(guard, fsync_spy, fsync, expected):
    """A repeat of an on-disk record is written (a killed process loses nothing) but not fsync-ed:
    an fsync costs more than 1 % of a dense call."""
    log = guard(fsync=fsync)
    q, k, v = qkv()
    fsync_spy.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            flex_attention(q, k, v)
    assert len(fsync_spy) == expected
    assert len([e for e in read_jsonl(log) if e["event"] == "flex_call"]) == 3


def test_fsync_option_is_validated():
    with pytest.raises(TypeError, match="fsync"):
        fusionguard.enable(fsync="sometimes")
    assert not fusionguard.is_enabled()


def test_turning_fsync_on_makes_known_sites_durable(guard, fsync_spy):
    """A site first seen with fsync off was never fsync-ed: turning it on must fsync it."""
    guard(fsync=False)
    q, k, v = qkv()
    fsync_spy.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fsync in (False, True):
            guard(fsync=fsync)
            flex_attention(q, k, v)  # same line both times
    assert len(fsync_spy) == 1


def test_warning_shows_once_per_line_under_the_default_filter(guard):
    """Python's default filter shows a warning once per code location: fusionguard's warning
    keeps that (the location's registry), so a training loop is not flooded."""
    guard()
    q, k, v = qkv(L=16, KV=24, HQ=4, HKV=2)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default", fusionguard.DenseFallbackWarning)
        for _ in range(3):
            flex_attention(q, k, v, enable_gqa=True)
        flex_attention(q, k, v, enable_gqa=True)  # another line: shown again
    ours = [w for w in rec if issubclass(w.category, fusionguard.DenseFallbackWarning)]
    assert [w.filename for w in ours] == [__file__, __file__]
    assert ours[0].lineno != ours[1].lineno


def _natural_lse(q, k):
    """The LSE by hand, in natural-log units: what `return_lse=True` documents."""
    return torch.logsumexp((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)


def test_flash_backend_lse_on_the_dense_path_is_warned_where_wrong(guard):
    """#35: a dense call with BACKEND="FLASH" returns its LSE in log2 units where PyTorch's top level
    expects natural log for FLASH (torch 2.13 CPU: 1.4427x). Warned at the call, with the factor
    measured, whenever the LSE really is wrong; never when it is right or not returned."""
    q, k, v = qkv()
    true = _natural_lse(q, k)
    log = guard()
    fusionguard.disable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_attention(q, k, v, return_lse=True, kernel_options={"BACKEND": "FLASH"})[1]
    wrong = (got / true).mean().item()
    guard(log_path=str(log))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, lse = flex_attention(q, k, v, return_lse=True, kernel_options={"BACKEND": "FLASH"})
        with fusionguard.allow_dense():  # allowed dense: the numbers are still wrong, still said
            flex_attention(q, k, v, return_lse=True, kernel_options={"BACKEND": "FLASH"})
        flex_attention(q, k, v, kernel_options={"BACKEND": "FLASH"})  # no LSE returned
        flex_attention(q, k, v, return_lse=True)  # not FLASH
    torch.testing.assert_close(lse, got)  # the guard changes nothing
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning) and "LSE" in str(w.message)]
    events = flex_events()
    assert len(events) == 4
    if abs(wrong - 1) < 1e-3:
        assert said == [] and not any("lse_scale" in e for e in events)
        return
    assert abs(wrong - 1 / 0.6931471805599453) < 1e-3  # log2 units: the one known way it goes wrong
    assert len(said) == 2 and f"{wrong:.4f}x too large on torch {torch.__version__}" in said[0], said
    assert [round(e.get("lse_scale") or 0, 3) for e in events] == [round(wrong, 3)] * 2 + [0, 0]
    assert all(w.filename == __file__ for w in seen if "LSE" in str(w.message))


def test_the_lse_probe_leaves_other_threads_compiled_functions_compiled(monkeypatch):
    """#33: the FLASH LSE probe changed Dynamo's stance for the whole process
    (``set_stance("force_eager")``): a compiled function another thread ran meanwhile ran
    eagerly. It now runs the public calls as any eager call runs them, and still measures."""
    from torch.nn.attention import flex_attention as flex_module

    from fusionguard.dense import lse

    ran = []

    def counting(gm, example_inputs):  # a backend whose compiled code says it ran
        def run(*args):
            ran.append(threading.current_thread().name)
            return gm.forward(*args)

        return run

    compiled = torch.compile(lambda x: x * 2 + 1, backend=counting)
    x = torch.ones(3)
    compiled(x)
    assert ran == ["MainThread"]
    ran.clear()
    real = flex_module.flex_attention

    def probed(*args, **kwargs):  # the probe's own calls: another thread runs the compiled function meanwhile
        other = threading.Thread(target=compiled, args=(x,), name="other")
        other.start()
        other.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", probed)
    lse.flash_lse_scale.cache_clear()
    try:
        scale = lse.flash_lse_scale()
    finally:
        lse.flash_lse_scale.cache_clear()
    assert ran == ["other", "other"]  # compiled both times (force_eager: [])
    assert scale is not None and (abs(scale - 1.0) < 1e-3 or abs(scale - 1 / 0.6931471805599453) < 1e-3)
