"""Hugging Face transformers (pinned in the `test` extra): a tiny random Llama with
attn_implementation="flex_attention", inference on CPU, verdicts per layer against what really ran.

What transformers does (docs/transformers.md): its `flex_attention_forward` never calls
flex_attention eagerly. Outside a user's compile it goes through `WrappedFlexAttention`, a process-wide
singleton holding `torch.compile(flex_attention)` (default dynamic=None: a new length recompiles
once, then the graph is dynamic); inside a user's compile it calls plain `flex_attention`, captured
by the user's backend. Every call passes a new `score_mod` closure, which does not recompile.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_hf_wrapper, read_jsonl, recompile_limit

import fusionguard
from fusionguard import _testing

transformers = pytest.importorskip("transformers")  # the `test` extra pins it; see setup.cfg
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

pytestmark = pytest.mark.slow
LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def tiny_llama():
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=128,
        attn_implementation="flex_attention",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def ids(length, seed=0):
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def kinds(log, *names):
    return [e for e in read_jsonl(log) if e["event"] in names]


@pytest.fixture(scope="module")
def hf_wrapper_run(tmp_path_factory):
    """The uncompiled model, lengths 32, 32, 48, 64: all through transformers' own compile wrapper."""
    log = tmp_path_factory.mktemp("hf") / "wrapper.jsonl"
    fresh_hf_wrapper()
    model = tiny_llama()
    fusionguard.enable(strict=True, log_path=str(log))
    try:
        with fusionguard.watch(model), torch.no_grad():
            outs = [model(ids(n)).logits for n in (32, 32, 48, 64)]
            rows = list(fusionguard.summary())
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
    return log, outs, rows, model


def test_wrapper_runs_fused_for_every_layer(hf_wrapper_run):
    log, outs, rows, _ = hf_wrapper_run
    assert [o.shape[1] for o in outs] == [32, 32, 48, 64]
    assert kinds(log, "flex_call", "flex_inlined", "recompile_limit") == []  # strict mode: no dense, no raise
    by_layer = {r["layer"]: r for r in rows if r["phase"] == "forward"}
    assert sorted(by_layer) == LAYERS
    for layer in LAYERS:
        assert (by_layer[layer]["calls"], by_layer[layer]["dense"], by_layer[layer]["fused"]) == (4, 0, 4)


def test_wrapper_compiles_once_per_shape_kind(hf_wrapper_run):
    """One compile for the first length, one dynamic recompile at 48 (reused for 64); both are
    attributed to the first layer that triggered them, the template is Inductor's C++ one."""
    log, *_ = hf_wrapper_run
    compiles = kinds(log, "flex_compile")
    assert [(c["layer"], c["phase"], c["path"], c["template"]) for c in compiles] == [(LAYERS[0], "forward", "fused", "cpp")] * 2
    assert compiles[0]["q_shape"] == [1, 4, 32, 16]
    assert isinstance(compiles[1]["q_shape"][2], str)  # symbolic: automatic dynamic shapes


def test_wrapper_compile_has_a_call_site(hf_wrapper_run):
    log, *_ = hf_wrapper_run
    assert kinds(log, "flex_compile")[0]["call_site"] is not None


