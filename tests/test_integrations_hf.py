"""fusionguard.integrations.transformers with the real Hugging Face Trainer: a tiny random Llama
(hidden 64, 2 layers, 4/2 heads, vocab 256, attn_implementation="flex_attention"), on CPU,
evaluate() only (FlexAttention has no backward on CPU; training is tests/gpu/test_integrations_cuda.py).

- warn mode, flex forced dense (set_stance("force_eager")): exact counts in log_history and in the
  verdict; strict: evaluate() raises naming the layer, and the Trainer can evaluate again;
- TrainingArguments(torch_compile=True): fused verdict, names from the model, no watch_traced
  (the callback puts no hooks Dynamo would trace); the one compiled run is shared (module fixture);
- attention that is not flex: the verdict says so, with config._attn_implementation;
- attach(): first in line, so a recording callback registered before it and TensorBoard get the keys.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
from conftest import Lines, fresh_hf_wrapper, read_jsonl

import fusionguard
from fusionguard import _lifecycle, _testing
from fusionguard.core import state as _state

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from fusionguard.integrations.transformers import FusionGuardCallback  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
BATCHES = 3


def tiny_llama(attn="flex_attention"):
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=256,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def data(n=BATCHES, length=32):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 256, (length,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def trainer_for(model, tmp_path, callbacks=(), **args):
    targs = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_eval_batch_size=1,
        report_to=args.pop("report_to", []),
        use_cpu=True,
        disable_tqdm=True,
        **args,
    )
    return Trainer(model=model, args=targs, eval_dataset=data(), callbacks=list(callbacks))


@pytest.fixture
def cleanup():
    yield
    fusionguard.disable()
    _testing.reset_for_tests()


def verdicts(lines):
    return [m for m in lines.lines if "batch 1" in m]


def test_evaluate_forced_dense_warn_counts_in_log_history(tmp_path, cleanup, fg_records):
    log = tmp_path / "fg.jsonl"
    trainer = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback(log_path=str(log))])
    assert fusionguard.is_enabled()  # on_init_end
    with torch.compiler.set_stance("force_eager"), pytest.warns(fusionguard.DenseFallbackWarning):
        metrics = trainer.evaluate()
    last = trainer.state.log_history[-1]
    assert last["fusionguard/dense_calls"] == 2 * BATCHES
    assert last["fusionguard/fused_calls"] == 0
    assert "fusionguard/peak_layer_bytes" not in last  # CPU: nothing measured
    assert metrics["eval_loss"] == last["eval_loss"]
    [line] = verdicts(fg_records)
    assert line == (
        "fusionguard: evaluation batch 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        "model.layers.0.self_attn forward x1 (compiler_disabled); model.layers.1.self_attn forward x1 (compiler_disabled)"
    )
    calls = [e for e in read_jsonl(log) if e["event"] == "flex_call"]
    assert sorted({e["layer"] for e in calls}) == LAYERS


def test_evaluate_strict_raises_naming_the_layer_and_the_trainer_goes_on(tmp_path, cleanup):
    trainer = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback(strict=True, log_path=str(tmp_path / "fg.jsonl"))])
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(fusionguard.DenseFallbackError, match="model.layers.0.self_attn") as err:
            trainer.evaluate()
        assert err.value.event["layer"] == LAYERS[0]
        with fusionguard.allow_dense():  # the Trainer is intact: it evaluates again
            metrics = trainer.evaluate()
    last = trainer.state.log_history[-1]
    assert (last["fusionguard/dense_calls"], last["fusionguard/allowed_calls"]) == (1, 2 * BATCHES)  # the blocked one counts
    assert metrics["eval_loss"] > 0


def test_an_earlier_enable_keeps_its_settings(tmp_path, cleanup):
    fusionguard.enable(strict=True, log_path=str(tmp_path / "mine.jsonl"))
    cb = FusionGuardCallback(strict=False)
    kept = trainer_for(tiny_llama(), tmp_path, [cb])
    assert cb.session.active and kept
    assert _state.STATE.config.strict


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """The one compiled run of this module: TrainingArguments(torch_compile=True), evaluate()."""
    tmp = tmp_path_factory.mktemp("hfc")
    fresh_hf_wrapper()
    log = tmp / "fg.jsonl"
    cb = FusionGuardCallback(strict=True, log_path=str(log))
    handler = Lines()
    logging.getLogger("fusionguard").addHandler(handler)
    try:
        trainer = trainer_for(tiny_llama(), tmp, [cb], torch_compile=True)
        hooks_before = sum(len(m._forward_pre_hooks) for m in trainer.model.modules())
        trainer.evaluate()
        history = list(trainer.state.log_history)
        compiled = type(trainer.model_wrapped).__name__
        first = len(handler.lines), len(read_jsonl(log))
        # (the Trainer prepares the model once: a second evaluate() runs it eagerly, its attention
        # calling Hugging Face's compiled flex_attention)
        trainer.evaluate()
        second = {
            "lines": handler.lines[first[0] :],
            "rows": sorted((r["layer"], r["fused"]) for r in cb.session.counts().rows),
            "summary": sorted((r["layer"], r["fused"]) for r in fusionguard.summary()),
        }
    finally:
        logging.getLogger("fusionguard").removeHandler(handler)
        fusionguard.disable()
        _testing.reset_for_tests()
        torch._dynamo.reset()
    events = read_jsonl(log)
    second["log"] = events[first[1] :]
    return {
        "log": events[: first[1]],
        "history": history,
        "lines": handler.lines[: first[0]],
        "hooks": hooks_before,
        "compiled": compiled,
        "second": second,
    }


def test_torch_compile_fused_verdict(compiled_run):
    assert compiled_run["compiled"] == "OptimizedModule"  # the Trainer compiled it
    assert "fusionguard: evaluation batch 1: 2 FlexAttention layers, forward fused 2/2" in compiled_run["lines"]
    last = compiled_run["history"][-1]
    assert (last["fusionguard/dense_calls"], last["fusionguard/fused_calls"]) == (0, 2 * BATCHES)


def test_torch_compile_adds_no_traced_hooks(compiled_run):
    """Names only: no hook Dynamo would trace (a longer compile), yet the records carry the names."""
    assert compiled_run["hooks"] == 0
    events = compiled_run["log"]
    assert [e for e in events if e["event"] == "watch_traced"] == []
    assert sorted({e["layer"] for e in events if e["event"] == "flex_compile"}) == LAYERS


def test_torch_compile_second_evaluate_names_the_same_layers(compiled_run):
    """The second evaluate() runs the model eagerly (the Trainer compiled it for the first): its
    fused calls, made by Hugging Face's compiled flex_attention, carry the layers that called it."""
    second = compiled_run["second"]
    assert "fusionguard: evaluation batch 1: 2 FlexAttention layers, forward fused 2/2" in second["lines"]
    assert {e["layer"] for e in second["log"] if e["event"] == "flex_run"} == set(LAYERS)
    assert second["rows"] == second["summary"] == [(name, 2 * BATCHES) for name in LAYERS]  # (both evaluates)


