"""Smoke tests: every script in examples/ runs end to end on CPU at tiny sizes (subprocess) and
prints the verdicts that its own log confirms."""

from __future__ import annotations

import os
import sys

import forkserver  # (a child that needs a process, not a fresh interpreter: tests/forkserver.py)
import pytest
from conftest import ROOT, read_jsonl

pytestmark = pytest.mark.slow
EXAMPLES = ROOT / "examples"


def run(script, *args, cwd, expect_rc=0, **extra_env):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", **extra_env)
    env.pop("FUSIONGUARD_LOG", None)
    proc = forkserver.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_example_has_a_smoke_test():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == [
        "dense_mask.py",
        "drafter.py",
        "early_warnings.py",
        "hf_trainer.py",
        "lightning_fit.py",
        "plain_loop.py",
        "quickstart.py",
    ]
    readme = (ROOT / "README.md").read_text()
    for p in EXAMPLES.glob("*.py"):
        assert f"examples/{p.name}" in readme, p.name  # README's list of examples names each


def test_plain_loop_logs_each_steps_counts_to_tensorboard(tmp_path):
    """#33: the public session object in a plain loop, its counts in a real SummaryWriter's file."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run("plain_loop.py", str(tmp_path / "tb"), cwd=tmp_path)
    assert "step 0: dense 0, fused 0, allowed 2" in out and "step 2: dense 2, fused 0, allowed 0" in out
    assert "step 5: dense 0, fused 2, allowed 0" in out
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("fusionguard/dense_calls")] == [0, 0, 2, 2, 0, 0]
    assert [e.value for e in acc.Scalars("fusionguard/fused_calls")] == [0, 0, 0, 0, 2, 2]


def test_plain_loop_under_the_kill_switch_logs_no_false_zero(tmp_path):
    """#33: ``fg.step().metrics()`` (the documented pattern) is empty while fusionguard is off."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run("plain_loop.py", str(tmp_path / "tb"), cwd=tmp_path, FUSIONGUARD="off")
    assert "step 2: not checked (FUSIONGUARD=off in the environment (the kill switch))" in out and "dense 0" not in out
    assert "whole run: no verdict: FUSIONGUARD=off" in out
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert list((tmp_path / "tb").iterdir()) and acc.Tags()["scalars"] == []  # a real event file, no fusionguard/* point


def test_early_warnings(tmp_path):
    """Part 1 and 3 of #25 as a user sees them (aot_eager: the same Dynamo compiles, quicker)."""
    out = run("early_warnings.py", "--backend", "aot_eager", cwd=tmp_path)
    assert "-> recompile_pressure: attention_step compiled 4 of 8 times (q dim 2 varies)" in out
    assert "fix: mark the dim dynamic: torch._dynamo.mark_dynamic(q, 2)" in out
    assert "6 lengths: 1 compile(s), 1 recompile_pressure event" in out
    assert "3 forwards, 1 warning, 1 no_flex_calls event" in out
    events = read_jsonl(tmp_path / "fusionguard.jsonl")
    assert [e["event"] for e in events].count("recompile_pressure") == 1
    from fusionguard.report.build import build as build_report_dict
    from fusionguard.report.render import render_text

    text = render_text(build_report_dict([str(tmp_path / "fusionguard.jsonl")]))
    assert "recompile pressure: 1 frame at 4 of 8 compiles (q dim 2 varies)" in text
    assert "no FlexAttention: 1 watched model ran a forward without any FlexAttention call" in text


def test_dense_mask(tmp_path):
    out = run("dense_mask.py", cwd=tmp_path)
    assert "create_block_mask is building a dense 10.49 MB mask eagerly" in out
    assert "(3 warnings, at " in out and "dense_mask.py:38)" in out
    assert "blocked before it built a dense 10.49 MB mask eagerly (strict mode)" in out
    assert "verdict: 4 eager mask build(s) seen (1 blocked), 1 compiled" in out
    events = [e for e in read_jsonl(tmp_path / "fusionguard.jsonl") if e["event"] == "mask_build"]
    assert [(e["path"], e.get("action")) for e in events] == [("dense", "warn")] * 3 + [("dense", "raise"), ("compiled", None)]
    from fusionguard.report.build import build as build_report_dict
    from fusionguard.report.render import render_text

    text = render_text(build_report_dict([str(tmp_path / "fusionguard.jsonl")]))
    assert "DENSE MASKS: 4 eager mask build(s) (1 blocked), largest 10.49 MB estimated" in text


def test_quickstart(tmp_path):
    out = run("quickstart.py", cwd=tmp_path)
    assert "dense FlexAttention forward blocked before it allocated" in out
    assert "verdict: 1 dense call(s) caught, 1 fused FlexAttention kernel(s) compiled" in out
    events = read_jsonl(tmp_path / "fusionguard.jsonl")
    calls = [e for e in events if e["event"] == "flex_call"]
    assert [(e["path"], e["cause"], e["action"]) for e in calls] == [("dense", "eager_call", "raise"), ("dense", "eager_call", "allow")]
    assert [e["template"] for e in events if e["event"] == "flex_compile"] == ["cpp"]
    # the report on the demo's log agrees with the demo: 1 caught, the reference call allowed
    from fusionguard.report.build import build as build_report_dict
    from fusionguard.report.render import render_text

    rep = build_report_dict([str(tmp_path / "fusionguard.jsonl")])
    t = rep["totals"]
    assert (t["dense_calls"], t["blocked_calls"], t["allowed_dense_calls"], t["fused_calls"], t["compiles"]) == (1, 1, 1, 1, 1)
    assert "DENSE: 1 dense FlexAttention call (1 blocked)" in render_text(rep)
    assert "fusionguard report fusionguard.jsonl" in out


