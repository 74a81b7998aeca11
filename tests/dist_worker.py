"""One torchrun worker for tests/test_distributed.py (CPU, gloo).

    torchrun --nproc_per_node=2 --standalone tests/dist_worker.py SCENARIO[,SCENARIO...] OUT_DIR

Several scenarios (comma-separated, none of them strict or run under ``fusionguard run``): one
after the other in one launch, each in OUT_DIR/SCENARIO with its own enable(), log and disable();
the launch's start (torchrun's agent, two workers importing torch and joining the group, about
12 CPU s) is paid once.

SCENARIO:
  both   warn mode, every rank runs one eager (dense) flex_attention, Q = 16 + 8 * rank
  rank1  warn mode, only rank 1 runs flex_attention
  fsdp2  per-block compile under FSDP2 (torchtitan's pattern): fully_shard each block, then
         block.compile(), the whole model sharded; two inference steps inside watch(model);
         each rank writes OUT_DIR/rows{R}.json (summary) and OUT_DIR/counts{R}.json
  fsdp2_unwatched  the same without watch() (as under ``fusionguard run``)
  strict strict mode; rank 0 runs its call inside allow_dense(), rank 1's call raises
         DenseFallbackError; rank 0 then waits in a barrier that rank 1 never reaches
  fsdp2_strict  strict mode, FSDP2 per block, eager (set_stance force_eager: no compile on CPU),
         inference steps in a loop; rank 0's inside allow_dense(), rank 1 raises in its second
         step's first block while rank 0 goes on into FSDP's next all-gather (how the group stops:
         tests/test_distributed.py)
  cp     context parallelism for FlexAttention (torch's private ``_ContextParallel(2, FLEX)``,
         ``_create_cp_block_mask``, ``_context_parallel_shard``; S = 256, causal): the attention
         compiled (fused), then the same attention eager inside the CP region (dense, warned);
         each rank writes OUT_DIR/cp{R}.json (``context_parallel_flex``, shared with the GPU worker)

Under ``fusionguard run`` (FUSIONGUARD set) the worker does not call enable(): the start-up hook did.

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
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import _testing
from fusionguard.eventlog.distributed import gather_to_rank0


def mark(out: Path, rank: int, step: str) -> None:
    (out / f"rank{rank}.{step}").write_text(str(os.getpid()))


def attention(q_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(q_len)
    q, k, v = (torch.randn(1, 2, q_len, 8, generator=g) for _ in range(3))
    with torch.no_grad():
        return flex_attention(q, k, v)


@record  # torchrun's failure summary then carries the exception (DenseFallbackError and its verdict)
def main() -> None:
    scenarios, root = sys.argv[1].split(","), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    warnings.filterwarnings("ignore")  # torch's "flex_attention called without torch.compile", ours

    # before any process group exists: no communication, just [obj]
    alone = gather_to_rank0({"rank": rank})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for scenario in scenarios:
        out = root / scenario if len(scenarios) > 1 else root
        out.mkdir(exist_ok=True)
        if not run(scenario, out, rank, alone):
            return  # (a strict scenario: the group is stopped, no teardown)
        if scenario != scenarios[-1]:  # the next scenario starts as a fresh enable() would
            mark(out, rank, "done")
            fusionguard.disable()
            _testing.reset_for_tests()
            dist.barrier()
    finish(out, rank)


def run(scenario: str, out: Path, rank: int, alone: list) -> bool:
    """One scenario in OUT; False where it leaves the group stopped (strict)."""
    if not fusionguard.is_enabled():  # (under ``fusionguard run`` the start-up hook enabled it)
        fusionguard.enable(strict=scenario in ("strict", "fsdp2_strict"), log_path=str(out / "logs") + os.sep)
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
        return True
    elif scenario == "fsdp2_strict":
        fsdp2_strict(out, rank, torch.device("cpu"))
        return False
    elif scenario == "cp":
        context_parallel_flex(out, rank, torch.device("cpu"), seq=256, heads=2, dim=8, dtype=torch.float32, steps=("compiled", "dense"))
        return True
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
        return False
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
    return True


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


def fsdp2_strict(out: Path, rank: int, dev: torch.device, train: bool = False, compiled: bool = False, **shape) -> None:
    """FSDP2 per block, strict mode; rank 1 goes dense in step 2's first block and raises, rank 0
    (its dense calls, if any, inside allow_dense()) runs on into FSDP's next collective. Marker
    files carry wall-clock times (the test measures how long the others take to stop)."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 spelling
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compile_models import Model

    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = Model(**shape).to(dev, dtype)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
        if compiled:
            block.compile()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if train else None
    with fusionguard.watch(model):
        _steps(out, rank, dev, model, opt, compiled, dtype, shape)


