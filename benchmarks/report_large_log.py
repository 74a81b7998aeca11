"""``fusionguard report`` on a ~1 GB log: wall time and peak memory (RSS).

Generates a realistic mix into a temporary directory (deleted afterwards): per-call
``layer_memory`` records of 32 layers x forward/backward (what ``keep_all=True`` writes), dense
``flex_call`` events with full evidence every 200 calls, ``flex_compile`` records, a few Dynamo
signals, a crash at the end; plus a torn last line. Then runs the command a user runs,
``python -m fusionguard report FILE`` (text and ``--format json``), in a child process and reads
its peak RSS from the kernel (``ru_maxrss``). The same command on a 1-line log gives the baseline
(the interpreter plus ``import fusionguard``, which imports torch), so the difference is what the
report itself needs.

    python benchmarks/report_large_log.py [--gb 1.0] [--dir /tmp] [--keep] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = 32
T0 = 1_800_000_000.0


def _line(event: dict) -> str:
    return json.dumps(event, separators=(",", ":"))


def generate(path: str, target_bytes: int) -> dict:
    """Write ~target_bytes of events; returns counts. Fast: templates with %-formatting."""
    header = {
        "event": "header",
        "level": "info",
        "ts": T0,
        "seq": 1,
        "pid": 4242,
        "rank": 0,
        "thread": "MainThread",
        "schema": 1,
        "fusionguard": "0.1.0",
        "torch": "2.13.0+cu130",
        "triton": "3.6.0",
        "python": "3.11.7",
        "hostname": "gpu-node-17",
        "argv": ["train.py", "--config", "llama-8b.yaml"],
        "cuda": {"available": True, "count": 8, "version": "13.0", "devices": ["NVIDIA H200"] * 8},
        "local_rank": 0,
        "world_size": 8,
        "patched": ["flex_attention (dense forward)"],
        "not_patched": {},
        "config": {"strict": False},
    }
    mem = (
        '{"event":"layer_memory","level":"info","ts":%.6f,"seq":%d,"pid":4242,"rank":0,"thread":"MainThread",'
        '"layer":"model.layers.%d.self_attn","phase":"%s","path":"fused","alloc_delta":%d,"peak_delta":%d,"recompute":false}\n'
    )
    dense = {
        "event": "flex_call",
        "level": "warning",
        "pid": 4242,
        "rank": 0,
        "thread": "MainThread",
        "phase": "forward",
        "path": "dense",
        "traced": False,
        "cause": "recompile_limit",
        "evidence": {
            "reason": "0/7: tensor 'k' size mismatch at index 2. expected 2048, actual 1536",
            "function": "attention",
            "limit": 8,
            "frame": "model/attention.py:88 in attention",
        },
        "fix": "stop the recompiles: mark the varying dim dynamic (torch._dynamo.mark_dynamic(q, 2) or torch.compile(..., dynamic=True)), "
        "bucket/pad sequence lengths, build the BlockMask outside the compiled function and reuse mask_mod functions; or raise "
        "torch._dynamo.config.recompile_limit",
        "layer": "model.layers.17.self_attn",
        "allowed": False,
        "action": "warn",
        "call_site": {"file": "/home/user/model/attention.py", "line": 88, "function": "attention"},
        "autograd": True,
        "q_shape": [1, 32, 1536, 128],
        "kv_shape": [1, 8, 1536, 128],
        "dtype": "bfloat16",
        "device": "cuda:0",
        "device_name": "NVIDIA H200",
        "scores_bytes": 301989888,
    }
    compile_ev = {
        "event": "flex_compile",
        "level": "info",
        "pid": 4242,
        "rank": 0,
        "thread": "MainThread",
        "phase": "forward",
        "path": "fused",
        "traced": True,
        "cause": None,
        "template": "triton",
        "source": "cache",
        "graph": "fxgraph-abc123",
        "q_shape": [1, 32, 2048, 128],
        "kv_shape": [1, 8, 2048, 128],
        "dtype": "bfloat16",
        "device": "cuda:0",
        "scores_bytes": 536870912,
        "call_site": {"file": "/home/user/model/attention.py", "line": 88, "function": "attention"},
    }
    counts = {"layer_memory": 0, "flex_call": 0, "flex_compile": 0, "graph_break": 0}
    seq = 1
    written = 0
    with open(path, "w", buffering=1 << 20) as fh:
        written += fh.write(_line(header) + "\n")
        for layer in range(LAYERS):
            for phase in ("forward", "backward"):
                seq += 1
                written += fh.write(
                    _line({**compile_ev, "ts": T0 + seq * 1e-4, "seq": seq, "layer": f"model.layers.{layer}.self_attn", "phase": phase})
                    + "\n"
                )
                counts["flex_compile"] += 1
        step = 0
        chunk = []
        while written < target_bytes:
            step += 1
            for layer in range(LAYERS):
                for phase in ("forward", "backward"):
                    seq += 1
                    peak = 60_000_000 + (step * 7919 + layer * 104729) % 5_000_000
                    if phase == "backward":
                        peak *= 3
                    chunk.append(mem % (T0 + seq * 1e-4, seq, layer, phase, peak // 5, peak))
            counts["layer_memory"] += LAYERS * 2
            if step % 200 == 0:  # the dense call on a recompiled shape, with its memory record
                seq += 1
                chunk.append(_line({**dense, "ts": T0 + seq * 1e-4, "seq": seq}) + "\n")
                counts["flex_call"] += 1
            if step % 5000 == 0:
                seq += 1
                chunk.append(
                    _line(
                        {
                            "event": "graph_break",
                            "level": "warning",
                            "ts": T0 + seq * 1e-4,
                            "seq": seq,
                            "pid": 4242,
                            "rank": 0,
                            "thread": "MainThread",
                            "function": "forward",
                            "file": "model/block.py",
                            "line": 40,
                            "fail_type": "Unsupported",
                            "reason": "call_function print",
                            "break_file": "model/block.py",
                            "break_line": 41,
                        }
                    )
                    + "\n"
                )
                counts["graph_break"] += 1
            if len(chunk) >= 4096:
                data = "".join(chunk)
                written += fh.write(data)
                chunk = []
        if chunk:
            written += fh.write("".join(chunk))
        seq += 1
        crash = {
            "event": "crash",
            "level": "error",
            "ts": T0 + seq * 1e-4,
            "seq": seq,
            "pid": 4242,
            "rank": 0,
            "thread": "MainThread",
            "exc_type": "torch.OutOfMemoryError",
            "message": "CUDA out of memory. Tried to allocate 2.50 GiB",
            "where": "sys.excepthook",
            "diagnosis": "OOM inside dense forward of model.layers.17.self_attn; the dense score matrix is 301.99 MB in fp32",
            "last_flex": {
                "event": "flex_call",
                "layer": "model.layers.17.self_attn",
                "phase": "forward",
                "path": "dense",
                "cause": "recompile_limit",
            },
        }
        written += fh.write(_line(crash) + "\n")
        written += fh.write('{"event":"flex_call","level":"warning","ts":')  # torn last line
    return {"bytes": os.path.getsize(path), "lines": seq, **counts}


def run_report(args: list) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fusionguard", "report", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    # ru_maxrss of children is the max over every child waited for: measure() runs each command
    # from a fresh helper process, so this is the report command's own peak.
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "rc": p.returncode,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "stdout": p.stdout,
        "stderr": p.stderr,
    }


def measure(args: list) -> dict:
    """Runs run_report in a fresh helper process so ru_maxrss is this one command's."""
    helper = "import json, sys; sys.path.insert(0, %r); import report_large_log as b; r = b.run_report(%r); print(json.dumps(r))" % (
        os.path.dirname(os.path.abspath(__file__)),
        args,
    )
    out = subprocess.run([sys.executable, "-c", helper], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fusionguard-large-", dir=a.dir)
    try:
        big = os.path.join(work, "fusionguard.rank0.jsonl")
        tiny = os.path.join(work, "tiny.jsonl")
        with open(tiny, "w") as fh:
            fh.write('{"event":"header","level":"info","ts":1,"seq":1,"pid":1,"rank":0,"schema":1}\n')
        t = time.perf_counter()
        gen = generate(big, int(a.gb * 1e9))
        gen_s = time.perf_counter() - t
        print(f"generated {gen['bytes'] / 1e9:.3f} GB, {gen['lines']:,} events in {gen_s:.1f}s", flush=True)
        base = measure([tiny, "--format", "json"])
        text = measure([big])
        js = measure([big, "--format", "json"])
        assert text["rc"] == 0 and js["rc"] == 0, (text["stderr"], js["stderr"])
        rep = json.loads(js["stdout"])
        assert rep["run"]["events"] == gen["lines"], (rep["run"]["events"], gen["lines"])
        assert rep["files"][0]["torn_last_line"] is True
        assert rep["totals"]["dense_calls"] == gen["flex_call"]
        import torch  # versions for the record only

        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "log_gb": gen["bytes"] / 1e9,
            "events": gen["lines"],
            "generate_s": gen_s,
            "text_wall_s": text["wall_s"],
            "text_cpu_s": text["cpu_s"],
            "json_wall_s": js["wall_s"],
            "json_cpu_s": js["cpu_s"],
            "baseline_cpu_s": base["cpu_s"],
            "events_per_s": gen["lines"] / text["wall_s"],
            "mb_per_s": gen["bytes"] / 1e6 / text["wall_s"],
            "peak_rss_mb_text": text["peak_rss_mb"],
            "peak_rss_mb_json": js["peak_rss_mb"],
            "peak_rss_mb_baseline": base["peak_rss_mb"],
            "baseline_wall_s": base["wall_s"],
        }
        for k, v in result.items():
            print(f"{k:>22}: {v:.3f}" if isinstance(v, float) else f"{k:>22}: {v}")
        print(text["stdout"][:3000])
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(result, fh, indent=1)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
