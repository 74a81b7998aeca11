"""#25 parts 2 and 4 on CPU: eager mask builds (``mask_build``), the dense memory prediction on
every dense event, and the ``oom`` mode through every entry point. Real torch, real Dynamo, a
real ``create_block_mask``; masks stay far below 8k (the 8k+ figures are in benchmarks/)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import PUBLIC, causal, op_args, qkv, read_jsonl, run_forked

import fusionguard
from fusionguard import _testing
from fusionguard.core import state as _state
from fusionguard.dense import memory as dense_memory

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 200_000  # bytes: a 256 x 256 block mask (655 KB estimated) is above it, 64 x 64 (151 KB) below


def _builds(kind="mask_build"):
    return fusionguard.events(kind)


def test_a_block_mask_built_eagerly_warns_at_the_users_line_with_its_estimate(guard):
    guard(mask_limit=LIMIT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        PUBLIC.create_block_mask(causal, 1, 2, 256, 200, device="cpu")
    mine = [w for w in caught if issubclass(w.category, fusionguard.DenseFallbackWarning)]
    assert len(mine) == 1 and mine[0].filename == __file__ and mine[0].lineno == line
    assert "torch.compile(create_block_mask)" in str(mine[0].message) and "outside the training loop" in str(mine[0].message)
    (e,) = _builds()
    assert e["path"] == "dense" and e["kind"] == "block_mask" and e["action"] == "warn"
    assert e["shape"] == [1, 2, 256, 200] and e["device"] == "cpu" and e["mask_limit"] == LIMIT
    # 1 byte per mask element + 9 per element padded to whole 128 x 128 blocks
    assert e["estimated_bytes"] == 2 * 256 * 200 + 9 * 2 * 256 * 256
    assert e["call_site"]["file"] == __file__ and e["call_site"]["line"] == line
    assert e["free_bytes"] is None  # CPU: no allocator to ask


def test_strict_raises_before_the_mask_is_built(guard):
    guard(strict=True, mask_limit=LIMIT)
    calls = []

    def counted(b, h, q_idx, kv_idx):
        calls.append(1)
        return q_idx >= kv_idx

    with pytest.raises(fusionguard.DenseFallbackError) as info:
        PUBLIC.create_block_mask(counted, 1, 1, 256, 256, device="cpu")
    assert calls == [], "the mask_mod never ran: nothing was allocated"
    assert info.value.event["event"] == "mask_build" and info.value.event["action"] == "raise"
    assert "blocked before it built" in str(info.value) and "allow_dense" in str(info.value)
    with fusionguard.allow_dense():  # on purpose: runs, logged as allowed
        PUBLIC.create_block_mask(counted, 1, 1, 256, 256, device="cpu")
    assert calls and _builds()[-1]["action"] == "allow"
    small = PUBLIC.create_block_mask(causal, 1, 1, 64, 64, device="cpu")  # below the limit: logged only
    assert small is not None and _builds()[-1]["action"] == "log" and _builds()[-1]["level"] == "info"


def test_create_mask_itself_and_the_layer_inside_watch(guard):
    guard(mask_limit=LIMIT)

    class Block(torch.nn.Module):
        def forward(self, x):
            mask = PUBLIC.create_mask(causal, 1, 1, 512, 512, device="cpu")  # 262 KB > limit
            return x + mask.sum()

    model = torch.nn.Sequential(Block())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fusionguard.watch(model):
            model(torch.zeros(1))
    (e,) = _builds()
    assert e["kind"] == "mask" and e["estimated_bytes"] == 512 * 512 and e["layer"] == "0"


def test_repeats_are_sampled_and_counted_exactly(guard):
    log = guard(mask_limit=LIMIT, dense_first=2, dense_every=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            PUBLIC.create_block_mask(causal, 1, 1, 256, 256, device="cpu")
    assert _state.STATE.counts["mask_build_dense"] == 8
    fusionguard.disable()
    events = read_jsonl(log)
    full = [e for e in events if e["event"] == "mask_build"]
    counters = [e for e in events if e["event"] == "mask_builds"]
    assert len(full) == 2
    assert sum(c["count"] for c in counters) == 6 and counters[-1]["total"] == 8
    assert not [e for e in events if e["event"] == "dense_calls"], "mask builds are not dense attention calls"
    from fusionguard.report.build import build
    from fusionguard.report.render import render_text

    rep = build([str(log)])
    assert rep["masks"]["dense"] == 8 and rep["masks"]["estimated_max"] == 655360 and rep["totals"]["dense_calls"] == 0
    assert "DENSE MASKS: 8 eager mask build(s)" in render_text(rep)


def test_a_build_below_mask_limit_is_logged_not_a_notice(guard):
    """#32: the quickstart's own 164 KB mask, built once, was a "DENSE MASKS" notice with the fix
    "build the mask once". Below ``mask_limit`` (and fitting) a build is logged, not a finding."""
    log = guard(mask_limit=10**12)
    PUBLIC.create_block_mask(causal, 1, 1, 256, 256, device="cpu")
    PUBLIC.create_block_mask(causal, 1, 1, 128, 128, device="cpu")
    fusionguard.disable()
    assert [e["action"] for e in read_jsonl(log) if e["event"] == "mask_build"] == ["log", "log"]
    from fusionguard.report.build import build
    from fusionguard.report.render import notice_lines, render_text

    rep = build([str(log)])
    assert rep["masks"]["dense"] == 0 and rep["masks"]["small"] == 2 and rep["masks"]["small_estimated_max"] == 655360
    text = render_text(rep)
    assert "DENSE MASKS" not in text
    assert "masks: 2 eager mask build(s) below mask_limit, largest 655.36 KB" in text
    assert not any("MASK" in line.upper() for line in notice_lines(rep)), "not a finding on the HTML page"


def test_under_torch_compile_nothing_is_added_and_the_build_is_recorded_as_compiled(guard):
    guard(mask_limit=LIMIT)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    build = torch.compile(PUBLIC.create_block_mask, backend="eager", fullgraph=True)  # fullgraph: no break added
    before = counters["stats"]["unique_graphs"]
    for _ in range(2):
        build(causal, 1, 1, 256, 256, device="cpu")
    assert counters["stats"]["unique_graphs"] - before == 1, "compiled once, run twice"
    kinds = [(e["path"], e.get("traced")) for e in _builds()]
    assert kinds == [("compiled", True)], "one trace-time record per compile, no dense build"


def test_enable_recompiles_a_frame_compiled_before_it_once_as_documented(tmp_path):
    """The seam is the ``create_mask`` global, which Dynamo guards: a frame compiled before
    ``enable()`` recompiles once after it, never more; after ``disable()`` its first entry serves."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def build(n):
        return PUBLIC.create_block_mask(causal, 1, 1, n, n, device="cpu")

    build(128)
    base = counters["stats"]["unique_graphs"]
    try:
        fusionguard.enable(log_path=False, mask_limit=LIMIT)
        for _ in range(3):
            build(128)
        after_enable = counters["stats"]["unique_graphs"] - base
        fusionguard.disable()
        for _ in range(3):
            build(128)
        after_disable = counters["stats"]["unique_graphs"] - base
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
    # disable(): the entry compiled for the original create_mask matches again, no compile
    assert after_enable == 1 and after_disable == 1


