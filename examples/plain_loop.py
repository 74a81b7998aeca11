"""A plain PyTorch loop with the public session object, counts logged to TensorBoard.

    python examples/plain_loop.py [LOGDIR]      # CPU, a few seconds; then: tensorboard --logdir LOGDIR

``fusionguard.track(model)`` enables fusionguard (or joins the one running), watches the model,
and counts every FlexAttention call from its start by layer, phase and cause. ``fg.step()``
gives each step's counts, logged here to a real ``torch.utils.tensorboard.SummaryWriter``. The
attention runs eagerly (dense, on purpose, inside ``allow_dense()`` for the first steps, then as
a mistake would) and then under ``torch.compile`` (fused): inference only, so it runs on CPU.
"""

from __future__ import annotations

import sys
import tempfile
import warnings

import torch
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.tensorboard import SummaryWriter

import fusionguard


class Attention(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(flex_attention(q, k, v).transpose(1, 2).reshape(B, S, D))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(), Attention()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def main(logdir: str) -> None:
    torch.manual_seed(0)
    model = Model().eval()
    compiled = torch.compile(model)
    writer = SummaryWriter(logdir)
    batch = torch.randn(2, 64, 32)
    warnings.simplefilter("ignore")  # (the dense steps warn; the counts below say it)
    with fusionguard.track(model, log_path=False) as fg, torch.no_grad():
        for i in range(6):
            if i < 2:
                with fusionguard.allow_dense():  # an eager reference step, on purpose
                    model(batch)
            elif i < 4:
                model(batch)  # eager by mistake: dense
            else:
                compiled(batch)  # fused
            step = fg.step()
            for key, value in step.metrics().items():  # (none while fusionguard is off: no false 0)
                writer.add_scalar(key, value, i)
            counted = f"dense {step.dense}, fused {step.fused}, allowed {step.allowed}"
            print(f"step {i}: {f'not checked ({step.off})' if step.off else counted}")
        print(fg.verdict("whole run", fg.counts()).text)
        print(fg.summary_text())
    writer.close()
    print(f"TensorBoard scalars in {logdir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fusionguard-tb-"))
