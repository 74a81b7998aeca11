"""Compiled paths on CPU: aot_eager/eager backends (traced, still dense) and Inductor (fused)."""

from __future__ import annotations

import os
import sys
import textwrap

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
import torch
from conftest import ROOT, flex_events, op_args, qkv, read_jsonl
from torch.nn.attention.flex_attention import flex_attention

import fusionguard

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def test_aot_eager_with_grads_is_traced_and_dense(guard, dynamo_reset, math_spy):
    guard()
    q, k, v = qkv(requires_grad=True)
    args = op_args(q, k, v)

    def attend(q, k, v):
        return torch.ops.higher_order.flex_attention(q, k, v, *args[3:])[0]

    compiled = torch.compile(attend, backend="aot_eager")
    with pytest.warns(fusionguard.DenseFallbackWarning):
        out = compiled(q, k, v)
        out.sum().backward()
    events = flex_events()
    assert [e["phase"] for e in events] == ["forward", "backward"]
    for e in events:
        assert e["traced"] is True and e["path"] == "dense"
        assert e["cause"] == "non_inductor_backend"
    assert events[0]["evidence"]["backend"] == "aot_eager"
    assert len(math_spy) == 2


def test_eager_backend_names_the_backend(guard, dynamo_reset):
    guard()
    q, k, v = qkv()

    def attend(q, k, v):
        return flex_attention(q, k, v) * 2

    with pytest.warns(fusionguard.DenseFallbackWarning, match="backend=eager"):
        torch.compile(attend, backend="eager")(q, k, v)
    (event,) = flex_events()
    assert event["traced"] is True and event["cause"] == "non_inductor_backend"
    assert event["evidence"]["backend"] == "eager"


def _counts():
    c = torch._dynamo.utils.counters
    return (
        dict(c["stats"]),
        sum(c["graph_break"].values()),
        dict(c["frames"]),
    )


@pytest.mark.slow
def test_inductor_cpu_is_fused_and_transparent(guard, math_spy):
    """Fused record, zero dense events, same graphs/breaks/recompiles with and without the guard."""
    q, k, v = qkv(L=64, HQ=4, HKV=2)

    def attend(q, k, v):
        return flex_attention(q, k, v, enable_gqa=True)

    def run():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        fn = torch.compile(attend, fullgraph=True)
        outs = [fn(q, k, v), fn(q, k, v)]
        return outs, _counts()

    # The reference run leaves nothing in Inductor's caches: a release whose compiled graph keeps
    # no graph text (2.7) can only name the fused calls of a cached graph compiled under the guard.
    with torch._inductor.config.patch(force_disable_caches=True):
        plain_outs, plain_counts = run()
    log = guard(strict=True)  # strict: any dense call would raise
    guarded_outs, guarded_counts = run()
    assert guarded_counts == plain_counts
    for a, b in zip(plain_outs, guarded_outs):
        assert torch.equal(a, b)
    assert flex_events("flex_call") == []
    assert math_spy == []
    (rec,) = flex_events("flex_compile")
    assert rec["path"] == "fused" and rec["traced"] is True and rec["cause"] is None
    assert rec["template"] == "cpp" and rec["phase"] == "forward"
    assert rec["q_shape"] == [1, 4, 64, 8] and rec["kv_shape"] == [1, 2, 64, 8]
    assert rec["source"] in ("lowering", "cache")  # the unguarded run may have filled the cache
    assert [e["event"] for e in read_jsonl(log)].count("flex_compile") == 1
    torch._dynamo.reset()


_SCRIPT = textwrap.dedent(
    """
    import sys, json, torch
    sys.path.insert(0, {root!r})
    import fusionguard
    from torch.nn.attention.flex_attention import flex_attention
    fusionguard.enable(strict=True, log_path=sys.argv[1])
    q = torch.randn(1, 4, 64, 8); k = torch.randn(1, 2, 64, 8); v = torch.randn(1, 2, 64, 8)
    torch.compile(lambda q, k, v: flex_attention(q, k, v, enable_gqa=True))(q, k, v)
    fusionguard.disable()
    """
)


@pytest.mark.slow
def test_fused_record_survives_inductor_caches_across_processes(tmp_path):
    """First process lowers; a second one loads from the FX graph / AOTAutograd caches on disk,
    where no lowering runs: both must report the fused template."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT.format(root=str(ROOT)))
    records = []
    for i in range(2):
        log = tmp_path / f"run{i}.jsonl"
        proc = forkserver.run([sys.executable, str(script), str(log)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        events = read_jsonl(log)
        assert not [e for e in events if e["event"] == "flex_call"]
        (rec,) = [e for e in events if e["event"] == "flex_compile"]
        records.append(rec)
    assert records[0]["source"] == "lowering" and records[1]["source"] == "cache"
    for rec in records:
        assert rec["template"] == "cpp" and rec["path"] == "fused"
        assert rec["q_shape"] == [1, 4, 64, 8]
        assert rec["call_site"]["file"] == str(script)  # the cache hit reads what the lowering kept
    assert records[0]["graph"] == records[1]["graph"]


@pytest.mark.slow
def test_every_fused_execution_is_counted(guard, dynamo_reset):
    """Per-call evidence without Python in the kernels: each compiled-graph execution counts."""
    guard(fused_first=2, fused_every=5, flush_interval=0)  # exact counter cadence: no timed flush
    q, k, v = qkv(L=64, HQ=4, HKV=2)
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, enable_gqa=True))
    for _ in range(12):
        fn(q, k, v)
    from fusionguard.core import state as _state

    assert _state.STATE.counts["fused_runs_forward"] == 12
    kept = flex_events("flex_run")
    assert len(kept) == 2 and kept[0]["template"] == "cpp" and kept[0]["flex_calls"] == 1
    counters = flex_events("fused_calls")
    assert sum(c["count"] for c in counters) == 10 and counters[-1]["total"] == 12


@pytest.mark.slow
def test_a_compiled_flex_shared_by_layers_names_each_run_s_layer(guard, dynamo_reset):
    """The seed pattern: one torch.compile(flex_attention) called from every layer. The compile
    record names the first caller; each run names the layer that ran it."""
    from torch import nn

    guard(keep_all=True)
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, enable_gqa=True))

    class Attend(nn.Module):
        def forward(self, q, k, v):
            return fn(q, k, v)

    model = nn.ModuleList([Attend(), Attend()])
    q, k, v = qkv(L=64, HQ=4, HKV=2)
    with fusionguard.watch(model), torch.no_grad():
        for _ in range(2):
            for layer in model:
                layer(q, k, v)
    assert [e["layer"] for e in flex_events("flex_compile")] == ["0"]
    assert [e["layer"] for e in flex_events("flex_run")] == ["0", "1", "0", "1"]