def test_attention_that_is_not_flex(tmp_path, cleanup, fg_records):
    trainer = trainer_for(tiny_llama("sdpa"), tmp_path, [FusionGuardCallback(log_path=False)])
    trainer.evaluate()
    assert verdicts(fg_records) == [
        "fusionguard: evaluation batch 1: no FlexAttention call: the model never ran flex (config._attn_implementation='sdpa')"
    ]
    assert trainer.state.log_history[-1]["fusionguard/fused_calls"] == 0


class Recorder(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_attach_reaches_earlier_callbacks_and_tensorboard(tmp_path, cleanup, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    rec = Recorder()
    trainer = trainer_for(tiny_llama(), tmp_path, [rec], report_to=["tensorboard"])
    assert type(trainer.callback_handler.callbacks[1]).__name__ == "TensorBoardCallback"  # report_to's: before ours
    cb = FusionGuardCallback.attach(trainer, log_path=False)
    assert trainer.callback_handler.callbacks[0] is cb
    assert FusionGuardCallback.attach(trainer) is cb  # a second attach moves, never adds
    assert sum(isinstance(c, FusionGuardCallback) for c in trainer.callback_handler.callbacks) == 1
    with pytest.raises(TypeError, match=r"attach\(trainer\): expected a transformers Trainer, got str"):
        FusionGuardCallback.attach("trainer")
    with pytest.raises(TypeError, match="fsync"):  # enable()'s own check, at construction
        FusionGuardCallback(fsync="sometimes")
    with torch.compiler.set_stance("force_eager"), pytest.warns(fusionguard.DenseFallbackWarning):
        trainer.evaluate()
    assert rec.seen[-1]["fusionguard/dense_calls"] == 2 * BATCHES
    assert trainer.state.log_history[-1]["fusionguard/dense_calls"] == 2 * BATCHES
    summary = Lines()
    logging.getLogger("transformers.integrations.fusionguard").addHandler(summary)
    try:
        trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)  # closes the writer
    finally:
        logging.getLogger("transformers.integrations.fusionguard").removeHandler(summary)
    [text] = summary.lines  # the summary table, through transformers' logger tree
    assert text.startswith("fusionguard summary:") and "model.layers.1.self_attn" in text
    assert fusionguard.is_enabled()  # disable() waits for the process's exit
    files = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.endswith("fusionguard/dense_calls")]
    assert tags, acc.Tags()["scalars"]
    assert [e.value for e in acc.Scalars(tags[0])] == [2 * BATCHES]


