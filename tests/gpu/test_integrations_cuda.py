"""The framework callbacks *training* on a CUDA GPU (FlexAttention has no backward on CPU):
3 optimizer steps with compiled flex, forward and backward.

- Hugging Face ``Trainer`` with ``TrainingArguments(torch_compile=True)`` (the Trainer compiles the
  model itself): the first-step verdict says forward and backward fused in both layers; the
  cumulative ``fusionguard/fused_calls`` in ``log_history`` is layers x 2 phases x steps exactly;
  no ``watch_traced`` (the callback adds no hooks Dynamo traces);
- Lightning with per-block compiled flex layers: the same verdict and exact counts in the
  logger's file;
- ``stop_on_dense=True`` stops a run forced dense after its first step, in both frameworks.

Packages (beyond torch, triton, structlog): transformers, accelerate, lightning (with
pytorch-lightning, lightning-utilities, torchmetrics) and their dependencies, pinned in
tests/gpu/requirements-integrations.txt. Run: ``python -m pytest -q -rP tests/gpu/test_integrations_cuda.py``.
"""

from __future__ import annotations

import csv
import logging

import pytest
import torch
from conftest import Lines, fresh_hf_wrapper, read_jsonl
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import _testing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
STEPS, SEQ = 3, 512
FUSED_VERDICT = "fusionguard: step 1: 2 FlexAttention layers, forward fused 2/2, backward fused 2/2"


@pytest.fixture
def said():
    logger = logging.getLogger("fusionguard")
    handler = Lines()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    fusionguard.disable()
    _testing.reset_for_tests()
    torch._dynamo.reset()


# -- Hugging Face -------------------------------------------------------------------------------------


def hf_train(tmp_path, cb, **args):
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    fresh_hf_wrapper()
    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=512,
        vocab_size=256,
        attn_implementation="flex_attention",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 256, (8, SEQ), generator=g)]
    targs = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=True,
        disable_tqdm=True,
        **args,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=rows, callbacks=[cb])
    trainer.train()
    assert transformers.__version__
    return trainer


def test_hf_torch_compile_trains_fused_counts_exact(tmp_path, said):
    from fusionguard.integrations.transformers import FusionGuardCallback

    log = tmp_path / "fg.jsonl"
    trainer = hf_train(tmp_path, FusionGuardCallback(strict=True, log_path=str(log)), torch_compile=True)
    print("\n".join(said.lines))
    assert FUSED_VERDICT in said.lines
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["fusionguard/fused_calls"] for h in steps] == [2 * 2 * s for s in range(1, STEPS + 1)]
    assert all(h["fusionguard/dense_calls"] == 0 for h in steps)
    events = read_jsonl(log)
    assert [e for e in events if e["event"] in ("watch_traced", "flex_call")] == []
    assert sorted({e["layer"] for e in events if e["event"] == "flex_compile"}) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def test_hf_stop_on_dense_stops_a_forced_dense_run(tmp_path, said):
    from fusionguard.integrations.transformers import FusionGuardCallback

    with torch.compiler.set_stance("force_eager"):
        trainer = hf_train(tmp_path, FusionGuardCallback(stop_on_dense=True, log_path=str(tmp_path / "fg.jsonl")))
    assert trainer.state.global_step == 1
    assert any("stop_on_dense" in m for m in said.lines)
    verdict = [m for m in said.lines if m.startswith("fusionguard: step 1:")][0]
    assert "forward fused 0/2, backward fused 0/2; dense: model.layers.0.self_attn" in verdict
    assert trainer.state.log_history[0]["fusionguard/dense_calls"] == 2 * 2


# -- Lightning ----------------------------------------------------------------------------------------


def lightning_fit(tmp_path, cb, compiled):
    L = pytest.importorskip("lightning.pytorch")
    # The Hugging Face tests before these, in the same process, leave the per-backend TF32 API
    # set; Lightning reads the legacy one, which torch 2.11 then refuses ("mix of the legacy and
    # new APIs"). One legacy call puts both back in agreement (a fresh process never needs it).
    torch.set_float32_matmul_precision("highest")
    D = 256

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(D, 3 * D)

        def forward(self, x):
            B, S, _ = x.shape
            q, k, v = self.qkv(x).view(B, S, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
            return flex_attention(q, k, v).transpose(1, 2).reshape(B, S, D)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList([Attn(), Attn()])
            if compiled:
                for layer in self.layers:
                    layer.compile()

        def training_step(self, batch, idx):
            x = batch[0]
            for layer in self.layers:
                x = x + layer(x)
            return x.float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            x = torch.randn(8, SEQ, D, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=1)

    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=STEPS,
        callbacks=[cb],
        log_every_n_steps=1,
        logger=L.loggers.CSVLogger(str(tmp_path), name="csv"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net())
    return trainer


def csv_column(tmp_path, key):
    [path] = list(tmp_path.rglob("metrics.csv"))
    with open(path) as fh:
        return [float(r[key]) for r in csv.DictReader(fh) if r.get(key)]


def test_lightning_compiled_blocks_train_fused_counts_exact(tmp_path, said):
    from fusionguard.integrations.lightning import FusionGuardCallback

    lightning_fit(tmp_path, FusionGuardCallback(strict=True, log_path=str(tmp_path / "fg.jsonl")), compiled=True)
    print("\n".join(said.lines))
    assert "fusionguard: step 1: 2 FlexAttention layers, forward fused 2/2, backward fused 2/2" in said.lines
    assert csv_column(tmp_path, "fusionguard/fused_calls") == [2 * 2 * s for s in range(1, STEPS + 1)]
    assert csv_column(tmp_path, "fusionguard/dense_calls") == [0] * STEPS


def test_lightning_stop_on_dense(tmp_path, said):
    from fusionguard.integrations.lightning import FusionGuardCallback

    trainer = lightning_fit(tmp_path, FusionGuardCallback(stop_on_dense=True, log_path=str(tmp_path / "fg.jsonl")), compiled=False)
    assert trainer.global_step == 1
    assert any("stop_on_dense" in m for m in said.lines)
    assert csv_column(tmp_path, "fusionguard/dense_calls") == [2 * 2]


# -- the public session object in a plain training loop (#33) ----------------------------------------


def test_session_in_a_plain_training_loop_counts_each_step(tmp_path, said):
    """``fusionguard.track`` around a compiled model that trains: each ``step()`` is that step's
    fused forward and backward calls; the verdict says both phases fused; no hook stays."""
    from torch.utils.tensorboard import SummaryWriter

    D = 256

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(D, 3 * D)

        def forward(self, x):
            B, S, _ = x.shape
            q, k, v = self.qkv(x).view(B, S, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
            return flex_attention(q, k, v).transpose(1, 2).reshape(B, S, D)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Attn(), Attn()).cuda()
    for block in model:
        block.compile()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    writer = SummaryWriter(str(tmp_path / "tb"))
    steps = []
    with fusionguard.track(model, strict=True, log_path=str(tmp_path / "fg.jsonl")) as fg:
        for i in range(STEPS):
            x = torch.randn(1, SEQ, D, device="cuda")
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            step = fg.step()
            steps.append((step.dense, step.fused))
            for key, value in step.metrics().items():
                writer.add_scalar(key, value, i)
            if i == 0:
                assert fg.verdict("step 1", step).text == FUSED_VERDICT
    writer.close()
    assert steps == [(0, 2 * 2)] * STEPS
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
