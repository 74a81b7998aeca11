"""The framework callbacks under ``torchrun --nproc_per_node=2`` on CPU (gloo): what
docs/integrations.md says of several processes. Every rank enables and logs to its own file,
counting its own calls; only rank 0 prints the verdict and the summary; rank 0's metrics are right.

The worker is tests/integrations_dist_worker.py: the real Hugging Face Trainer (train() 2 steps
with only lm_head trainable, then evaluate()) and the real Lightning Trainer (strategy="ddp",
validate()), flex forced dense in warn mode. Evaluation rows have distinct lengths, and each
framework hands rank R rows R and R + 2: a rank's log shows whose calls it counted. torchrun
redirects each rank's stdout and stderr to its own file (``--redirects 3``), so what each rank
printed is known. ``stop_on_dense`` with only rank 1 dense: every rank stops at the same step.
About 15-20 CPU s a launch, most of it imports: a framework's two scenarios share one launch
(``launched``: the stop scenario first, its Trainer and session ended before the next starts;
the other last, ending at the process's exit as it would alone).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import read_jsonl
from integrations_dist_worker import LENGTHS, MARK, TRAIN_STEPS
from test_distributed import HERE, LAUNCH_TIMEOUT, flex_calls, launch, output, torchrun

pytestmark = [torchrun, pytest.mark.slow]
WORKER = HERE / "integrations_dist_worker.py"
HF = ("hf_stop", "hf")  # (one launch each: the stop scenario first, the other ends at the process's exit)
LIGHTNING = ("lightning_stop", "lightning")
HF_LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")
L_LAYERS = ("layers.0", "layers.1")


def run(framework: str, out: Path):
    """torchrun the worker for FRAMEWORK (or several, comma-separated) in OUT: (launch, printed)."""
    timeout = LAUNCH_TIMEOUT * 2 * len(framework.split(","))
    proc = launch(framework, out, worker=WORKER, timeout=timeout, options=["--redirects=3", f"--log-dir={out / 'torchrun'}"])
    assert proc.returncode == 0, output(proc) + printed_text(out)
    return proc, printed(out)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(FRAMEWORK, *together)``: one launch running ``together`` one after the other (once
    per module): FRAMEWORK's directory, the launch and what each rank printed while FRAMEWORK ran."""
    done: dict = {}

    def get(framework: str, *together: str) -> tuple:
        key = ",".join(together)
        if key not in done:
            out = tmp_path_factory.mktemp("integ")
            done[key] = (out, *run(key, out))
        out, proc, texts = done[key]
        return out / framework, proc, {rank: part(text, framework) for rank, text in texts.items()}

    return get


def part(text: str, framework: str) -> str:
    """What the worker printed while FRAMEWORK ran (stdout and stderr: each starts with a mark)."""
    sections = re.split(f"^{re.escape(MARK)}(\\w+)\n", text, flags=re.MULTILINE)
    found = [body for name, body in zip(sections[1::2], sections[2::2]) if name == framework]
    assert len(found) == 2, f"{framework}: {len(found)} marked sections (stdout and stderr expected)"
    return "".join(found)


def printed(out: Path) -> Dict[int, str]:
    """{local rank: what the worker wrote on stdout and stderr}, from torchrun's per-rank files."""
    texts: Dict[int, str] = {}
    for f in sorted((out / "torchrun").rglob("std*.log")):
        rank = int(f.parent.name)
        texts[rank] = texts.get(rank, "") + f.read_text()
    assert sorted(texts) == [0, 1], list((out / "torchrun").rglob("*"))
    return texts


def printed_text(out: Path) -> str:
    try:
        return "".join(f"\n--- rank {r}\n{t}" for r, t in printed(out).items())
    except Exception:  # (the launch failed before torchrun wrote them)
        return ""


def check_rank_log(events: List[dict], rank: int, log_file: Path) -> None:
    header = events[0]
    assert header["event"] == "header" and header["world_size"] == 2 and header["local_rank"] == rank
    assert header["config"]["log_path"] == str(log_file)
    assert all(e["rank"] == rank for e in events), log_file
    assert events[-1]["event"] == "shutdown" and events[-1]["reason"] == "disable"


def speakers(texts: Dict[int, str], pattern: str) -> List[int]:
    """The rank of each line that matches ``pattern`` (at the start of a line), across both ranks."""
    return [rank for rank, text in sorted(texts.items()) for _ in re.finditer(pattern, text, re.MULTILINE)]