def test_bad_arguments_get_pytorchs_own_error_and_no_internal_error(guard):
    guard(strict=True, mask_limit=LIMIT)
    for args, kw in (((causal, 1, 1, "256", 256), {"device": "cpu"}), ((causal, 1, 1, 256, 256), {"device": "no-such-device"})):
        with pytest.raises(Exception) as info:
            PUBLIC.create_block_mask(*args, **kw)
        assert not isinstance(info.value, fusionguard.DenseFallbackError)
    assert fusionguard.events("internal_error") == [] and fusionguard.events("mask_build") == []


def test_disable_puts_the_original_create_mask_back(guard):
    original = PUBLIC.__dict__["create_mask"]
    guard()
    assert PUBLIC.__dict__["create_mask"] is not original
    fusionguard.disable()
    assert PUBLIC.__dict__["create_mask"] is original


_RSS = """
import sys, torch
torch.set_num_threads(1)
from torch.nn.attention.flex_attention import create_block_mask
from fusionguard.dense.memory import mask_build_bytes

def status(name):  # kB lines of /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(name))

n = int(sys.argv[1])
create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 256, 256, device="cpu")
# ru_maxrss survives fork+exec (it holds the parent's peak): reset the peak (VmHWM) instead
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS:")
create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, n, n, device="cpu")
print(status("VmHWM:") - base, mask_build_bytes(1, 1, n, n))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS read from /proc and ru_maxrss (Linux)")
@pytest.mark.parametrize("n", [2048, 3000])
def test_the_estimate_matches_the_measured_peak_rss(n):
    p = subprocess.run([sys.executable, "-c", _RSS, str(n)], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0, p.stderr[-2000:]
    measured, estimate = map(int, p.stdout.split())
    assert abs(estimate - measured) / measured < 0.15, (measured, estimate)


# --- part 4 on CPU: the prediction is on every dense event; the mode is accepted everywhere ---


def test_dense_events_carry_predicted_and_free_bytes(guard):
    guard()
    q, k, v = qkv(L=32, KV=48, HQ=4, HKV=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ops.higher_order.flex_attention(*op_args(q, k, v))
    (e,) = fusionguard.events("flex_call")
    assert e["predicted_bytes"] == dense_memory.predict_dense("forward", q, k, v) > e["scores_bytes"]
    assert e["free_bytes"] is None  # CPU
    # the model: max(2w+1, 3w+1) per score element + K and V repeated to Hq heads + the lse
    s = 1 * 4 * 32 * 48
    assert e["predicted_bytes"] == s * 13 + 4 * 48 * 16 * 4 + 4 * 32 * 4


def test_prediction_follows_dtype_score_mod_and_captured_tensors():
    q, k, v = qkv(L=64, KV=64, HQ=2, HKV=2, dtype=torch.bfloat16)
    s = 2 * 64 * 64
    base = dense_memory.predict_dense("backward", q, k, v)
    assert base - dense_memory.predict_dense("backward", q, k, v, score_mod=PUBLIC._identity) == 0
    assert dense_memory.predict_dense("backward", q, k, v, score_mod=lambda s_, b, h, m, n: s_ * 2) - base == 4 * s
    bias = torch.zeros(2, 64, 64)  # indexed by q and kv: gathered to the score shape
    doc = torch.zeros(64, dtype=torch.long)  # per token: broadcast, no score-sized copy
    # a captured [H, Q, KV] bias: gathered to the score shape inside score_mod with an int64
    # index grid per indexed dimension (H200: 32 B per element forward for a float32 bias);
    # eager autograd re-gathers it in the backward; a per-token tensor is broadcast, never gathered
    fwd = dense_memory.predict_dense("forward", q, k, v)
    adds = lambda s_, b, h, m, n: s_ + bias[h, m, n]  # noqa: E731
    assert dense_memory.predict_dense("forward", q, k, v, adds, (bias,), (doc,)) - fwd == (32 - 13) * s  # 4 + (4 + 3 x 8) vs 3w+1
    assert dense_memory.predict_dense("forward", q, k, v, adds, (bias, bias), ()) - fwd == (4 + 2 * 28 - 13) * s
    assert dense_memory.predict_dense("backward", q, k, v, adds, (bias,), (doc,)) - base == (4 + 28 - 4) * s
    assert base > 2 * fwd - 4 * s  # backward about twice the forward (seed: 17.8 vs 8.9 GB)


def test_mode_values_and_conflicts(guard):
    guard(mode="oom")
    config = _state.STATE.config
    assert config.mode == "oom" and config.strict is False, "oom is never truthy where code tests strict"
    guard(mode="strict")
    assert _state.STATE.config.strict is True
    guard(mode=" OOM ")  # any case, as FUSIONGUARD=, --fusionguard= and the ini option
    assert (_state.STATE.config.mode, _state.STATE.config.strict) == ("oom", False)
    with pytest.raises(TypeError, match=r"strict must be True or False, not 'oom'; a mode by name is mode='oom'"):
        fusionguard.enable(strict="oom", log_path=False)
    for bad in ({"mode": "OOM!"}, {"strict": True, "mode": "oom"}, {"mask_limit": -1}, {"mask_limit": True}, {"mask_limit": 1.5}):
        strict = bad.pop("strict", False)
        with pytest.raises(ValueError, match="mode|mask_limit|strict"):
            fusionguard.enable(strict=strict, log_path=False, **bad)


def test_oom_mode_on_cpu_runs_dense_calls_and_warns(guard):
    guard(mode="oom")
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.ops.higher_order.flex_attention(*op_args(q, k, v))
    (e,) = fusionguard.events("flex_call")
    assert e["action"] == "warn" and caught, "no free_bytes on CPU: nothing is known not to fit"


def test_oom_mode_on_cpu_says_once_that_it_cannot_act_there(guard, fg_records):
    """#32: the oom mode reads the device's free memory, which only CUDA gives: on CPU it warns as
    warn mode does, and says so once (dense calls and mask builds together)."""
    guard(mode="oom", mask_limit=1)
    q, k, v = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            torch.ops.higher_order.flex_attention(*op_args(q, k, v))
        PUBLIC.create_block_mask(causal, 1, 1, 128, 128, device="cpu")
    said = [line for line in fg_records.lines if "oom mode" in line and "cannot" in line]
    assert len(said) == 1, fg_records.lines
    assert "cpu" in said[0] and "warn mode" in said[0]
    fusionguard.disable()
    guard(mode="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ops.higher_order.flex_attention(*op_args(q, k, v))
    assert len([line for line in fg_records.lines if "oom mode" in line]) == 1  # (warn mode: nothing to say)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSIONGUARD")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


_SHOW = "import torch, fusionguard; from fusionguard.core.state import STATE; print(STATE.config.mode, STATE.config.strict)"


def test_fusionguard_env_and_run_spell_oom(tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", _SHOW],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(
            FUSIONGUARD="Oom",
            FUSIONGUARD_LOG=str(tmp_path / "a.jsonl"),
            PYTHONPATH=f"{ROOT / 'fusionguard' / '_startup'}{os.pathsep}{ROOT}",
        ),
        timeout=120,
    )
    assert p.stdout.split() == ["oom", "False"], p.stderr[-2000:]
    p = subprocess.run(
        [sys.executable, "-m", "fusionguard", "run", "--oom", "--log", str(tmp_path / "b.jsonl"), "--", sys.executable, "-c", _SHOW],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(),
        timeout=120,
    )
    assert p.stdout.split() == ["oom", "False"], p.stderr[-2000:]
    header = read_jsonl(tmp_path / "b.jsonl")[0]
    assert header["config"]["mode"] == "oom"


pytest_plugins = ["pytester"]


def test_pytest_option_and_ini_spell_oom(pytester):
    """In any case, as FUSIONGUARD= and enable(mode=) take it."""
    pytester.makepyfile(
        test_inner="import fusionguard\nfrom fusionguard.core.state import STATE\n\n"
        "def test_mode():\n    assert STATE.config.mode == 'oom' and not STATE.config.strict\n"
    )
    result = run_forked(pytester, "-p", "fusionguard.pytest_plugin", "--fusionguard=OOM", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nfusionguard = Oom\n")
    result = run_forked(pytester, "-p", "fusionguard.pytest_plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


# --- sizes as PyTorch takes them; builds that allocate nothing ---------------------------------


def test_numpy_and_tensor_sizes_are_guarded_like_ints(guard):
    """NumPy integers and a 0-d tensor are sizes to PyTorch (``operator.index``): strict mode
    blocks them as it blocks ints (they slipped through unguarded)."""
    np = pytest.importorskip("numpy")
    guard(strict=True, mask_limit=LIMIT)
    for b, h, q_len, kv_len in ((1, 1, np.int64(256), np.int64(256)), (torch.tensor(1), np.int32(1), 256, torch.tensor(256))):
        with pytest.raises(fusionguard.DenseFallbackError) as info:
            PUBLIC.create_block_mask(causal, b, h, q_len, kv_len, device="cpu")
        assert info.value.event["shape"] == [1, 1, 256, 256]
    assert [e["action"] for e in _builds()] == ["raise", "raise"]
    with pytest.raises(TypeError):  # not a size: PyTorch's own error, nothing of ours
        PUBLIC.create_mask(causal, 1, 1, torch.tensor([256]), 256, device="cpu")
    assert len(_builds()) == 2


def test_a_batch_of_zero_is_zero_not_one(guard):
    guard(strict=True, mask_limit=1)
    mask = PUBLIC.create_mask(causal, 0, 1, 64, 64, device="cpu")  # B=0: nothing to build
    assert mask.shape == (0, 1, 64, 64)
    (e,) = _builds()
    assert e["shape"] == [0, 1, 64, 64] and e["estimated_bytes"] == 0 and e["action"] == "log"
    with pytest.raises(fusionguard.DenseFallbackError):  # B=None broadcasts: one batch, above 1 byte
        PUBLIC.create_mask(causal, None, 1, 64, 64, device="cpu")
    assert _builds()[-1]["shape"] == [1, 1, 64, 64]


def test_a_build_on_the_meta_device_allocates_nothing_and_is_not_guarded(guard):
    guard(strict=True, mask_limit=1)
    mask = PUBLIC.create_block_mask(causal, 1, 1, 256, 256, device="meta")
    assert mask.shape == (1, 1, 256, 256)
    assert _builds() == []


def test_the_fix_text_is_worked_out_once(guard):
    from fusionguard.dense import masks

    assert masks.fix_text() is masks.fix_text()
    assert "torch.compile(create_block_mask)" in masks.fix_text()


def test_allocator_setting_per_process_fraction():
    """#35: the oom mode's free_bytes honours a per-process cap; where torch cannot say it, the
    allocator setting does (`PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:X`)."""
    from fusionguard.dense.memory import alloc_conf_fraction

    assert alloc_conf_fraction("expandable_segments:True,per_process_memory_fraction:0.25") == 0.25
    assert alloc_conf_fraction(" per_process_memory_fraction:1") == 1.0
    assert alloc_conf_fraction("expandable_segments:True") is None
    assert alloc_conf_fraction(None) is None
    assert alloc_conf_fraction("per_process_memory_fraction:lots") is None
    assert alloc_conf_fraction("per_process_memory_fraction:1.5") is None
