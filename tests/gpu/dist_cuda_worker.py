"""One torchrun worker for tests/gpu/test_distributed_cuda.py (two GPUs, NCCL).

    torchrun --nproc_per_node=2 --standalone tests/gpu/dist_cuda_worker.py SCENARIO OUT_DIR

SCENARIO:
  ddp     warn mode; a 2-layer FlexAttention model wrapped in DistributedDataParallel and
          compiled whole, trained 3 steps under ``watch`` on every rank (fused both ways); then
          rank 1 alone runs one eager forward+backward of its own layer (dense, warned)
  strict  strict mode; rank 1's eager call raises DenseFallbackError, rank 0 waits in an NCCL
          barrier that rank 1 never reaches until torchrun stops it

  fsdp2_train      FSDP2 with compile per block (torchtitan's pattern: fully_shard each block,
                   block.compile(), then the model), 3 training steps in watch(model); each rank
                   writes OUT_DIR/rows{R}.json (summary) and OUT_DIR/counts{R}.json
  fsdp2_train_run  the same without watch(), launched under ``fusionguard run`` (no enable() here)
  fsdp2_strict     under ``fusionguard run --strict``: the same training, rank 1 forced eager
                   (set_stance) in step 2: its first block raises; rank 0 goes on into FSDP's
                   collectives (tests/dist_worker.py: fsdp2_strict)
  cp               context parallelism for FlexAttention, S = 16384 on 2 ranks, mode="oom":
                   compiled (fused), eager inside the CP region (dense, peak measured), then rank 1
                   fills its GPU so the dense forward cannot fit (tests/dist_worker.py:
                   context_parallel_flex; OUT_DIR/cp{R}.json)
  ddp_stop         Lightning, strategy="ddp", the model compiled, FusionGuardCallback(stop_on_dense=True):
                   rank 1 forced eager in step 2 (dense); both ranks stop after step 2 of 4

Each rank logs to OUT_DIR/logs/ (one file per rank and process); rank 0 writes
OUT_DIR/all_ranks.json (``summary(all_ranks=True)``, gathered over NCCL) and OUT_DIR/losses.json.
Marker files OUT_DIR/rank{R}.{step} say how far each rank got.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.parallel import DistributedDataParallel

import fusionguard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dist_worker import context_parallel_flex, finish, fsdp2_strict, mark  # noqa: E402  (the CPU worker's helpers)

SHAPE = dict(h=4, d=64)  # compile_models.Model's heads and head size on CUDA (as tests/gpu/test_compile_patterns_cuda.py)

HQ, HKV, D, Q, DIM = 8, 2, 64, 512, 256


def causal(b, h, q, kv):
    return q >= kv


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, HQ * D, bias=False)
        self.kv = nn.Linear(DIM, 2 * HKV * D, bias=False)
        self.o = nn.Linear(HQ * D, DIM, bias=False)

    def forward(self, x, mask):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HQ, D).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, HKV, D).permute(2, 0, 3, 1, 4)
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        return x + self.o(out.transpose(1, 2).reshape(b, n, HQ * D))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


def fsdp2_train(out: Path, rank: int, dev: torch.device, watch: bool) -> None:
    """FSDP2 + compile per block, 3 training steps (bf16), each rank its own batch."""
    import contextlib

    from compile_models import Model as Blocks
    from compile_models import tokens
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fusionguard.core.state import STATE

    torch.manual_seed(0)
    model = Blocks(**SHAPE).to(dev, torch.bfloat16)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
        block.compile()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fusionguard.watch(model) if watch else contextlib.nullcontext():
        for step in range(3):
            x = tokens(seed=10 * rank + step, device="cuda", l=256, dtype=torch.bfloat16, **SHAPE)
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    rows = [{k: r[k] for k in ("layer", "phase", "calls", "fused", "dense")} for r in fusionguard.summary()]
    (out / f"rows{rank}.json").write_text(json.dumps(rows))
    runs = [(e.get("layer"), e.get("phase")) for e in fusionguard.events("flex_run")]
    (out / f"counts{rank}.json").write_text(json.dumps({"counts": dict(STATE.counts), "runs": runs}))


def lightning_ddp_stop(out: Path, rank: int) -> None:
    """Lightning's fit() under strategy="ddp" with the model compiled; rank 1's step 2 runs eager
    (dense, warn mode); stop_on_dense stops every rank after that step."""
    import contextlib

    import lightning.pytorch as L

    from fusionguard.integrations.lightning import FusionGuardCallback

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = Model().to(torch.bfloat16)
            self.mask = None

        def training_step(self, batch, idx):
            if self.mask is None:
                self.mask = create_block_mask(causal, None, None, Q, Q, device=self.device)
                object.__setattr__(self, "compiled", torch.compile(self.model))  # (not a submodule: no second registration)
            forced = rank == 1 and self.global_step == 1  # the second step
            with torch.compiler.set_stance("force_eager") if forced else contextlib.nullcontext():
                return self.compiled(batch, self.mask).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(rank)
            return torch.utils.data.DataLoader([torch.randn(Q, DIM, generator=g).to(torch.bfloat16) for _ in range(8)], batch_size=2)

    cb = FusionGuardCallback(stop_on_dense=True, log_path=str(out / "logs") + os.sep)
    trainer = L.Trainer(
        accelerator="cuda",
        devices=2,
        strategy="ddp",
        callbacks=[cb],
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net())
    (out / f"result{trainer.global_rank}.json").write_text(
        json.dumps({"global_step": trainer.global_step, "world_size": trainer.world_size})
    )


@record
def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if scenario == "ddp_stop":  # Lightning sets up its own process group
        lightning_ddp_stop(out, rank)
        return
    # a long group timeout: a strict stop must not wait for it (the test measures what stops the ranks)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300 if scenario == "fsdp2_strict" else 60), device_id=dev)
    if not fusionguard.is_enabled():  # (under ``fusionguard run`` the start-up hook enabled it)
        fusionguard.enable(strict=(scenario == "strict"), mode="oom" if scenario == "cp" else None, log_path=str(out / "logs") + os.sep)
    mark(out, rank, "enabled")
    if scenario in ("fsdp2_train", "fsdp2_train_run"):
        fsdp2_train(out, rank, dev, watch=scenario == "fsdp2_train")
        finish(out, rank)
        return
    if scenario == "fsdp2_strict":
        fsdp2_strict(out, rank, dev, train=True, compiled=True, **SHAPE)
        return
    if scenario == "cp":
        context_parallel_flex(
            out, rank, dev, seq=16384, heads=8, dim=64, dtype=torch.bfloat16, steps=("compiled", "dense", "oom"), train=True
        )
        finish(out, rank)
        return
    mask = create_block_mask(causal, None, None, Q, Q, device=dev)

    if scenario == "strict":
        q = torch.randn(1, HQ, Q, D, device=dev, dtype=torch.bfloat16)
        if rank == 0:
            with fusionguard.allow_dense():
                flex_attention(q, q, q, block_mask=mask)
        else:
            # raise only once rank 0 is in the barrier: otherwise torchrun may stop rank 0 while
            # its first CUDA call still runs, and the test could not tell what it reached
            deadline = time.monotonic() + 120
            while not (out / "rank0.barrier").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            mark(out, rank, "raising")
            flex_attention(q, q, q, block_mask=mask)  # raises DenseFallbackError
        mark(out, rank, "barrier")
        dist.barrier()  # never completes: rank 1 is gone
        mark(out, rank, "after_barrier")
        return
    if scenario != "ddp":
        raise SystemExit(f"unknown scenario {scenario!r}")

    torch.manual_seed(0)  # same weights on both ranks (DDP also broadcasts them)
    model = Model().to(dev, torch.bfloat16)
    from fusionguard.core.state import STATE

    ddp = DistributedDataParallel(model, device_ids=[local])
    compiled = torch.compile(ddp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device=dev).manual_seed(100 + rank)  # each rank its own batch
    losses = []
    with fusionguard.watch(model):
        for _ in range(3):
            x = torch.randn(2, Q, DIM, device=dev, dtype=torch.bfloat16, generator=g)
            loss = compiled(x, mask).float().pow(2).mean()
            loss.backward()  # DDP all-reduces the gradients
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        mark(out, rank, "trained")
        (out / f"counts{rank}.json").write_text(json.dumps(dict(STATE.counts)))
        if rank == 1:  # one rank leaves the compiled path: an eager call of its own layer
            x = torch.randn(2, Q, DIM, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
            model.layers[0](x, mask).float().sum().backward()
    torch.cuda.synchronize()
    rows = fusionguard.summary(all_ranks=True)  # a collective over NCCL: every rank calls it
    weights = [p.detach().float().sum().item() for p in model.parameters()]
    all_losses = [None, None]
    dist.all_gather_object(all_losses, {"losses": losses, "weights": weights})
    if rank == 0:
        (out / "all_ranks.json").write_text(json.dumps(list(rows), default=str))
        (out / "losses.json").write_text(json.dumps(all_losses))
    finish(out, rank)


if __name__ == "__main__":
    main()