def test_missing_transformers_one_line_error(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import fusionguard\n"
        "try:\n import fusionguard.integrations.transformers\n"
        "except ImportError as e: print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == ("fusionguard.integrations.transformers needs transformers: pip install 'fusionguard[transformers]'")


def test_import_fusionguard_imports_no_framework():
    import subprocess
    import sys

    code = "import sys, fusionguard; print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == "[]"


def test_the_oom_mode_reaches_the_config_and_a_bad_option_names_the_callback(tmp_path, cleanup):
    """#25 part 4 through the integration: ``FusionGuardCallback(mode="oom")`` enables the oom
    mode at the Trainer's creation (never strict); a bad option fails when the callback is made."""
    kept = trainer_for(tiny_llama(), tmp_path, callbacks=[FusionGuardCallback(mode="oom", log_path=str(tmp_path / "fg.jsonl"))])
    assert fusionguard.is_enabled() and kept  # (the session ends with its Trainer)
    assert (_state.STATE.config.mode, _state.STATE.config.strict) == ("oom", False)
    assert read_jsonl(tmp_path / "fg.jsonl")[0]["config"]["mode"] == "oom"
    for bad, word in (
        ({"mode": "stirct"}, "mode"),
        ({"strict": True, "mode": "oom"}, "strict=True"),
        ({"nope": 1}, "nope"),
        ({"log_path": b"x"}, "log_path"),
    ):
        with pytest.raises((TypeError, ValueError)) as info:
            FusionGuardCallback(**bad)
        assert str(info.value).startswith("FusionGuardCallback()") and word in str(info.value), info.value


# -- #33: each failure of the issue, on the public session under the callback --------------------


def hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_strict_beats_the_launchers_default(tmp_path, cleanup):
    _lifecycle.enable_as("launcher", mode="warn", log_path=False)  # what `fusionguard run` does at torch import
    trainer = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback(strict=True)])
    with torch.compiler.set_stance("force_eager"), pytest.raises(fusionguard.DenseFallbackError):
        trainer.evaluate()


