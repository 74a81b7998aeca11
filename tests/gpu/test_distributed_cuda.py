"""torchrun --nproc_per_node=2 on two GPUs with NCCL: DDP + torch.compile training with fused
FlexAttention on every rank, one rank's dense call found in its own log, summary(all_ranks=True)
gathered over NCCL, and a strict failure on one rank. Needs two CUDA devices."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from test_distributed import flex_calls, launch, output, rank_logs

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
                assert fused >= 3, (rank, layer, phase, got)
                assert dense == (1 if (rank, layer) == (1, "layers.0") else 0), (rank, layer, phase, got)
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
