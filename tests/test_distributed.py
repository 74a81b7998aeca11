"""torchrun --nproc_per_node=2 on CPU with gloo: per-rank logs, one rank dense, strict failure.

Five torchrun launches in all (each about 12 CPU s of process start-up, imports and the group's
set-up); the worker is tests/dist_worker.py. Scenarios that end cleanly and need no start-up hook
share a launch (``launched``: "both" and "rank1"; "fsdp2" and "cp"), one after the other, each
with its own enable(), log directory and disable(). gather_to_rank0 is tested inside the workers
and, without a process group, in this process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest
from conftest import lacks, needs, read_jsonl

from fusionguard.eventlog.distributed import gather_to_rank0, process_group_ready

HERE = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LAUNCH_TIMEOUT = 90  # a launch takes ~10 s; the limit only stops a hung one

torchrun = pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo on localhost: Linux/macOS")


#: NVLink multicast off in every process (the device's notes; harmless off NCCL): set in the
#: environment torchrun and its workers inherit, children included.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch(
    scenario: str,
    out: Path,
    worker: Path = HERE / "dist_worker.py",
    timeout: float = LAUNCH_TIMEOUT,
    options: Sequence[str] = (),
    runner: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """RUNNER torchrun (with torchrun ``options``) WORKER SCENARIO OUT in OUT, two workers
    (``runner``: e.g. ``fusionguard run --log logs/ --``)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p),
        PYTHONWARNINGS="ignore",
        **NO_MULTICAST,
    )
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # containers whose hostname does not resolve
    env.pop("FUSIONGUARD_LOG", None)
    env.pop("FUSIONGUARD", None)
    cmd = (
        [*runner]
        + TORCHRUN
        + [
            "--nproc_per_node=2",
            "--standalone",
            "--monitor-interval=0.1",
            *options,
            str(worker),
            scenario,
            str(out),
        ]
    )
    # own process group: on a timeout the workers go down with torchrun, not orphaned
    proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun {scenario} hung for {timeout} s\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def fusionguard_run(out: Path, *mode: str) -> list:
    """``fusionguard run [MODE] --log OUT/logs/ --``: enables fusionguard in each worker, not the agent."""
    return [sys.executable, "-m", "fusionguard", "run", *mode, "--log", f"{out / 'logs'}{os.sep}", "--"]


def rank_logs(out: Path) -> dict:
    """{rank: events} from the per-rank files in out/logs, checking every event's rank."""
    files = sorted((out / "logs").glob("fusionguard.rank*.pid*.jsonl"))
    logs = {}
    for f in files:
        rank = int(f.name.split(".")[1][len("rank") :])
        pid = int(f.name.split(".")[2][len("pid") :])
        events = read_jsonl(f)
        assert events, f
        assert rank not in logs, f"two files for rank {rank}: {files}"
        header = events[0]
        assert header["event"] == "header"
        assert header["world_size"] == 2 and header["local_rank"] == rank
        assert all(e["rank"] == rank for e in events), f
        assert all(e["pid"] == pid for e in events), f
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(set(seqs)), f
        logs[rank] = events
    assert sorted(logs) == [0, 1], files
    return logs


def flex_calls(events):
    return [e for e in events if e["event"] == "flex_call"]