def test_fused_matches_dense_reference(hf_wrapper_run, guard):
    """The same model run densely on purpose (force_eager: transformers' compiled wrapper runs eagerly)."""
    _, outs, _, model = hf_wrapper_run
    log = guard(strict=True)
    with fusionguard.watch(model), torch.no_grad(), torch.compiler.set_stance("force_eager"):
        with pytest.raises(fusionguard.DenseFallbackError) as err:
            model(ids(32))
        with fusionguard.allow_dense():
            ref = model(ids(32)).logits
    assert err.value.event["layer"] == LAYERS[0]
    assert err.value.event["cause"] == "compiler_disabled"
    calls = kinds(log, "flex_call")
    assert [(c["layer"], c["path"], c["cause"], c["action"]) for c in calls] == [
        (LAYERS[0], "dense", "compiler_disabled", "raise"),
        (LAYERS[0], "dense", "compiler_disabled", "allow"),
        (LAYERS[1], "dense", "compiler_disabled", "allow"),
    ]
    torch.testing.assert_close(outs[0], ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def recompile_limit_run(tmp_path_factory):
    """recompile_limit=1, lengths 32 then 48: the second length cannot recompile transformers'
    wrapper, which then runs flex_attention eagerly, densely, in every layer."""
    log = tmp_path_factory.mktemp("hf") / "recompile_limit.jsonl"
    fresh_hf_wrapper()
    model = tiny_llama()
    fusionguard.enable(strict=False, log_path=str(log))
    try:
        with torch._dynamo.config.patch(**recompile_limit(1)), fusionguard.watch(model), torch.no_grad():
            model(ids(32))
            with pytest.warns(fusionguard.DenseFallbackWarning):
                model(ids(48))
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
        fresh_hf_wrapper()
    return kinds(log, "flex_call")


def test_wrapper_goes_dense_at_recompile_limit(recompile_limit_run):
    calls = recompile_limit_run
    assert [(c["layer"], c["phase"], c["path"], c["traced"]) for c in calls] == [(layer, "forward", "dense", False) for layer in LAYERS]
    assert calls[0]["q_shape"] == [1, 4, 48, 16]
    assert calls[0]["call_site"]["file"].endswith("transformers/integrations/flex_attention.py")


def test_wrapper_recompile_limit_cause(recompile_limit_run):
    assert [c["cause"] for c in recompile_limit_run] == ["recompile_limit"] * 2


def test_compiled_model_aot_eager_is_dense(guard, dynamo_reset):
    """torch.compile(model, backend="aot_eager"): transformers sees Dynamo compiling and calls plain
    flex_attention, which the non-fusing backend runs densely."""
    model = tiny_llama()
    log = guard(strict=False)
    compiled = torch.compile(model, backend="aot_eager")
    with fusionguard.watch(model), torch.no_grad(), pytest.warns(fusionguard.DenseFallbackWarning):
        for _ in range(2):
            compiled(ids(32))
        rows = list(fusionguard.summary())
    calls = kinds(log, "flex_call")
    assert [(c["phase"], c["path"], c["cause"], c["traced"]) for c in calls] == [("forward", "dense", "non_inductor_backend", True)] * 4
    assert kinds(log, "flex_compile") == []
    # one row per attention layer, as the fused path names them (#35: all four were one `model` row)
    assert [c["layer"] for c in calls] == LAYERS * 2
    assert {r["layer"]: r["dense"] for r in rows if r["dense"]} == dict.fromkeys(LAYERS, 2)


@pytest.fixture(scope="module")
def inductor_model_run(tmp_path_factory, hf_wrapper_run):
    """torch.compile(model) (Inductor), strict: one compile of the model, transformers calls plain
    flex_attention inside it."""
    log = tmp_path_factory.mktemp("hf") / "inductor.jsonl"
    torch._dynamo.reset()
    model = tiny_llama()
    fusionguard.enable(strict=True, log_path=str(log))
    try:
        with fusionguard.watch(model), torch.no_grad():
            out = torch.compile(model)(ids(32)).logits
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
        torch._dynamo.reset()
    return log, out


def test_compiled_model_inductor_is_fused_per_layer(inductor_model_run, hf_wrapper_run):
    """Each layer's call is its own fused record (from the FX node's nn_module_stack); nothing dense."""
    log, out = inductor_model_run
    torch.testing.assert_close(out, hf_wrapper_run[1][0], rtol=1e-4, atol=1e-4)
    assert kinds(log, "flex_call") == []
    compiles = kinds(log, "flex_compile")
    assert sorted((c["phase"], c["path"], c["template"]) for c in compiles) == [("forward", "fused", "cpp")] * 2
    assert sorted(c["layer"].split("layers.", 1)[1] for c in compiles) == ["0.self_attn", "1.self_attn"]


def test_compiled_model_layer_names_match_watch(inductor_model_run):
    log, _ = inductor_model_run
    assert sorted(c["layer"] for c in kinds(log, "flex_compile")) == LAYERS


_UNWATCHED = """
import json, sys, torch, warnings
warnings.simplefilter("ignore")
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  intermediate_size=128, vocab_size=128, attn_implementation="flex_attention")
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 128, (1, 32))
with torch.no_grad():  # no watch(): a script knowing nothing of fusionguard
    for _ in range(2):
        model(ids)  # eager layers calling transformers' compiled flex_attention
    with torch.compiler.set_stance("force_eager"):
        model(ids)  # dense, in every layer
    compiled = torch.compile(model)  # the whole model
    for _ in range(2):
        compiled(ids)
import fusionguard
attn = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaAttention"]
json.dump({"rows": list(fusionguard.summary()), "attn": attn}, open(sys.argv[1], "w"), default=str)
"""


@pytest.mark.usefixtures("inductor_model_run")  # (#34: the same graphs, compiled: the child loads them, 51 -> 11 CPU s)
def test_without_watch_under_fusionguard_run_names_match_named_modules(tmp_path):
    """Issue 28: without watch(), Dynamo's names are relative to the frame it compiled (the model
    compiled whole runs the inner LlamaModel's: ``layers.0.self_attn``; transformers' compiled
    flex_attention: none); fusionguard finds the frame's module in the model holding it, or the
    layer calling the compiled function, so every row says what ``named_modules()`` says
    (``model.layers.0.self_attn``): fused calls of both paths and dense ones, per layer.
    The module's fixtures compiled the child's graphs (transformers' wrapper at length 32, the
    model compiled whole) into the session's Inductor cache first, on this xdist worker: the
    child's compiles are cache hits, as they were in a one-file run (names on the cache-hit path;
    the fixtures' tests check the lowering path)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    from fusionguard.report.build import build as build_report_dict

    script, logs, out = tmp_path / "infer.py", tmp_path / "logs", tmp_path / "out.json"
    script.write_text(_UNWATCHED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSIONGUARD")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "fusionguard", "run", "--log", f"{logs}/", "--", sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["attn"] == LAYERS
    expected = {(n, "forward"): (4, 1) for n in LAYERS}
    assert {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in result["rows"]} == expected
    (log,) = logs.glob("*.jsonl")
    compiles = [(e["layer"], e["named_from"]) for e in read_jsonl(log) if e["event"] == "flex_compile"]
    assert compiles == [(LAYERS[0], "caller"), (LAYERS[0], "nn_module_stack"), (LAYERS[1], "nn_module_stack")]
    assert [e["layer"] for e in read_jsonl(log) if e["event"] == "flex_call"] == LAYERS
    rep = build_report_dict([str(logs)])
    assert {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in rep["rows"]} == expected
    assert not [w for w in rep["warnings"] if "partial" in w]
