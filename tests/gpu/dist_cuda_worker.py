"""One torchrun worker for tests/gpu/test_distributed_cuda.py (two GPUs, NCCL).

    torchrun --nproc_per_node=2 --standalone tests/gpu/dist_cuda_worker.py SCENARIO OUT_DIR

SCENARIO:
  ddp     warn mode; a 2-layer FlexAttention model wrapped in DistributedDataParallel and
          compiled whole, trained 3 steps under ``watch`` on every rank (fused both ways); then
          rank 1 alone runs one eager forward+backward of its own layer (dense, warned)
  strict  strict mode; rank 1's eager call raises DenseFallbackError, rank 0 waits in an NCCL
          barrier that rank 1 never reaches until torchrun stops it

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
from dist_worker import finish, mark  # noqa: E402  (the CPU worker's helpers)

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


@record
def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=dev)
    fusionguard.enable(strict=(scenario == "strict"), log_path=str(out / "logs") + os.sep)
    mark(out, rank, "enabled")
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