def output(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(*scenarios, timeout=...)``: one launch running the scenarios one after the other
    (once per module, whichever test asks first): (OUT, the launch), scenario S's files in OUT/S."""
    done: dict = {}

    def get(*scenarios: str, timeout: float = LAUNCH_TIMEOUT) -> tuple:
        key = ",".join(scenarios)
        if key not in done:
            out = tmp_path_factory.mktemp("dist")
            done[key] = (out, launch(key, out, timeout=timeout))
        return done[key]

    return get


#: The compiling scenarios launched together: fsdp2 (watched) and, where this torch has it, cp.
COMPILING = ("fsdp2",) if lacks("context_parallel") else ("fsdp2", "cp")


def test_gather_to_rank0_without_a_process_group():
    assert not process_group_ready()
    obj = {"rank": 0, "rows": [1, 2]}
    assert gather_to_rank0(obj) == [obj]


@torchrun
def test_every_rank_dense_one_log_per_rank_and_gather(launched):
    out, proc = launched("both", "rank1")
    assert proc.returncode == 0, output(proc)
    tmp_path = out / "both"
    logs = rank_logs(tmp_path)
    for rank, events in logs.items():
        (call,) = flex_calls(events)
        assert call["path"] == "dense" and call["cause"] == "eager_call" and call["action"] == "warn"
        assert call["q_shape"] == [1, 2, 16 + 8 * rank, 8], "each rank logs its own call"
        assert call["call_site"]["file"] == str(HERE / "dist_worker.py")
        assert events[-1]["event"] == "shutdown"
    gathered = json.loads((tmp_path / "gathered.json").read_text())
    assert [g["rank"] for g in gathered] == [0, 1], "rank order"
    for rank, g in enumerate(gathered):
        assert g["alone"] == [{"rank": rank}], "no process group yet: [obj]"
        assert g["dense"] == [flex_calls(logs[rank])[0]["seq"]]
        assert (tmp_path / "logs" / f"fusionguard.rank{rank}.pid{g['pid']}.jsonl").exists()
    # summary(all_ranks=True): rank 0 holds every rank's per-layer rows
    rows = json.loads((tmp_path / "all_ranks.json").read_text())
    assert sorted((r["rank"], r["layer"], r["phase"], r["dense"]) for r in rows) == [
        (0, "attn", "forward", 1),
        (1, "attn", "forward", 1),
    ]


@torchrun
def test_only_rank1_dense(launched):
    """(in the launch of "both", after it: a fresh enable() and log, rank 0 makes no call)"""
    out, proc = launched("both", "rank1")
    assert proc.returncode == 0, output(proc)
    tmp_path = out / "rank1"
    logs = rank_logs(tmp_path)
    assert flex_calls(logs[0]) == []
    (call,) = flex_calls(logs[1])
    assert call["rank"] == 1 and call["action"] == "warn"
    gathered = json.loads((tmp_path / "gathered.json").read_text())
    assert [len(g["dense"]) for g in gathered] == [0, 1]


@torchrun
def test_strict_rank_raises_torchrun_stops_the_group(tmp_path):
    """Rank 1 raises DenseFallbackError after logging; rank 0 is blocked in the next collective.

    torchrun sees rank 1 exit with an error, stops the other workers and exits non-zero; with
    ``@record`` on the entry point its failure summary carries the DenseFallbackError verdict.
    """
    proc = launch("strict", tmp_path)
    assert proc.returncode != 0, output(proc)
    text = proc.stdout + proc.stderr
    assert "DenseFallbackError" in text and "dense FlexAttention forward blocked" in text, output(proc)
    assert "ChildFailedError" in text, output(proc)
    root = text.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s*:\s*1\b", root) and "DenseFallbackError" in root, output(proc)
    # how far each rank got
    assert (tmp_path / "rank1.raising").exists()
    assert not (tmp_path / "rank1.barrier").exists(), "the raise ends rank 1"
    assert (tmp_path / "rank0.barrier").exists()
    assert not (tmp_path / "rank0.after_barrier").exists(), "rank 0 never gets past the collective"
    logs = rank_logs(tmp_path)
    (blocked,) = flex_calls(logs[1])
    assert blocked["action"] == "raise" and blocked["allowed"] is False and blocked["cause"] == "eager_call"
    (allowed,) = flex_calls(logs[0])
    assert allowed["action"] == "allow" and allowed["allowed"] is True


@torchrun
@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fsdp2", "fsdp2_unwatched"])
def test_fsdp2_per_block_compile_names_each_block_on_every_rank(tmp_path, launched, scenario):
    """torchtitan's pattern under torchrun: fully_shard per block, block.compile(), two steps in
    watch(model), or without watch() under ``fusionguard run`` (issue 28: the blocks are found in
    the model holding them; the worker never calls enable()). One compiled graph serves both
    blocks; each run is named by the block running it, per rank; the report sums the ranks."""
    from fusionguard.report.build import build as build_report_dict

    if scenario == "fsdp2_unwatched":  # (under the start-up hook: a launch of its own)
        proc = launch(scenario, tmp_path, timeout=LAUNCH_TIMEOUT * 4, runner=fusionguard_run(tmp_path))  # (two ranks compile at once)
    else:  # (with cp, where this torch has it)
        out, proc = launched(*COMPILING, timeout=LAUNCH_TIMEOUT * 4 * len(COMPILING))
        tmp_path = out / scenario if len(COMPILING) > 1 else out
    assert proc.returncode == 0, output(proc)
    logs = rank_logs(tmp_path)
    expected = [
        {"layer": "layers.0.attn", "phase": "forward", "calls": 2, "fused": 2, "dense": 0},
        {"layer": "layers.1.attn", "phase": "forward", "calls": 2, "fused": 2, "dense": 0},
    ]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rows{rank}.json").read_text()) == expected
        counts = json.loads((tmp_path / f"counts{rank}.json").read_text())
        assert counts["counts"]["fused_runs_forward"] == 4
        assert [(r["layer"], r["flex_calls"]) for r in counts["runs"]] == [("layers.0.attn", 1), ("layers.1.attn", 1)] * 2
        assert not flex_calls(logs[rank])
    rep = build_report_dict([str(tmp_path / "logs")])
    assert {(r["layer"], r["phase"]): (r["fused"], r["dense"]) for r in rep["rows"]} == {
        ("layers.0.attn", "forward"): (4, 0),
        ("layers.1.attn", "forward"): (4, 0),
    }


def stop_record(out: Path, proc: subprocess.CompletedProcess, ended: float, logs: dict) -> dict:
    """How a strict stop on rank 1 ended the other rank: seconds from rank 1's raise to torchrun's
    exit (every worker gone), and what ended rank 0: ``process group error`` (its collective
    failed: a ``crash`` record), ``torchrun SIGTERM`` (the agent stopped it: fusionguard's
    ``shutdown`` with reason ``sigterm``) or ``killed`` (neither: SIGKILL, torchrun's agent after
    its grace period). Written to OUT/stop.json and printed (``pytest -rA`` shows it)."""
    text = proc.stdout + proc.stderr
    crashes = [e for e in logs[0] if e["event"] == "crash"]
    shutdowns = [e.get("reason") for e in logs[0] if e["event"] == "shutdown"]
    if crashes:
        how = f"process group error ({crashes[0]['exc_type']}: {crashes[0]['message'][:120]})"
    elif "sigterm" in shutdowns:
        how = "torchrun SIGTERM (its agent stopped the waiting rank)"
    else:
        how = f"killed (last event {logs[0][-1]['event']}: SIGKILL after torchrun's grace period)"
    record = {
        "stop_s": round(ended - float((out / "rank1.raising").read_text()), 2),
        "rank0": how,
        "rank0_reached": sorted(p.name for p in out.glob("rank0.*")),
        "torchrun_sigterm": "closing signal SIGTERM" in text,
        "torchrun_sigkill": "SIGKILL" in text,
    }
    (out / "stop.json").write_text(json.dumps(record))
    print("strict stop:", json.dumps(record))
    return record


def check_strict_stop(out: Path, proc: subprocess.CompletedProcess, ended: float, layer: str) -> dict:
    """Shared with tests/gpu/test_distributed_cuda.py: every rank stops within 30 s; rank 1's
    crash record names its rank and the layer; the run fails naming rank 1."""
    assert proc.returncode != 0, output(proc)
    text = proc.stdout + proc.stderr
    assert "ChildFailedError" in text and "DenseFallbackError" in text, output(proc)
    root = text.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s*:\s*1\b", root) and "DenseFallbackError" in root, output(proc)
    logs = rank_logs(out)
    (blocked,) = [e for e in flex_calls(logs[1]) if e["action"] == "raise"]
    assert blocked["layer"] == layer and blocked["phase"] == "forward" and blocked["rank"] == 1
    (crash,) = [e for e in logs[1] if e["event"] == "crash"]
    assert crash["exc_type"].endswith("DenseFallbackError") and crash["rank"] == 1, crash
    assert crash["last_flex"]["layer"] == layer and crash["last_flex"]["seq"] == blocked["seq"], crash
    assert not (out / "rank1.step3").exists() and (out / "rank0.step2").exists()
    assert not (out / "rank0.after_steps").exists(), "rank 0 never finishes its steps"
    record = stop_record(out, proc, ended, logs)
    assert record["stop_s"] <= 30, record
    return record


@torchrun
def test_fsdp2_strict_one_rank_dense_every_rank_stops(tmp_path):
    """FSDP2 per block under strict mode (eager here: no compile on CPU; rank 0's dense calls and
    rank 1's first step inside allow_dense()): rank 1 raises in step 2's first block, rank 0 runs
    on into FSDP's next all-gather. On gloo the collective fails ("Connection closed by peer") or
    torchrun's agent stops rank 0; either way within 30 s, and which one is recorded."""
    import time

    proc = launch("fsdp2_strict", tmp_path)
    record = check_strict_stop(tmp_path, proc, time.time(), "layers.0.attn")
    assert record["rank0"].startswith(("process group error", "torchrun SIGTERM")), record


@needs("context_parallel")
def test_context_parallel_flex_is_found_on_this_torch():
    """torch's private context parallelism for flex (registered in torch_internals: 2.11 and 2.13
    keep it in ``_context_parallel/_attention.py``; the older ``_attention.py`` re-exports the style only)."""
    from fusionguard import torch_internals as ti

    cp = ti.context_parallel_flex()
    assert cp.ContextParallel.AttentionType.FLEX.value == "flex_attention"
    assert {"_ContextParallel", "_create_cp_block_mask", "_context_parallel_shard"} <= set(ti.PRIVATE_NAMES)


@torchrun
@pytest.mark.slow
@needs("context_parallel")
def test_context_parallel_flex_on_gloo_compiled_fused_eager_dense_with_local_shapes(launched):
    """Context parallelism for FlexAttention (``_ContextParallel(2, FLEX)``, S = 256 on 2 ranks,
    inference: no flex backward on CPU). Compiled: fused on every rank, no dense call. The same
    module eager inside the CP region: dense on every rank, logged with the local shapes (Q is
    S/2, K and V the all-gathered S) and ``predicted_bytes`` worked out from them; the output is
    the whole attention's shard (the CP path really ran)."""
    from fusionguard.dense.memory import predict_dense

    out, proc = launched(*COMPILING, timeout=LAUNCH_TIMEOUT * 4 * len(COMPILING))  # (after fsdp2, in its launch)
    assert proc.returncode == 0, output(proc)
    tmp_path = out / "cp"
    logs = rank_logs(tmp_path)
    for rank in (0, 1):
        cp = json.loads((tmp_path / f"cp{rank}.json").read_text())
        assert cp["q"] == [1, 2, 128, 8] and cp["kv_local"] == [1, 2, 128, 8] and cp["mask"] == [1, 1, 128, 256]
        assert cp["compiled_calls"] == [], "compiled: no dense call"
        compiles = [e for e in logs[rank] if e["event"] == "flex_compile"]
        assert compiles and {c["path"] for c in compiles} == {"fused"}, compiles
        (dense,) = cp["dense_calls"]
        assert dense["path"] == "dense" and dense["action"] == "warn" and dense["rank"] == rank
        assert dense["q_shape"] == [1, 2, 128, 8] and dense["kv_shape"] == [1, 2, 256, 8], dense
        import torch

        local = [torch.empty(1, 2, n, 8, device="meta") for n in (128, 256, 256)]
        assert dense["predicted_bytes"] == predict_dense("forward", *local)
        assert cp["compiled_vs_dense"] < 1e-5 and cp["dense_vs_reference"] < 1e-5, cp