def test_attach_with_arguments_replaces_the_callback_and_keeps_them(tmp_path, cleanup):
    trainer = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback(log_path=False)])
    cb = FusionGuardCallback.attach(trainer, strict=True)
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, FusionGuardCallback)] == [cb]
    with torch.compiler.set_stance("force_eager"), pytest.raises(fusionguard.DenseFallbackError):
        trainer.evaluate()


def test_the_programs_enable_wins_and_the_conflict_is_said_once(tmp_path, cleanup, fg_records):
    fusionguard.enable(strict=False, log_path=False)
    for _ in range(2):
        trainer = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback(strict=True)])
    told = [m for m in fg_records.lines if "asked for" in m]
    assert told == [
        "fusionguard: FusionGuardCallback() asked for mode='strict', but the program's own fusionguard.enable() set "
        "mode='warn': the program's settings stand (pass them to that enable(), or leave them out of FusionGuardCallback())"
    ]
    with torch.compiler.set_stance("force_eager"), pytest.warns(fusionguard.DenseFallbackWarning):
        trainer.evaluate()


def test_no_hook_outlives_its_trainer_and_the_model_pickles(tmp_path, cleanup):
    import gc
    import io

    model = tiny_llama()
    trainers = [trainer_for(model, tmp_path, [FusionGuardCallback(log_path=False)]) for _ in range(5)]
    one = hooks(model)
    assert one > 0
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 16)))
    torch.save(model, io.BytesIO())  # during the session
    assert hooks(model) == one  # 5 Trainers on one model: one session's hooks
    del trainers
    gc.collect()
    assert hooks(model) == 0  # the Trainers went away: so did the hooks
    trainer_for(model, tmp_path, [FusionGuardCallback(log_path=False)])
    fusionguard.disable()
    assert hooks(model) == 0
    torch.save(model, io.BytesIO())


def test_fusionguard_off_says_so_and_logs_no_false_zero(tmp_path, cleanup, fg_records, monkeypatch):
    monkeypatch.setenv("FUSIONGUARD", "off")
    trainer = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback()])
    with torch.compiler.set_stance("force_eager"):
        trainer.evaluate()
    assert verdicts(fg_records) == [
        "fusionguard: evaluation batch 1: no verdict: FUSIONGUARD=off in the environment (the kill switch); "
        "FlexAttention calls are not checked"
    ]
    assert "fusionguard/dense_calls" not in trainer.state.log_history[-1]


def test_predict_is_labelled_prediction(tmp_path, cleanup, fg_records):
    trainer = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback(log_path=False)])
    with torch.compiler.set_stance("force_eager"), pytest.warns(fusionguard.DenseFallbackWarning):
        trainer.predict(data())
    assert [m.split(":")[1] for m in verdicts(fg_records)] == [" prediction batch 1"]


def head_only(model):
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))  # no backward through flex (none on CPU)
    return model


def test_model_init_is_followed_and_stop_on_dense_says_the_verdict_once(tmp_path, cleanup, fg_records):
    targs = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=1,
        max_steps=3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(
        model_init=lambda: head_only(tiny_llama()),
        args=targs,
        train_dataset=data(),
        callbacks=[FusionGuardCallback(stop_on_dense=True, log_path=False)],
    )
    with torch.compiler.set_stance("force_eager"), pytest.warns(fusionguard.DenseFallbackWarning):
        trainer.train()
    assert trainer.state.global_step == 1
    step1 = [m for m in fg_records.lines if m.startswith("fusionguard: step 1")]
    assert step1 == [
        "fusionguard: step 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        "model.layers.0.self_attn forward x1 (compiler_disabled); model.layers.1.self_attn forward x1 (compiler_disabled)"
    ]
    assert [m for m in fg_records.lines if "stop_on_dense" in m] == [
        "fusionguard: stop_on_dense: dense FlexAttention at step 1: training stops"
    ]