def test_hf_trainer_every_rank_logs_rank0_speaks(launched):
    tmp_path, proc, texts = launched("hf", *HF)
    # one file per rank, by default in the working directory (fusionguard.rank{R}.jsonl)
    files = sorted(tmp_path.glob("fusionguard*.jsonl"))
    assert [f.name for f in files] == ["fusionguard.rank0.jsonl", "fusionguard.rank1.jsonl"]
    for rank, f in enumerate(files):
        events = read_jsonl(f)
        check_rank_log(events, rank, f)
        train = [(layer, 16) for _ in range(TRAIN_STEPS) for layer in HF_LAYERS]
        evaluation = [(layer, LENGTHS[row]) for row in (rank, rank + 2) for layer in HF_LAYERS]
        calls = flex_calls(events)
        assert [(c["layer"], c["q_shape"][2]) for c in calls] == train + evaluation, f"rank {rank} logs its own calls"
        assert {(c["path"], c["action"], c["cause"]) for c in calls} == {("dense", "warn", "compiler_disabled")}
        [summary] = [e for e in events if e["event"] == "summary"]  # at the process's exit
        assert [(r["layer"], r["dense"]) for r in summary["rows"]] == [(layer, 4) for layer in HF_LAYERS]
        assert f"fusionguard: logging FlexAttention verdicts to {f}" in texts[rank]
    # only rank 0 speaks: each verdict and the summary once, across both processes' output
    assert speakers(
        texts,
        r"^fusionguard: step 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        r"model\.layers\.0\.self_attn forward x1 \(compiler_disabled\)",
    ) == [0]
    assert speakers(texts, rf"^fusionguard: step {TRAIN_STEPS}, evaluation batch 1: 2 FlexAttention layers") == [0]
    assert speakers(texts, r"^fusionguard: (step|evaluation)") == [0, 0]
    assert speakers(texts, r"^(\[transformers\] )?fusionguard summary:") == [0]
    assert "fusionguard" not in proc.stdout + proc.stderr  # (torchrun's own output: the workers' is redirected)
    # metrics: cumulative since the callback started, each rank its own (2 layers per step, per batch)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert (result["world_size"], result["process_index"]) == (2, rank)
        history = result["log_history"]
        dense = [(e.get("step"), "loss" in e, "eval_loss" in e, e["fusionguard/dense_calls"]) for e in history]
        assert dense == [(1, True, False, 2), (2, True, False, 4), (2, False, False, 4), (2, False, True, 8)]
        assert all(e["fusionguard/fused_calls"] == 0 for e in history)
        assert result["metrics"]["fusionguard/dense_calls"] == 8
        assert result["metrics"]["eval_loss"] == history[-1]["eval_loss"]


def test_lightning_ddp_every_rank_logs_rank0_speaks(launched):
    pytest.importorskip("lightning.pytorch")
    tmp_path, proc, texts = launched("lightning", *LIGHTNING)
    files = sorted((tmp_path / "logs").glob("fusionguard.rank*.pid*.jsonl"))
    assert [f.name.split(".")[1] for f in files] == ["rank0", "rank1"], files
    for rank, f in enumerate(files):
        events = read_jsonl(f)
        check_rank_log(events, rank, f)
        calls = flex_calls(events)
        assert [(c["layer"], c["q_shape"][2]) for c in calls] == [
            (layer, LENGTHS[row]) for row in (rank, rank + 2) for layer in L_LAYERS
        ], f"rank {rank} logs its own calls"
        assert {(c["path"], c["action"], c["cause"]) for c in calls} == {("dense", "warn", "eager_call")}
        result = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert (result["world_size"], result["global_rank"]) == (2, rank)
        assert (result["metrics"]["fusionguard/dense_calls"], result["metrics"]["fusionguard/fused_calls"]) == (4, 0)
    assert speakers(
        texts,
        r"^fusionguard: validation batch 1: 2 FlexAttention layers, forward fused 0/2; dense: "
        r"layers\.0 forward x1 \(eager_call\); layers\.1 forward x1 \(eager_call\)$",
    ) == [0]
    assert speakers(texts, r"^fusionguard: (step|validation)") == [0]
    assert speakers(texts, r"^fusionguard summary:") == [0]
    assert "fusionguard" not in proc.stdout + proc.stderr


def test_hf_stop_on_dense_stops_every_rank_together(launched):
    """Only rank 1 runs dense (rank 0's model runs sdpa): a rank stopping alone would leave the
    other failing (gloo) or waiting (NCCL) in its next step's collective. Every rank stops at
    step 1, and rank 0 says which rank ran dense."""
    check_hf_stop(*launched("hf_stop", *HF))


def check_hf_stop(tmp_path, proc=None, texts=None):
    """(also tests/gpu/test_integrations_dist_cuda.py, with NCCL: a launch of its own)"""
    if proc is None:
        proc, texts = run("hf_stop", tmp_path)
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["global_step"] for r in results] == [1, 1], "both ranks stop after step 1 (of 3)"
    logs = [read_jsonl(tmp_path / f"fusionguard.rank{rank}.jsonl") for rank in (0, 1)]
    assert flex_calls(logs[0]) == []
    assert [c["layer"] for c in flex_calls(logs[1])] == list(HF_LAYERS)
    assert speakers(
        texts,
        r"^fusionguard: step 1: no FlexAttention call: the model never ran flex "
        r"\(config\._attn_implementation='sdpa'\)$",
    ) == [0]  # rank 0's own verdict, once (#33: not again with the stop)
    assert speakers(texts, r"^fusionguard: stop_on_dense: dense FlexAttention on rank 1 at step 1: training stops$") == [0]
    assert speakers(texts, r"^fusionguard: stop_on_dense") == [0]


def test_lightning_stop_on_dense_stops_every_rank_together(launched):
    """The same with Lightning's fit() under strategy="ddp" (trainer.should_stop on every rank)."""
    pytest.importorskip("lightning.pytorch")
    check_lightning_stop(*launched("lightning_stop", *LIGHTNING))


def check_lightning_stop(tmp_path, proc=None, texts=None):
    """(also tests/gpu/test_integrations_dist_cuda.py, with NCCL: a launch of its own)"""
    pytest.importorskip("lightning.pytorch")
    if proc is None:
        proc, texts = run("lightning_stop", tmp_path)
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["global_step"] for r in results] == [1, 1], "both ranks stop after step 1 (of 3)"
    files = sorted((tmp_path / "logs").glob("fusionguard.rank*.pid*.jsonl"))
    logs = [read_jsonl(f) for f in files]
    assert flex_calls(logs[0]) == []
    assert [c["layer"] for c in flex_calls(logs[1])] == list(L_LAYERS)
    assert speakers(texts, r"^fusionguard: step 1: no FlexAttention call: the model never ran flex$") == [0]
    assert speakers(texts, r"^fusionguard: stop_on_dense: dense FlexAttention on rank 1 at step 1: training stops$") == [0]
    assert speakers(texts, r"^fusionguard: stop_on_dense") == [0]
