"""Log volume of a long run: 1,000,000 fused per-call events through fusionguard's EventLog.

1. defaults (``Sampler()``: first 10 per layer and phase, then one ``fused_calls`` counter
   per 1000 calls): bytes on disk, time per call, and ``fusionguard report`` still counts every
   call and the true peak;
2. ``keep_all=True``: every event (what the sampler saves);
3. ``keep_all=True`` with size-based rotation (``max_bytes=50 MB``, ``backups=3``): bytes on
   disk stay bounded.

The events are ``layer_memory`` records as ``fusionguard.watch`` writes them (32 layers x
forward/backward, path fused). Files go to a temporary directory, deleted afterwards.

    python benchmarks/log_volume.py [--calls 1000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


from fusionguard.eventlog.log import EventLog  # noqa: E402
from fusionguard.eventlog.sampler import DEFAULT_FUSED_EVERY, DEFAULT_FUSED_FIRST, Sampler  # noqa: E402
from fusionguard.report.build import build as build_report_dict  # noqa: E402

LAYERS = 32


def run(path: str, calls: int, sampler: Sampler, max_bytes=None, backups=3) -> dict:
    log = EventLog()
    log.sampler = sampler
    log.open(path, fsync=True, max_bytes=max_bytes, backups=backups)
    log.emit(
        "info", "header", schema=1, fusionguard="0.1.0", torch="2.13.0", triton=None, python=platform.python_version(), hostname="bench"
    )
    names = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    spike_at = calls // 2 + 7
    t = time.perf_counter()
    cpu = time.process_time()
    i = 0
    while i < calls:
        for name in names:
            for phase in ("forward", "backward"):
                peak = 60_000_000 + (i * 7919) % 5_000_000
                if i == spike_at:
                    peak = 9_000_000_000  # one outlier, in a call the sampler does not write
                log.emit(
                    "info", "layer_memory", layer=name, phase=phase, path="fused", alloc_delta=peak // 5, peak_delta=peak, recompute=False
                )
                i += 1
                if i >= calls:
                    break
            if i >= calls:
                break
    wall = time.perf_counter() - t
    cpu = time.process_time() - cpu
    log.emit("info", "shutdown", reason="disable")
    rotations = log.sink.rotations if log.sink is not None else 0
    log.close()
    folder = os.path.dirname(path)
    files = sorted(f for f in os.listdir(folder) if f.startswith(os.path.basename(path)))
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in files}
    return {
        "calls": calls,
        "bytes_on_disk": sum(sizes.values()),
        "files": len(files),
        "largest_file": max(sizes.values()),
        "rotations": rotations,
        "wall_s": wall,
        "cpu_s": cpu,
        "us_per_call": wall / calls * 1e6,
        "kept": sampler.kept,
        "counters": sampler.counters,
        "dropped": sampler.dropped,
        "spike": 9_000_000_000,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--json")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fusionguard-volume-")
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "defaults": {"fused_first": DEFAULT_FUSED_FIRST, "fused_every": DEFAULT_FUSED_EVERY},
    }
    try:
        d = os.path.join(work, "sampled")
        os.makedirs(d)
        res = run(os.path.join(d, "fg.jsonl"), a.calls, Sampler())
        t = time.perf_counter()
        rep = build_report_dict([d])
        res["report_s"] = time.perf_counter() - t
        res["report_fused_calls"] = rep["totals"]["fused_calls"]
        res["report_peak_max"] = max(r["peak_delta_max"] for r in rep["rows"])
        assert res["report_fused_calls"] == a.calls, res
        assert res["report_peak_max"] == res["spike"], res
        out["sampled"] = res
        print("defaults:", json.dumps(res), flush=True)

        d = os.path.join(work, "all")
        os.makedirs(d)
        res = run(os.path.join(d, "fg.jsonl"), a.calls, Sampler(keep_all=True))
        out["keep_all"] = res
        print("keep_all:", json.dumps(res), flush=True)
        shutil.rmtree(d)

        d = os.path.join(work, "rotated")
        os.makedirs(d)
        res = run(os.path.join(d, "fg.jsonl"), a.calls, Sampler(keep_all=True), max_bytes=50_000_000, backups=3)
        rep = build_report_dict([d])
        res["report_fused_calls"] = rep["totals"]["fused_calls"]
        out["keep_all_rotated"] = res
        print("keep_all + rotation (50 MB x 3 backups):", json.dumps(res), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