def test_a_callback_reused_in_a_new_trainer_follows_it_and_a_deleted_trainer_ends_its_session(tmp_path, cleanup):
    """A notebook: one callback object given to a new Trainer on a new model (it watches the new
    one too: one session per Trainer, and the old Trainer going away ends only its own);
    ``del trainer`` inside a function ends the session (the callback's stack lookup left no
    snapshot of the function's locals)."""
    import gc

    cb = FusionGuardCallback(log_path=False)
    first, second = tiny_llama(), tiny_llama()
    old = trainer_for(first, tmp_path, [cb])
    new = trainer_for(second, tmp_path, [cb])
    assert hooks(first) > 0 and hooks(second) > 0 and cb.session.model is second
    del old
    gc.collect()
    assert cb.session.active and hooks(second) > 0 and hooks(first) == 0
    del new
    gc.collect()
    assert hooks(second) == 0 and not fusionguard.is_enabled()
    with pytest.raises(TypeError, match=r"^FusionGuardCallback\(\): stop_on_dense must be True or False, not 'no'"):
        FusionGuardCallback(stop_on_dense="no")


# -- #33, a hostile tester's second round: whose calls a verdict counts ------------------------------


def test_a_train_that_raised_does_not_silence_a_later_evaluate(tmp_path, cleanup, fg_records):
    """No backward through flex on CPU: train() raises NotImplementedError (on_train_end never runs)."""
    trainer = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback(log_path=False)], max_steps=1, per_device_train_batch_size=1)
    trainer.train_dataset = data()
    with torch.compiler.set_stance("force_eager"), warnings_ignored():
        with pytest.raises(NotImplementedError):
            trainer.train()
        trainer.evaluate()
    assert verdicts(fg_records) == [
        "fusionguard: evaluation batch 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        "model.layers.0.self_attn forward x1 (compiler_disabled); model.layers.1.self_attn forward x1 (compiler_disabled)"
    ]


def test_batch_1_counts_only_its_own_calls(tmp_path, cleanup, fg_records):
    """Calls before evaluate() (the user's own forward, another Trainer's evaluate on the same model,
    a strict error's blocked call) are not its first batch's."""
    model = tiny_llama()
    mine = trainer_for(model, tmp_path, [FusionGuardCallback(log_path=False)])
    other = trainer_for(model, tmp_path, [FusionGuardCallback(log_path=False)])
    with torch.compiler.set_stance("force_eager"), warnings_ignored():
        with torch.no_grad():
            model(torch.arange(16)[None])
        other.evaluate()
        fg_records.lines.clear()
        mine.evaluate()
    assert verdicts(fg_records) == [
        "fusionguard: evaluation batch 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        "model.layers.0.self_attn forward x1 (compiler_disabled); model.layers.1.self_attn forward x1 (compiler_disabled)"
    ]
    strict = trainer_for(tiny_llama(), tmp_path, [FusionGuardCallback(strict=True, log_path=False)])
    fg_records.lines.clear()
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(fusionguard.DenseFallbackError):
            strict.evaluate()
        with fusionguard.allow_dense():
            strict.evaluate()
    assert verdicts(fg_records) == ["fusionguard: evaluation batch 1: 2 FlexAttention layers, forward fused 0/2 (2 allowed dense)"]


def test_one_callback_shared_by_two_trainers_watches_each_trainers_model(tmp_path, cleanup, fg_records):
    cb = FusionGuardCallback(log_path=False)
    first, second = tiny_llama(), tiny_llama()
    a, b = trainer_for(first, tmp_path, [cb]), trainer_for(second, tmp_path, [cb])
    with torch.compiler.set_stance("force_eager"), warnings_ignored():
        a.evaluate()
        assert cb.session.model is first and a.state.log_history[-1]["fusionguard/dense_calls"] == 2 * BATCHES
        b.evaluate()
        # (a session counts every call while it runs, process-wide: b's since b was made, a's evaluate too)
        assert cb.session.model is second and b.state.log_history[-1]["fusionguard/dense_calls"] == 4 * BATCHES
    assert len(verdicts(fg_records)) == 2 and all("forward fused 0/2; dense: model.layers.0" in v for v in verdicts(fg_records))


