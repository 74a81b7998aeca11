"""fusionguard inside Lightning: one callback, counts through pl_module.log to every logger.

A small model of two FlexAttention blocks, each compiled in place (block.compile(): torchtitan's
per-block pattern), plus the same model uncompiled to show a dense run named by layer.
- On a CUDA GPU: fit() for 3 steps, strict mode: the first-step verdict says fused both ways;
  then the uncompiled model with stop_on_dense=True: the fit stops after its first step.
- On CPU (FlexAttention has no backward there): validate() of each.

    pip install 'fusionguard[lightning]'
    python examples/lightning_fit.py       # writes ./fusionguard.jsonl
"""

import warnings

import lightning.pytorch as L
import torch
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.integrations.lightning import FusionGuardCallback

D = 64


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v).transpose(1, 2).reshape(B, S, D)


class Net(L.LightningModule):
    def __init__(self, compiled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Attn(), Attn()])
        if compiled:
            for block in self.blocks:
                block.compile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x

    def training_step(self, batch, idx):
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch, idx):
        self.log("val_loss", self(batch[0]).pow(2).mean(), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def loader(self):
        x = torch.randn(4, 128, D, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=1)

    train_dataloader = val_dataloader = loader


def trainer(cb: FusionGuardCallback) -> L.Trainer:
    return L.Trainer(
        max_steps=3,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        model = Net(compiled=True).cuda()
        print("\n== fit(), blocks compiled, strict ==")
        t = trainer(FusionGuardCallback(strict=True))
        t.fit(model)
        print("callback_metrics:", {k: float(v) for k, v in t.callback_metrics.items() if k.startswith("fusionguard/")})
        print("\n== fit(), uncompiled (dense), stop_on_dense ==")
        t = trainer(FusionGuardCallback(stop_on_dense=True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fusionguard.DenseFallbackWarning)
            t.fit(Net(compiled=False).cuda())
        print("stopped at step", t.global_step)
    else:
        print("\n== validate(), blocks compiled, strict ==")
        print(trainer(FusionGuardCallback(strict=True)).validate(Net(compiled=True), verbose=False))
        print("\n== validate(), uncompiled: dense, warn mode ==")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fusionguard.DenseFallbackWarning)
            print(trainer(FusionGuardCallback()).validate(Net(compiled=False), verbose=False))
    print("\nfusionguard report fusionguard.jsonl   # the per-layer table from the log")


if __name__ == "__main__":
    main()
