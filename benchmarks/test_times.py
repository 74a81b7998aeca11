"""Per-file test times from pytest's junit XML, before and after, as a markdown table.

    python -m pytest -q --junitxml=after.xml          # (and before.xml on the older tree)
    python benchmarks/test_times.py before.xml after.xml [--cpu before.cpu.jsonl after.cpu.jsonl]

Junit times are per test (setup, call and teardown); under xdist they add up the workers' time,
so the sum over files is more than the wall time of a parallel run: the table shows both shares.
``--cpu`` adds CPU seconds per file (benchmarks/pytest_cpu.py's files; several workers' files are
globbed as ``PATH*``), which the machine's load barely changes.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import xml.etree.ElementTree as ET


def per_file(xml: str) -> dict:
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for case in ET.parse(xml).getroot().iter("testcase"):
        if not (case.get("file") or case.get("classname")):
            continue  # (a collection error)
        name = (case.get("file") or case.get("classname", "").replace(".", "/") + ".py").split("::")[0]
        name = name if name.endswith(".py") else name + ".py"
        if "/gpu/" in name or name.startswith("tests/gpu"):
            name = "tests/gpu/*"
        out[name][0] += 1
        out[name][1] += float(case.get("time", 0))
    return out


def cpu_per_file(pattern: str) -> dict:
    out: dict = collections.defaultdict(float)
    for path in glob.glob(pattern + "*"):
        for line in open(path):
            row = json.loads(line)
            name = row["test"].split("::")[0]
            out["tests/gpu/*" if "/gpu/" in name else name] += row["self"] + row["children"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--cpu", nargs=2, metavar=("BEFORE", "AFTER"))
    a = ap.parse_args()
    b, c = per_file(a.before), per_file(a.after)
    cb, ca = (cpu_per_file(a.cpu[0]), cpu_per_file(a.cpu[1])) if a.cpu else ({}, {})
    names = sorted(set(b) | set(c), key=lambda n: -b.get(n, [0, 0.0])[1])
    head = "| file | tests before | tests after | s before | s after |"
    print(head + (" CPU s before | CPU s after |" if a.cpu else ""))
    print("|---" * (head.count("|") - 1 + (2 if a.cpu else 0)) + "|")
    for n in names:
        row = f"| {n} | {b.get(n, [0])[0]} | {c.get(n, [0])[0]} | {b.get(n, [0, 0.0])[1]:.1f} | {c.get(n, [0, 0.0])[1]:.1f} |"
        print(row + (f" {cb.get(n, 0.0):.1f} | {ca.get(n, 0.0):.1f} |" if a.cpu else ""))
    tb, tc = sum(v[1] for v in b.values()), sum(v[1] for v in c.values())
    nb, nc = sum(v[0] for v in b.values()), sum(v[0] for v in c.values())
    wall = [ET.parse(x).getroot().find("testsuite").get("time") for x in (a.before, a.after)]
    print(f"| **wall time of the run** | | | {float(wall[0]):.1f} | {float(wall[1]):.1f} |" + (" | |" if a.cpu else ""))
    print(
        f"| **sum over tests** | {nb} | {nc} | {tb:.1f} | {tc:.1f} |"
        + (f" {sum(cb.values()):.1f} | {sum(ca.values()):.1f} |" if a.cpu else "")
    )


if __name__ == "__main__":
    main()
