"""fusionguard.integrations.lightning with the real Lightning Trainer (and pytorch_lightning's), on
CPU: validate() only (FlexAttention has no backward on CPU; fitting is tests/gpu/).

- eager FlexAttention (dense) in warn mode: exact counts in validate()'s metrics and in a
  CSVLogger's file (pl_module.log reaches every logger); the verdict names both layers;
- strict: validate() raises naming the layer; on_exception wrote the crash record; teardown
  disabled fusionguard (the callback had enabled it);
- per-block compiled flex layers: fused verdict, fused counts;
- attention that is not flex: the verdict says so.
"""

from __future__ import annotations

import csv
import logging
import subprocess
import sys

import pytest
import torch
from conftest import Lines, read_jsonl
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import _testing
from fusionguard.core import state as _state

L = pytest.importorskip("lightning.pytorch")

from fusionguard.integrations.lightning import FusionGuardCallback, callback_class  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]
BATCHES, D = 3, 16


class Attn(torch.nn.Module):
    def __init__(self, flex=True):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.flex = flex

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        attn = flex_attention if self.flex else torch.nn.functional.scaled_dot_product_attention
        return attn(q, k, v).transpose(1, 2).reshape(B, S, D)


def make_module(base, flex=True, compiled=False):
    class Net(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList([Attn(flex), Attn(flex)])
            if compiled:
                for layer in self.layers:
                    layer.compile()  # per-block compile (torchtitan's pattern)

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

        def validation_step(self, batch, idx):
            loss = self(batch[0]).pow(2).mean()
            self.log("val_loss", loss, batch_size=1)
            return loss

        def val_dataloader(self):
            x = torch.randn(BATCHES, 32, D, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=1)

    return Net()


def trainer(pkg, tmp_path, cb, **kw):
    loggers = pkg.loggers if hasattr(pkg, "loggers") else pkg.pytorch.loggers
    return pkg.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[cb],
        logger=loggers.CSVLogger(str(tmp_path), name="csv"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kw,
    )


@pytest.fixture
def said(fg_records):
    yield fg_records
    fusionguard.disable()
    _testing.reset_for_tests()


def csv_rows(tmp_path):
    [path] = list(tmp_path.rglob("metrics.csv"))
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_validate_dense_warn_exact_counts(tmp_path, said):
    cb = FusionGuardCallback(log_path=str(tmp_path / "fg.jsonl"))
    summary = Lines()
    logging.getLogger("lightning.pytorch.callbacks.fusionguard").addHandler(summary)
    try:
        with pytest.warns(fusionguard.DenseFallbackWarning):
            [metrics] = trainer(L, tmp_path, cb).validate(make_module(L.LightningModule))
    finally:
        logging.getLogger("lightning.pytorch.callbacks.fusionguard").removeHandler(summary)
    assert (metrics["fusionguard/dense_calls"], metrics["fusionguard/fused_calls"]) == (2 * BATCHES, 0)
    [row] = [r for r in csv_rows(tmp_path) if r.get("fusionguard/dense_calls")]
    assert float(row["fusionguard/dense_calls"]) == 2 * BATCHES
    assert [m for m in said.lines if "batch 1" in m] == [
        "fusionguard: validation batch 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        "layers.0 forward x1 (eager_call); layers.1 forward x1 (eager_call)"
    ]
    [text] = summary.lines  # teardown: the summary table through Lightning's logger tree
    assert text.startswith("fusionguard summary:") and "layers.1" in text and "eager_call" in text
    assert not fusionguard.is_enabled()  # teardown: the callback had enabled it


def test_layers_built_in_configure_model_are_watched(tmp_path, said):
    """Lightning builds such layers after ``setup``: the callback watches at the loop's start, so
    the verdict still names them."""
    net = make_module(L.LightningModule)
    layers = net.layers
    del net.layers  # rebuilt where Lightning calls configure_model, after the callback's setup

    def configure_model():
        if not hasattr(net, "layers"):
            net.layers = layers

    net.configure_model = configure_model
    cb = FusionGuardCallback(log_path=str(tmp_path / "fg.jsonl"))
    with pytest.warns(fusionguard.DenseFallbackWarning):
        trainer(L, tmp_path, cb).validate(net)
    assert [m for m in said.lines if "batch 1" in m] == [
        "fusionguard: validation batch 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        "layers.0 forward x1 (eager_call); layers.1 forward x1 (eager_call)"
    ]


def test_validate_strict_raises_crash_record_and_teardown(tmp_path, said):
    log = tmp_path / "fg.jsonl"
    cb = FusionGuardCallback(strict=True, log_path=str(log))
    t = trainer(L, tmp_path, cb)
    with pytest.raises(fusionguard.DenseFallbackError, match="layers.0"):
        t.validate(make_module(L.LightningModule))
    assert t.state.status.value == "interrupted"
    assert not fusionguard.is_enabled()
    events = read_jsonl(log)
    crashes = [e for e in events if e["event"] == "crash"]
    assert [(c["where"], c["exc_type"].split(".")[-1]) for c in crashes] == [("lightning", "DenseFallbackError")]
    assert events[-1]["event"] == "shutdown"


def test_compiled_blocks_fused_verdict(tmp_path, said):
    cb = FusionGuardCallback(strict=True, log_path=str(tmp_path / "fg.jsonl"))
    [metrics] = trainer(L, tmp_path, cb).validate(make_module(L.LightningModule, compiled=True))
    assert (metrics["fusionguard/dense_calls"], metrics["fusionguard/fused_calls"]) == (0, 2 * BATCHES)
    assert "fusionguard: validation batch 1: 2 FlexAttention layers, forward fused 2/2" in said.lines


def test_a_module_compiled_whole_is_named_by_its_own_paths(tmp_path, said):
    """``validate(torch.compile(module))``: Lightning unwraps it and compiles the module's bound
    ``forward``, so Dynamo reaches the layers through ``self.__dict__['_modules']``: the names are
    still the module's own (``layers.0``) and the fused calls are counted (#33: they were dropped)."""

    class Counting(type(make_module(L.LightningModule))):
        n = 0

        def validation_step(self, batch, idx):  # (as a user writes it: state kept on the module)
            self.n += 1
            loss = self.layers[1](self.layers[0](batch[0])).pow(2).mean()
            self.log("val_loss", loss, batch_size=1)
            return loss

    cb = FusionGuardCallback(strict=True, log_path=False)
    [metrics] = trainer(L, tmp_path, cb).validate(torch.compile(Counting()))
    assert (metrics["fusionguard/dense_calls"], metrics["fusionguard/fused_calls"]) == (0, 2 * BATCHES)
    assert "fusionguard: validation batch 1: 2 FlexAttention layers, forward fused 2/2" in said.lines


def test_attention_that_is_not_flex(tmp_path, said):
    cb = FusionGuardCallback(log_path=False)
    [metrics] = trainer(L, tmp_path, cb).validate(make_module(L.LightningModule, flex=False))
    assert metrics["fusionguard/fused_calls"] == 0
    assert "fusionguard: validation batch 1: no FlexAttention call: the model never ran flex" in said.lines


def test_pytorch_lightning_variant(tmp_path, said):
    pl = pytest.importorskip("pytorch_lightning")
    cls = callback_class("pytorch_lightning")
    assert issubclass(cls, pl.Callback) and cls.__name__ == "PLFusionGuardCallback"
    with pytest.warns(fusionguard.DenseFallbackWarning):
        [metrics] = trainer(pl, tmp_path, cls(log_path=False)).validate(make_module(pl.LightningModule))
    assert metrics["fusionguard/dense_calls"] == 2 * BATCHES
    with pytest.raises(ValueError, match="package='keras'"):
        callback_class("keras")
    with pytest.raises(TypeError, match="unknown option"):
        cls(fsynk=True)


def test_missing_lightning_one_line_error():
    code = (
        "import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
        "import fusionguard.integrations.lightning as m\n"
        "try:\n m.FusionGuardCallback\n"
        "except ImportError as e: print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == "fusionguard.integrations.lightning needs lightning: pip install 'fusionguard[lightning]'"


def test_the_oom_mode_reaches_the_config_and_a_bad_option_names_the_callback(tmp_path, said):
    """``FusionGuardCallback(mode="oom")``: the oom mode at ``setup`` (never strict; on CPU nothing
    is known not to fit, so a dense call warns and runs); a bad option fails when it is made."""
    cb = FusionGuardCallback(mode="oom", log_path=str(tmp_path / "fg.jsonl"))
    trainer(L, tmp_path, cb, limit_val_batches=1).validate(make_module(L.LightningModule), verbose=False)
    assert (_state.STATE.config.mode, _state.STATE.config.strict) == ("oom", False)
    actions = {e["action"] for e in read_jsonl(tmp_path / "fg.jsonl") if e["event"] == "flex_call"}
    assert actions == {"warn"}
    for bad, word in (({"mode": "stirct"}, "mode"), ({"nope": 1}, "nope")):
        with pytest.raises((TypeError, ValueError)) as info:
            FusionGuardCallback(**bad)
        assert str(info.value).startswith("FusionGuardCallback()") and word in str(info.value), info.value


# -- #33: failures of the issue, on the public session under the callback -------------------------


def test_a_second_validate_counts_its_own_causes(tmp_path, said):
    cb = FusionGuardCallback(log_path=False)
    summary = Lines()
    logging.getLogger("lightning.pytorch.callbacks.fusionguard").addHandler(summary)
    try:
        t = trainer(L, tmp_path, cb)
        net = make_module(L.LightningModule)
        with pytest.warns(fusionguard.DenseFallbackWarning):
            t.validate(net, verbose=False)
            [metrics] = t.validate(net, verbose=False)
    finally:
        logging.getLogger("lightning.pytorch.callbacks.fusionguard").removeHandler(summary)
    assert metrics["fusionguard/dense_calls"] == 2 * BATCHES
    assert "eager_call×3" in summary.lines[-1] and "eager_call×6" not in summary.lines[-1], summary.lines[-1]


def test_keyboard_interrupt_is_named_in_the_summary(tmp_path, said):
    class Stop(L.Callback):
        def on_validation_start(self, trainer, pl_module):
            raise KeyboardInterrupt

    summary = Lines()
    logging.getLogger("lightning.pytorch.callbacks.fusionguard").addHandler(summary)
    try:
        cb = FusionGuardCallback(log_path=False)
        t = L.Trainer(
            accelerator="cpu",
            devices=1,
            callbacks=[cb, Stop()],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        with pytest.raises(SystemExit):  # (Lightning 2.6 turns the interrupt into exit status 1)
            t.validate(make_module(L.LightningModule), verbose=False)
    finally:
        logging.getLogger("lightning.pytorch.callbacks.fusionguard").removeHandler(summary)
    assert summary.lines == [
        "fusionguard summary:\nfusionguard: the run ended on KeyboardInterrupt: no FlexAttention call was counted before it"
    ]
    assert "no FlexAttention layer seen" not in "\n".join(said.lines)


def test_stop_on_dense_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^FusionGuardCallback\(\): stop_on_dense must be True or False, not 'no'"):
        FusionGuardCallback(stop_on_dense="no")
