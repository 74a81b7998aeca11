"""One torchrun worker for tests/test_distributed.py (CPU, gloo).

    torchrun --nproc_per_node=2 --standalone tests/dist_worker.py SCENARIO OUT_DIR

SCENARIO:
  both   warn mode, every rank runs one eager (dense) flex_attention, Q = 16 + 8 * rank
  rank1  warn mode, only rank 1 runs flex_attention
  fsdp2  per-block compile under FSDP2 (torchtitan's pattern): fully_shard each block, then
         block.compile(), the whole model sharded; two inference steps inside watch(model);
         each rank writes OUT_DIR/rows{R}.json (summary) and OUT_DIR/counts{R}.json
  fsdp2_unwatched  the same without watch() (as under ``fusionguard run``)
  strict strict mode; rank 0 runs its call inside allow_dense(), rank 1's call raises
         DenseFallbackError; rank 0 then waits in a barrier that rank 1 never reaches

Each rank logs to OUT_DIR/logs (a directory: one file per rank and process) and, for
``gather_to_rank0``, rank 0 writes OUT_DIR/gathered.json. Marker files OUT_DIR/rank{R}.{step}
say how far each rank got.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.core.distributed import gather_to_rank0


def mark(out: Path, rank: int, step: str) -> None:
    (out / f"rank{rank}.{step}").write_text(str(os.getpid()))


def attention(q_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(q_len)
    q, k, v = (torch.randn(1, 2, q_len, 8, generator=g) for _ in range(3))
    with torch.no_grad():
        return flex_attention(q, k, v)


@record  # torchrun's failure summary then carries the exception (DenseFallbackError and its verdict)
def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    warnings.filterwarnings("ignore")  # torch's "flex_attention called without torch.compile", ours

    # before any process group exists: no communication, just [obj]
    alone = gather_to_rank0({"rank": rank})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    fusionguard.enable(strict=(scenario == "strict"), log_path=str(out / "logs") + os.sep)
    mark(out, rank, "enabled")

    if scenario == "both":

        class Attn(torch.nn.Module):
            def forward(self, q_len):
                return attention(q_len)

        model = torch.nn.ModuleDict({"attn": Attn()})
        with fusionguard.watch(model):
            model["attn"](16 + 8 * rank)
    elif scenario == "rank1":
        if rank == 1:
            attention(16)
    elif scenario in ("fsdp2", "fsdp2_unwatched"):
        fsdp2_per_block(out, rank, watch=scenario == "fsdp2")
        finish(out, rank)
        return
    elif scenario == "strict":
        if rank == 0:
            with fusionguard.allow_dense():
                attention(16)
        else:
            mark(out, rank, "raising")
            attention(16)  # raises DenseFallbackError: this process ends here
        mark(out, rank, "barrier")
        dist.barrier()  # never completes: rank 1 is gone
        mark(out, rank, "after_barrier")
        return
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")

    mine = {
        "rank": rank,
        "alone": alone,
        "dense": [e["seq"] for e in fusionguard.events("flex_call")],
        "pid": os.getpid(),
    }
    gathered = gather_to_rank0(mine)
    rows = fusionguard.summary(all_ranks=True)  # a collective: every rank calls it
    if rank == 0:
        (out / "gathered.json").write_text(json.dumps(gathered))
        (out / "all_ranks.json").write_text(json.dumps(list(rows), default=str))
    else:
        assert gathered is None, gathered
    finish(out, rank)


def fsdp2_per_block(out: Path, rank: int, watch: bool = True) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 spelling
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compile_models import Model, tokens

    torch.manual_seed(0)  # the same weights on both ranks
    model = Model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
        block.compile()
    fully_shard(model, mesh=mesh)
    with fusionguard.watch(model) if watch else contextlib.nullcontext(), torch.no_grad():
        for _ in range(2):
            model(tokens(seed=rank))
    rows = [{k: r[k] for k in ("layer", "phase", "calls", "fused", "dense")} for r in fusionguard.summary()]
    (out / f"rows{rank}.json").write_text(json.dumps(rows))
    runs = [{k: e.get(k) for k in ("layer", "layers", "flex_calls")} for e in fusionguard.events("flex_run")]
    (out / f"counts{rank}.json").write_text(json.dumps({"counts": dict(fusionguard.core.state.STATE.counts), "runs": runs}))


def finish(out: Path, rank: int) -> None:
    """Mark this rank done, turn the guard off, and tear down together: a rank that destroys its
    group while the other still talks to it can abort in C++ ("terminate called without an
    active exception"), seen under load."""
    mark(out, rank, "done")
    fusionguard.disable()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
