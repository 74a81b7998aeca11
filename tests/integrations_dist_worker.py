"""One torchrun worker for tests/test_integrations_dist.py (CPU, gloo): a framework's own Trainer
in several processes, with fusionguard's callback, flex forced dense in warn mode.

    torchrun --nproc_per_node=2 --standalone tests/integrations_dist_worker.py FRAMEWORK[,FRAMEWORK...] OUT_DIR

Several (comma-separated; only the last may end at the process's exit): one after the other in
one launch, each in OUT_DIR/FRAMEWORK as its working directory, its output after a line
``MARK + FRAMEWORK`` on stdout and stderr; each Trainer and its callback's session end before the
next starts (checked). The launch's start (torchrun's agent, two workers importing torch and
the framework) is paid once.

FRAMEWORK:
  hf         Hugging Face Trainer, the tiny Llama of tests/test_integrations_hf.py under
             set_stance("force_eager"): train() 2 steps with only lm_head trainable (no backward
             through flex, which CPU lacks), then evaluate() over 4 rows of lengths LENGTHS (the
             Trainer hands rank R rows R and R + 2); the callback logs to its default file
             (``fusionguard.rank{R}.jsonl`` in the working directory, OUT_DIR);
  hf_stop    the same Trainer with stop_on_dense=True and 3 steps, but rank 0's model runs sdpa:
             only rank 1 runs dense; the ranks must stop together (no evaluate());
  lightning_stop  the same module's fit() (max_steps=3, only a head after the frozen attention
             trains) with stop_on_dense=True; rank 0's layers run sdpa, rank 1's flex (dense);
  lightning  lightning.pytorch Trainer(strategy="ddp", accelerator="cpu", devices=2).validate()
             over the same 4 lengths; the callback logs to OUT_DIR/logs/ (a file per rank).

FG_INTEG_DEVICE=cuda: the same on two GPUs with NCCL (one per rank). Each rank writes
OUT_DIR/result{R}.json (the metrics its Trainer holds). The process group is the framework's
(accelerate's or Lightning's), not this worker's.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import fusionguard

DEVICE = os.environ.get("FG_INTEG_DEVICE", "cpu")  # "cuda": NCCL (tests/gpu/test_integrations_dist_cuda.py)
MARK = "=== integrations_dist_worker: "  # + FRAMEWORK: where its output starts
LENGTHS = (16, 24, 32, 40)  # evaluation rows: rank R runs rows R and R + 2
TRAIN_STEPS = 2


def hf(out: Path, rank: int, stop: bool = False) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from fusionguard.integrations.transformers import FusionGuardCallback

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=256,
        attn_implementation="sdpa" if stop and rank == 0 else "flex_attention",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))  # the backward never reaches flex (none on CPU)

    def rows(lengths):
        g = torch.Generator().manual_seed(0)
        out = []
        for n in lengths:
            ids = torch.randint(0, 256, (n,), generator=g)
            out.append({"input_ids": ids, "labels": ids.clone()})
        return out

    args = TrainingArguments(
        output_dir=str(out / "out"),
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        max_steps=TRAIN_STEPS + stop,
        logging_steps=1,
        report_to=[],
        use_cpu=DEVICE == "cpu",
        disable_tqdm=True,
        save_strategy="no",
        ddp_backend="gloo" if DEVICE == "cpu" else "nccl",
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows([16] * 4),
        eval_dataset=rows(LENGTHS),
        callbacks=[FusionGuardCallback(stop_on_dense=stop)],
    )
    with torch.compiler.set_stance("force_eager"):
        trainer.train()
        metrics = {} if stop else trainer.evaluate()
    return {
        "metrics": metrics,
        "log_history": trainer.state.log_history,
        "world_size": trainer.args.world_size,
        "process_index": trainer.args.process_index,
        "global_step": trainer.state.global_step,
    }


def lightning(out: Path, rank: int, stop: bool = False) -> dict:
    import lightning.pytorch as L
    from torch.nn.attention.flex_attention import flex_attention

    from fusionguard.integrations.lightning import FusionGuardCallback

    D = 16

    class Attn(torch.nn.Module):
        def __init__(self, flex):
            super().__init__()
            self.qkv = torch.nn.Linear(D, 3 * D)
            self.attention = flex_attention if flex else torch.nn.functional.scaled_dot_product_attention

        def forward(self, x):
            B, S, _ = x.shape
            q, k, v = self.qkv(x).view(B, S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
            return self.attention(q, k, v).transpose(1, 2).reshape(B, S, D)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            flex = not (stop and rank == 0)
            self.layers = torch.nn.ModuleList([Attn(flex), Attn(flex)]).requires_grad_(False)  # no backward through flex
            self.head = torch.nn.Linear(D, D)

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

        def validation_step(self, batch, idx):
            loss = self(batch).pow(2).mean()
            self.log("val_loss", loss, batch_size=1, sync_dist=True)
            return loss

        def training_step(self, batch, idx):
            return self.head(self(batch)).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.head.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader([torch.randn(16, D) for _ in LENGTHS], batch_size=1)

        def val_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = [torch.randn(n, D, generator=g) for n in LENGTHS]
            return torch.utils.data.DataLoader(data, batch_size=1)

    cb = FusionGuardCallback(stop_on_dense=stop, log_path=str(out / "logs") + os.sep)
    trainer = L.Trainer(
        accelerator=DEVICE,
        devices=2,
        strategy="ddp",
        callbacks=[cb],
        max_steps=3,
        limit_val_batches=0 if stop else None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    if stop:
        trainer.fit(Net())
        metrics = {}
    else:
        [metrics] = trainer.validate(Net())
    return {
        "metrics": {k: float(v) for k, v in metrics.items()},
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "global_step": trainer.global_step,
    }


@record
def main() -> None:
    frameworks, root = sys.argv[1].split(","), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    warnings.filterwarnings("ignore")  # torch's "flex_attention called without torch.compile", ours
    for framework in frameworks:
        out = root / framework if len(frameworks) > 1 else root
        out.mkdir(exist_ok=True)
        os.chdir(out)  # (hf: the callback's default log, in the working directory)
        for stream in (sys.stdout, sys.stderr):
            print(MARK + framework, file=stream, flush=True)
        run, stop = {"hf": (hf, False), "hf_stop": (hf, True), "lightning": (lightning, False), "lightning_stop": (lightning, True)}[
            framework
        ]
        result = run(out, rank, stop)
        (out / f"result{rank}.json").write_text(json.dumps(result, default=str))
        if framework != frameworks[-1]:
            gc.collect()  # (the Trainer is gone: its callback's session ends with it)
            assert not fusionguard.is_enabled(), f"{framework}: fusionguard still on after its Trainer"


if __name__ == "__main__":
    main()