def _steps(out: Path, rank: int, dev: torch.device, model, opt, compiled: bool, dtype: torch.dtype, shape: dict) -> None:
    from compile_models import tokens

    train = opt is not None
    for step in range(1, 6):
        mark(out, rank, f"step{step}")
        raising = rank == 1 and step == 2  # the one call strict mode stops
        forced = not compiled or raising
        stance = torch.compiler.set_stance("force_eager") if forced else contextlib.nullcontext()
        allowed = fusionguard.allow_dense() if forced and not raising else contextlib.nullcontext()
        if raising:
            (out / "rank1.raising").write_text(repr(time.time()))
        with stance, allowed, contextlib.nullcontext() if train else torch.no_grad():
            x = tokens(seed=rank, device=dev.type, dtype=dtype, **shape)
            loss = model(x).float().pow(2).mean()
            if opt is not None:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss.item()  # a host sync: a rank waiting on a peer's collective blocks here (NCCL)
    mark(out, rank, "after_steps")  # never written: rank 1 raised in step 2, rank 0 is stopped


def context_parallel_flex(
    out: Path, rank: int, dev: torch.device, seq: int, heads: int, dim: int, dtype: torch.dtype, steps: Sequence[str], train: bool = False
) -> None:
    """FlexAttention under torch's private context parallelism (torchtitan's path) on a
    2-rank mesh: Q, K, V of ``seq`` tokens sharded along the sequence (head-tail load balancer),
    K and V all-gathered by ``_ContextParallel``'s pre-hook, the causal mask from
    ``_create_cp_block_mask`` (local Q against the whole KV). ``steps``: ``compiled`` (the
    attention module compiled), ``dense`` (the same module eager, inside the CP region), ``oom``
    (rank 1 fills its GPU first so that the dense forward cannot fit; mode="oom" expected).
    Writes OUT_DIR/cp{R}.json: shapes, outputs' agreement, measured peaks (CUDA)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fusionguard import torch_internals as ti
    from fusionguard.dense import memory as dense_memory

    cp = ti.context_parallel_flex()

    class FlexAttention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask=None) -> torch.Tensor:
            return flex_attention(q, k, v, block_mask=block_mask)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    attn = FlexAttention()
    parallelize_module(attn, mesh, cp.ContextParallel(seq_dim=2, attention_type=cp.ContextParallel.AttentionType.FLEX))
    g = torch.Generator().manual_seed(0)  # the same global Q, K, V on every rank
    full = [torch.randn(1, heads, seq, dim, generator=g).to(dev, dtype) for _ in range(3)]
    # sharded first: with no load balancer, _context_parallel_shard turns load balancing off, and
    # the mask built next (its default balancer then None) matches the plain contiguous shards
    q, k, v = _cp_shard(cp, mesh, full, train)
    mask = cp.create_cp_block_mask(causal, 1, 1, seq, seq, mesh)  # (compiles create_block_mask: fused)
    result: dict = {"q": list(q.shape), "kv_local": list(k.shape), "mask": list(mask.shape)}
    compiled = torch.compile(attn)
    outs = {}
    for step in steps:
        seen = len(fusionguard.events("flex_call"))
        if step == "oom" and rank == 1:
            need = dense_memory.predict_dense("forward", q, full[1], full[2])
            ballast = _ballast(dev, need // 2)
        else:
            ballast = []
        fn = compiled if step == "compiled" else attn
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        try:
            with contextlib.nullcontext() if train else torch.no_grad():
                o = fn(q, k, v, block_mask=mask)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                result[f"{step}_fwd_peak"] = torch.cuda.max_memory_allocated(dev) - base
            if train and step != "oom":  # (the oom step: forward only, its backward's reduce-scatter
                o.float().sum().backward()  # would wait for a rank whose forward was blocked)
                q.grad = k.grad = v.grad = None
            outs[step] = o.detach().float()
            result[f"{step}_out"] = list(o.shape)
        except fusionguard.DenseFallbackError as exc:
            result[f"{step}_raised"] = exc.event.get("blocked_by") or "strict"
        finally:
            del ballast
        result[f"{step}_calls"] = fusionguard.events("flex_call")[seen:]
    if "compiled" in outs and "dense" in outs:
        result["compiled_vs_dense"] = (outs["compiled"] - outs["dense"]).abs().max().item()
    if seq <= 1024 and "dense" in outs:  # the whole attention on one rank, sharded the same way
        from torch.nn.attention.flex_attention import create_block_mask

        with fusionguard.allow_dense(), torch.no_grad():
            ref = flex_attention(*full, block_mask=create_block_mask(causal, 1, 1, seq, seq, device=dev.type))
        (ref_local,) = _cp_shard(cp, mesh, [ref], False)
        result["dense_vs_reference"] = (outs["dense"] - ref_local.float()).abs().max().item()
    (out / f"cp{rank}.json").write_text(json.dumps(result, default=str))


def _cp_shard(cp, mesh, tensors, train: bool) -> list:
    """This rank's contiguous shard of each tensor along dim 2 (no load balancer)."""
    return [t.detach().requires_grad_(train) for t in cp.shard(mesh, tensors, [2] * len(tensors), load_balancer=None)]


def _ballast(dev: torch.device, leave: int) -> list:
    """Fill a CUDA device until about ``leave`` bytes can still be allocated (1 GiB chunks)."""
    from fusionguard.dense import memory as dense_memory

    chunks = []
    while True:
        free = dense_memory.free_bytes(dev)
        if free is None or free - leave < (64 << 20):
            return chunks
        chunks.append(torch.empty(min(1 << 30, free - leave), dtype=torch.uint8, device=dev))


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
