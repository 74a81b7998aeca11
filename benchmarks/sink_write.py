"""The log file's own cost per line written: ``FileSink.write`` of one 700-byte event line,
appending (no rotation) and rotating (``log_max_bytes``: under ``flock``, with the path checked),
against another ``sink.py`` (e.g. main's) loaded beside this one, in alternating blocks so host
drift cancels. Median microseconds per line.

    git show main:fusionguard/eventlog/sink.py > /tmp/sink_main.py
    python benchmarks/sink_write.py [--other /tmp/sink_main.py] [--dir /tmp] [--lines 200] [--blocks 60]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import tempfile
import time

from fusionguard.eventlog import sink as this_sink

LINE = json.dumps({"event": "flex_call", "level": "warning", "seq": 1, "pad": "x" * 640})


def load(path: str):
    spec = importlib.util.spec_from_file_location("other_sink", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def block(sink, lines: int) -> float:
    t0 = time.perf_counter()
    for _ in range(lines):
        sink.write(LINE, False)
    return (time.perf_counter() - t0) / lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", help="another sink.py to compare with (main's)")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=60)
    args = ap.parse_args()
    mods = {"this": this_sink}
    if args.other:
        mods["other"] = load(args.other)
    work = tempfile.mkdtemp(dir=args.dir)
    try:
        for label, max_bytes in (("append", None), ("rotating at 1 MiB", 1 << 20), ("rotating at 64 KiB", 1 << 16)):
            sinks = {
                name: mod.FileSink(os.path.join(work, f"{name}-{max_bytes}.jsonl"), fsync=False, max_bytes=max_bytes)
                for name, mod in mods.items()
            }
            times = {name: [] for name in mods}
            for b in range(args.blocks):
                order = list(mods) if b % 2 == 0 else list(reversed(mods))
                for name in order:
                    times[name].append(block(sinks[name], args.lines))
            for s in sinks.values():
                s.close()
            print(f"{label:<20} " + ", ".join(f"{name} {statistics.median(t) * 1e6:.2f} us/line" for name, t in times.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
