"""The small models tests share. ``Model``, for the compile patterns (CPU inference, CUDA
training): two blocks, each an attention layer whose FlexAttention call sits in a method of its
own, optionally behind a graph break (``torch.compiler.disable`` or ``torch._dynamo.graph_break()``).
``GqaAttention``, ``Two`` and ``Blocks``: bare GQA attention layers taking q, k, v, for models
compiled whole or per block (report and watch tests)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

H, D, L = 2, 8, 32


class Attention(nn.Module):
    def __init__(self, brk: Optional[str] = None, h: int = H, d: int = D) -> None:
        super().__init__()
        self.h, self.d = h, d
        self.qkv = nn.Linear(h * d, 3 * h * d)
        self.out = nn.Linear(h * d, h * d)
        self.brk = brk  # None, "disable" (a compiler.disable'd method: dense), "graph_break"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # one buffer each: torch 2.8's Inductor refuses q/k/v that are views of one buffer
        q, k, v = (t.contiguous() for t in self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0))
        if self.brk == "disable":
            o = self.attend_eager(q, k, v)
        else:
            if self.brk == "graph_break":
                torch._dynamo.graph_break()
            o = self.attend(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, self.h * self.d))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex_attention(q, k, v)

    @torch.compiler.disable
    def attend_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex_attention(q, k, v)


class Block(nn.Module):
    def __init__(self, brk: Optional[str] = None, h: int = H, d: int = D) -> None:
        super().__init__()
        self.attn = Attention(brk, h, d)
        self.mlp = nn.Linear(h * d, h * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.attn(x))


class Model(nn.Module):
    """``brk`` applies to the last block only."""

    def __init__(self, n: int = 2, brk: Optional[str] = None, h: int = H, d: int = D) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(brk if i == n - 1 else None, h, d) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


# (l, h, d: the shape letters of L, H, D)
def tokens(
    seed: int = 0,
    device: str = "cpu",
    requires_grad: bool = False,
    l: int = L,  # noqa: E741
    h: int = H,
    d: int = D,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, l, h * d, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)


class GqaAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex_attention(q, k, v, enable_gqa=True)


class Two(nn.Module):
    """Two attention layers, ``a`` then ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = GqaAttention(), GqaAttention()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(q, k, v), k, v)


class Blocks(nn.Module):
    """Two ``Two`` blocks (``blocks.0.a`` ... ``blocks.1.b``): for compiling each block in place."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Two() for _ in range(2))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            q = b(q, k, v)
        return q


def blocks_compiled_in_place() -> Blocks:
    """A ``Blocks`` whose every block was compiled in place (``block.compile()``)."""
    model = Blocks()
    for b in model.blocks:
        b.compile()
    return model
