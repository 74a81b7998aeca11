"""torchrun --nproc_per_node=2 on two GPUs with NCCL (issue 36): DDP + torch.compile training with
fused FlexAttention on every rank (exact per-rank counts), one rank's dense call found in its own
log, summary(all_ranks=True) gathered over NCCL, a strict failure on one rank; FSDP2 with compile
per block (with watch() and under ``fusionguard run`` without it), one rank forced dense in strict
mode (how every rank stops, recorded); context parallelism for FlexAttention at 16k tokens (fused,
dense with the local shapes' prediction against the measured peak, the oom mode on one rank);
Lightning DDP with a compiled model and stop_on_dense. Needs two CUDA devices. NVLink multicast
is off in every process (``launch`` sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 for torchrun and its workers).

    python -m pytest -q -rA tests/gpu/test_distributed_cuda.py tests/gpu/test_integrations_dist_cuda.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import needs
from test_distributed import check_strict_stop, flex_calls, fusionguard_run, launch, output, rank_logs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

WORKER = Path(__file__).resolve().parent / "dist_cuda_worker.py"


def test_ddp_compiled_fused_on_both_ranks_rank1_dense(tmp_path):
    proc = launch("ddp", tmp_path, worker=WORKER, timeout=400)
    assert proc.returncode == 0, output(proc)
    logs = rank_logs(tmp_path)
    for rank, events in logs.items():
        assert events[0]["torch"] == torch.__version__
        compiles = [e for e in events if e["event"] == "flex_compile"]
        assert compiles and all(c["path"] == "fused" for c in compiles), compiles
        assert {c["phase"] for c in compiles} == {"forward", "backward"}
        assert {c["layer"] for c in compiles} == {"layers.0", "layers.1"}, compiles
        dense = flex_calls(events)
        if rank == 0:
            assert dense == [], "rank 0 never left the compiled path"
        else:
            assert {(e["phase"], e["layer"], e["cause"]) for e in dense} == {
                ("forward", "layers.0", "eager_call"),
                ("backward", "layers.0", "eager_call"),
            }, dense
            assert all(e["device"] == "cuda:1" for e in dense if e["phase"] == "forward"), dense
    rows = json.loads((tmp_path / "all_ranks.json").read_text())
    got = {(r["rank"], r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in rows}
    for rank in (0, 1):
        for layer in ("layers.0", "layers.1"):
            for phase in ("forward", "backward"):
                fused, dense = got[(rank, layer, phase)]
                assert fused == 3, (rank, layer, phase, got)  # 3 steps, each layer once per step
                assert dense == (1 if (rank, layer) == (1, "layers.0") else 0), (rank, layer, phase, got)
    for rank in (0, 1):  # the 3 compiled steps: 2 layers each, forward and backward
        counts = json.loads((tmp_path / f"counts{rank}.json").read_text())
        assert counts["fused_runs_forward"] == counts["fused_runs_backward"] == 6, (rank, counts)
    by_rank = json.loads((tmp_path / "losses.json").read_text())
    assert by_rank[0]["weights"] == by_rank[1]["weights"], "DDP kept the replicas equal"
    assert by_rank[0]["losses"] != by_rank[1]["losses"], "each rank trained on its own batch"


def test_strict_rank_raises_over_nccl(tmp_path):
    proc = launch("strict", tmp_path, worker=WORKER, timeout=300)
    assert proc.returncode != 0, output(proc)
    text = proc.stdout + proc.stderr
    assert "DenseFallbackError" in text and "ChildFailedError" in text, output(proc)
    root = text.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s*:\s*1\b", root) and "DenseFallbackError" in root, output(proc)
    assert (tmp_path / "rank1.raising").exists() and not (tmp_path / "rank1.barrier").exists()
    assert (tmp_path / "rank0.barrier").exists() and not (tmp_path / "rank0.after_barrier").exists()
    logs = rank_logs(tmp_path)
    (blocked,) = flex_calls(logs[1])
    assert blocked["action"] == "raise" and blocked["device"] == "cuda:1"
    (allowed,) = flex_calls(logs[0])
    assert allowed["action"] == "allow" and allowed["device"] == "cuda:0"


@pytest.mark.parametrize("scenario", ["fsdp2_train", "fsdp2_train_run"], ids=["watch", "fusionguard_run"])
def test_fsdp2_compile_per_block_training_exact_per_rank(tmp_path, scenario):
    """FSDP2, compile per block, 3 training steps: per rank, every block's forward and backward
    fused 3 times, named by block; `report logs/` merges the ranks (6 per layer and phase)."""
    from fusionguard.report.build import build as build_report_dict

    runner = fusionguard_run(tmp_path) if scenario == "fsdp2_train_run" else ()
    proc = launch(scenario, tmp_path, worker=WORKER, timeout=500, runner=runner)
    assert proc.returncode == 0, output(proc)
    logs = rank_logs(tmp_path)
    layers = ("layers.0.attn", "layers.1.attn")
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"rows{rank}.json").read_text())
        assert sorted((r["layer"], r["phase"], r["calls"], r["fused"], r["dense"]) for r in rows) == sorted(
            (layer, phase, 3, 3, 0) for layer in layers for phase in ("forward", "backward")
        ), (rank, rows)
        counts = json.loads((tmp_path / f"counts{rank}.json").read_text())
        assert counts["counts"]["fused_runs_forward"] == counts["counts"]["fused_runs_backward"] == 6, counts
        order = [("layers.0.attn", "forward"), ("layers.1.attn", "forward"), ("layers.1.attn", "backward"), ("layers.0.attn", "backward")]
        assert [tuple(r) for r in counts["runs"]] == order * 3, counts["runs"]
        assert not flex_calls(logs[rank])
        compiles = [e for e in logs[rank] if e["event"] == "flex_compile"]
        assert compiles and {c["path"] for c in compiles} == {"fused"}, compiles
    rep = build_report_dict([str(tmp_path / "logs")])
    assert {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in rep["rows"]} == {
        (layer, phase): (6, 0) for layer in layers for phase in ("forward", "backward")
    }


def test_fsdp2_strict_one_rank_forced_dense_every_rank_stops_no_nccl_hang(tmp_path):
    """Under `fusionguard run --strict`: rank 1 forced eager in step 2 raises in its first block;
    rank 0 goes on into FSDP's collectives over NCCL (group timeout 300 s, so it is not what stops
    it). Every rank stops within 30 s; rank 1's crash record names its rank and the layer; what
    stopped rank 0 (its collective's error, torchrun's SIGTERM, or SIGKILL after torchrun's grace)
    is printed and written to stop.json."""
    import time

    proc = launch("fsdp2_strict", tmp_path, worker=WORKER, timeout=400, runner=fusionguard_run(tmp_path, "--strict"))
    check_strict_stop(tmp_path, proc, time.time(), "layers.0.attn")


@needs("context_parallel")
def test_context_parallel_flex_16k_fused_dense_and_oom_per_rank(tmp_path):
    """Context parallelism for FlexAttention (torch's private _ContextParallel(2, FLEX) and
    _create_cp_block_mask), S = 16384 on 2 ranks, bf16, 8 heads of 64, causal, mode="oom".
    Compiled: fused forward and backward on every rank. Eager inside the CP region: dense on
    every rank, with Q of S/2 and the all-gathered K/V of S, predicted_bytes from those local
    shapes within 15 % of the rank's measured forward peak. Then rank 1's GPU is filled until the
    dense forward cannot fit: blocked there (oom), run on rank 0."""
    from fusionguard.dense.memory import predict_dense

    proc = launch("cp", tmp_path, worker=WORKER, timeout=500)
    assert proc.returncode == 0, output(proc)
    logs = rank_logs(tmp_path)
    half, seq = 8192, 16384
    for rank in (0, 1):
        cp = json.loads((tmp_path / f"cp{rank}.json").read_text())
        print(f"rank {rank}:", json.dumps({k: v for k, v in cp.items() if not k.endswith("_calls")}))
        assert cp["q"] == [1, 8, half, 64] and cp["kv_local"] == [1, 8, half, 64] and cp["mask"] == [1, 1, half // 128, seq // 128]
        assert cp["compiled_calls"] == [] and "compiled_raised" not in cp
        compiles = [e for e in logs[rank] if e["event"] == "flex_compile"]
        assert {(c["path"], c["phase"]) for c in compiles} >= {("fused", "forward"), ("fused", "backward")}, compiles
        assert {c["path"] for c in compiles} == {"fused"}, compiles
        dense = [e for e in cp["dense_calls"] if e["phase"] == "forward"]
        assert len(dense) == 1 and dense[0]["path"] == "dense" and dense[0]["action"] == "warn", cp["dense_calls"]
        (fwd,) = dense
        assert fwd["q_shape"] == [1, 8, half, 64] and fwd["kv_shape"] == [1, 8, seq, 64] and fwd["device"] == f"cuda:{rank}"
        local = [torch.empty(1, 8, n, 64, device="meta", dtype=torch.bfloat16) for n in (half, seq, seq)]
        assert fwd["predicted_bytes"] == predict_dense("forward", *local)
        measured = cp["dense_fwd_peak"]
        assert abs(fwd["predicted_bytes"] - measured) <= 0.15 * measured, (rank, fwd["predicted_bytes"], measured)
        oom = [e for e in cp["oom_calls"] if e["phase"] == "forward"]
        if rank == 1:
            assert cp.get("oom_raised") == "oom" and oom[0]["action"] == "raise" and oom[0]["blocked_by"] == "oom", cp
            assert oom[0]["predicted_bytes"] > oom[0]["free_bytes"]
        else:
            assert "oom_raised" not in cp and oom[0]["action"] == "warn", cp


def test_lightning_ddp_compiled_stop_on_dense_stops_both_ranks_together(tmp_path):
    """Lightning strategy="ddp", the model compiled, stop_on_dense=True: rank 1's second step
    runs eager (dense); both ranks stop after that step (of 4), no rank left waiting in DDP's
    all-reduce; rank 0 ran fused only."""
    pytest.importorskip("lightning.pytorch")
    proc = launch("ddp_stop", tmp_path, worker=WORKER, timeout=500)
    assert proc.returncode == 0, output(proc)
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["global_step"] for r in results] == [2, 2], results
    logs = rank_logs(tmp_path)
    assert flex_calls(logs[0]) == []
    dense = flex_calls(logs[1])
    # (named from the LightningModule the callback watches: ``model.layers.0``, the Model's ``layers.0``)
    assert {(e["layer"].rsplit("model.", 1)[-1], e["phase"]) for e in dense} == {
        (f"layers.{i}", p) for i in (0, 1) for p in ("forward", "backward")
    }, dense
    assert all(e["action"] == "warn" for e in dense)