def test_hf_trainer_example(tmp_path):
    """CPU: evaluate() through transformers' own compiled flex (fused), then forced dense."""
    pytest.importorskip("transformers")
    out = run("hf_trainer.py", cwd=tmp_path)
    assert "'fusionguard/dense_calls': 0.0, 'fusionguard/fused_calls': 4.0" in out
    assert "'fusionguard/dense_calls': 4.0, 'fusionguard/fused_calls': 4.0" in out
    events = read_jsonl(tmp_path / "fusionguard.jsonl")
    # an evaluate-only run shuts down cleanly: the callback's disable() at the process's exit
    assert (events[-1]["event"], events[-1]["reason"]) == ("shutdown", "disable")
    assert [e for e in events if e["event"] == "internal_error"] == []
    calls = [e for e in events if e["event"] == "flex_call"]
    assert (
        sorted((e["layer"], e["cause"]) for e in calls)
        == [("model.layers.0.self_attn", "compiler_disabled")] * 2 + [("model.layers.1.self_attn", "compiler_disabled")] * 2
    )


def test_lightning_fit_example(tmp_path):
    """CPU: validate() of per-block compiled flex blocks (fused, strict), then uncompiled (dense, warn)."""
    pytest.importorskip("lightning")
    out = run("lightning_fit.py", cwd=tmp_path)
    assert "'fusionguard/dense_calls': 0.0, 'fusionguard/fused_calls': 4.0" in out
    assert "'fusionguard/dense_calls': 4.0, 'fusionguard/fused_calls': 0.0" in out


def drafter(mode, tmp_path, *extra, expect_rc=0):
    log = tmp_path / f"{mode}.jsonl"
    out = run("drafter.py", "--mode", mode, "--steps", "2", "--log", str(log), *extra, cwd=tmp_path, expect_rc=expect_rc)
    assert "inference only (CPU: no FlexAttention gradients)" in out
    assert "fusionguard report: 1 file, 1 process, rank 0" in out  # the report ends the run
    events = read_jsonl(log)
    calls = [(e["layer"], e["phase"], e["path"], e["cause"]) for e in events if e["event"] == "flex_call"]
    compiles = [(e["layer"], e["template"]) for e in events if e["event"] == "flex_compile"]
    return out, calls, compiles


LAYERS = ["layers.0.attn", "layers.1.attn"]


def test_drafter_eager_strict_stops_before_dense(tmp_path):
    out, calls, compiles = drafter("eager", tmp_path, "--strict", expect_rc=1)
    assert "step 0: STOPPED by fusionguard (strict)" in out
    assert "blocked before it allocated a 327.68 KB score matrix" in out
    assert calls == [(LAYERS[0], "forward", "dense", "eager_call")] and compiles == []


def test_drafter_aot_eager_is_dense_in_every_layer(tmp_path):
    out, calls, compiles = drafter("aot_eager", tmp_path)
    assert calls == [(layer, "forward", "dense", "non_inductor_backend") for layer in LAYERS] * 2
    assert "verdict: 4 dense FlexAttention call(s), 0 fused kernel(s) compiled" in out
    assert "DENSE: 4 dense FlexAttention calls in 2 layer/phase pairs" in out


def test_drafter_compiled_is_fused(tmp_path):
    out, calls, compiles = drafter("compiled", tmp_path, "--strict")
    assert calls == [] and compiles == [(LAYERS[0], "cpp")]
    assert "OK: no dense FlexAttention; 4 fused calls, 1 compiled graph" in out


def test_drafter_recompile_slides_to_dense(tmp_path):
    out, calls, compiles = drafter("recompile", tmp_path)
    assert compiles == [(LAYERS[0], "cpp")]  # step 0, KV=320: fused
    assert calls == [(layer, "forward", "dense", "recompile_limit") for layer in LAYERS]  # step 1, KV=384
    assert "step 1: KV=384" in out and "forward dense (recompile_limit)" in out


def test_readme_first_screen_links_and_no_machine_paths():
    """README: the torch pin is explained above the two commands, which come first; the second is
    what CI runs verbatim; every docs link resolves (three pages come from other work in
    progress); no path of a development machine; under ~2,000 words."""
    import re

    text = (ROOT / "README.md").read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block == [
        "pip install torch==2.13.0 -e . && python examples/quickstart.py",
        "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q",
    ]
    assert "replaces it" in text.split("```bash", 1)[0]
    assert first_block[1] in (ROOT / ".ci" / "run").read_text()
    assert len(text.split()) < 2000 and "seed" not in text.lower()
    pending = {"docs/guarantees.md", "docs/compiled.md", "docs/compatibility.md"}
    for link in re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)(?:#[\w-]+)?\)", text):
        assert (ROOT / link).exists() or link in pending, link
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        assert "/work/" not in doc.read_text(), doc