def test_a_callback_added_after_the_trainer_was_made(tmp_path, cleanup, fg_records):
    """``trainer.add_callback(cb)``: no on_init_end; evaluate() starts its session (no error, no
    false verdict on a batch it did not count), the next evaluate() gets the verdict."""
    trainer = trainer_for(tiny_llama(), tmp_path)
    trainer.add_callback(FusionGuardCallback(log_path=False))
    with torch.compiler.set_stance("force_eager"), warnings_ignored():
        trainer.evaluate()
        assert verdicts(fg_records) == [] and trainer.state.log_history[-1]["fusionguard/dense_calls"] == 2 * (BATCHES - 1)
        trainer.evaluate()
    assert len(verdicts(fg_records)) == 1 and "dense: model.layers.0.self_attn forward x1" in verdicts(fg_records)[0]


@contextlib.contextmanager
def warnings_ignored():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_a_shared_callback_attached_to_one_trainer_and_its_direct_log(tmp_path, cleanup):
    """One callback shared by two Trainers: ``attach(a, ...)`` ends a's session only (b's counts go
    on); a ``trainer.log()`` the program calls itself gets that Trainer's counts, not the last caller's."""
    import gc

    cb = FusionGuardCallback(log_path=False)
    a = trainer_for(tiny_llama(), tmp_path, [cb])
    with torch.compiler.set_stance("force_eager"), warnings_ignored():
        a.evaluate()  # (a's session counts these, b's was not started yet)
        b = trainer_for(tiny_llama(), tmp_path, [cb])
        b.evaluate()
        a.log({"x": 1.0})
        assert a.state.log_history[-1]["fusionguard/dense_calls"] == 4 * BATCHES  # a's own counts, not b's (2 * BATCHES)
        del b
        gc.collect()
        a.log({"x": 2.0})
        assert a.state.log_history[-1]["fusionguard/dense_calls"] == 4 * BATCHES
        c = trainer_for(tiny_llama(), tmp_path, [cb])
        FusionGuardCallback.attach(a, log_path=False)  # a gets a new callback; c keeps the shared one, and its session
        c.evaluate()
    assert c.state.log_history[-1]["fusionguard/dense_calls"] == 2 * BATCHES


def test_an_evaluate_that_raised_part_way_does_not_silence_the_next_one(tmp_path, cleanup, fg_records):
    """F3: a persistent eval dataloader (the same one for every evaluate()); the model raises at the
    2nd batch and the program catches it; the next evaluate() gets its own verdict, from its own calls."""
    trainer = trainer_for(
        tiny_llama(),
        tmp_path,
        [FusionGuardCallback(log_path=False)],
        dataloader_num_workers=1,
        dataloader_persistent_workers=True,
    )
    forwards = []

    def second_batch_raises(module, args):
        forwards.append(None)
        if len(forwards) == 2:
            raise RuntimeError("bad batch")

    trainer.model.register_forward_pre_hook(second_batch_raises)
    with torch.compiler.set_stance("force_eager"), warnings_ignored():
        with pytest.raises(RuntimeError, match="bad batch"):
            trainer.evaluate()
        trainer.evaluate()
        trainer.evaluate()
    line = (
        "fusionguard: evaluation batch 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        "model.layers.0.self_attn forward x1 (compiler_disabled); model.layers.1.self_attn forward x1 (compiler_disabled)"
    )
    assert verdicts(fg_records) == [line] * 3
    assert trainer.state.log_history[-1]["fusionguard/dense_calls"] == 2 * (1 + 2 * BATCHES)
