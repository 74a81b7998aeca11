"""Start-up cost of ``fusionguard run`` for a Python process that never imports torch (#24).

Target: such a process starts at most 10 ms later than plain Python. Every variant runs
``python -c pass`` as a new process, the variants interleaved (the order rotates every round, so
host drift cancels); reported: the median wall time and the median of the paired differences to
``plain`` within each round.

- ``plain``: no hook on ``PYTHONPATH``;
- ``run, FUSIONGUARD unset``: the hook directory on ``PYTHONPATH``, no mode (only the chain to
  another ``sitecustomize`` runs);
- ``run, warn``: ``fusionguard run``'s own environment (``activate.launch_env("warn")``):
  ``activate.py`` loaded by path, its meta-path finder installed;
- ``run, warn (--baseline)``: the same with another checkout's hook directory (before/after);
- ``wrapt post-import hook``: a ``sitecustomize`` that imports ``wrapt`` and registers
  ``wrapt.register_post_import_hook(..., "torch")``, the alternative #24 asked about;
- ``import wrapt``: a ``sitecustomize`` that only imports ``wrapt``.

Then, one process each: ``python -X importtime -c 'import wrapt'`` (what wrapt pulls in), and the
time of ``import wrapt`` after ``import torch`` (what ``enable()`` pays, once).

``--python``: the interpreter timed (default: this one). Use a plain venv holding only ``wrapt``
(``python -m venv /tmp/bare && /tmp/bare/bin/pip install wrapt``): an editable install's finder
already imports ``importlib.util``, ``pathlib`` and ``re`` at start-up and hides their cost.
``PYTHONDONTWRITEBYTECODE`` is dropped for the timed processes: an installed package has its
``.pyc`` files (pip writes them), and the warm-up round writes ours.

    python benchmarks/startup.py --python /tmp/bare/bin/python --rounds 60 [--baseline /path/to/other/fusionguard/_startup]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from fusionguard.activate import HOOK_DIR, launch_env

WRAPT_HOOK = """import wrapt


def _on_torch(module):
    pass


wrapt.register_post_import_hook(_on_torch, "torch")
"""
DROP = ("PYTHONPATH", "FUSIONGUARD", "FUSIONGUARD_LOG", "PYTHONDONTWRITEBYTECODE", "PYTHONSTARTUP")


def _envs(tmp: str, python: str, baseline: Optional[str]) -> Dict[str, dict]:
    base = {k: v for k, v in os.environ.items() if k not in DROP}
    envs = {
        "plain": dict(base),
        "run, FUSIONGUARD unset": {**base, "PYTHONPATH": HOOK_DIR},
        "run, warn": launch_env("warn", environ=base),
    }
    if baseline:
        envs["run, warn (--baseline)"] = {**base, "PYTHONPATH": os.path.abspath(baseline), "FUSIONGUARD": "warn"}
    if subprocess.run([python, "-c", "import wrapt"], env=base, capture_output=True).returncode == 0:
        for name, text in (("wrapt post-import hook", WRAPT_HOOK), ("import wrapt", "import wrapt\n")):
            d = os.path.join(tmp, name.replace(" ", "_"))
            os.makedirs(d)
            with open(os.path.join(d, "sitecustomize.py"), "w") as fh:
                fh.write(text)
            envs[name] = {**base, "PYTHONPATH": d, "FUSIONGUARD": "warn"}
    else:
        print(f"(wrapt is not importable by {python}: its variants are left out)")
    return envs


def _once(python: str, env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - t0


def _importtime(python: str, env: dict, module: str) -> Dict[str, int]:
    """Cumulative microseconds per module in ``-X importtime -c 'import MODULE'``."""
    out = subprocess.run([python, "-X", "importtime", "-c", f"import {module}"], env=env, capture_output=True, text=True, check=True).stderr
    found = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[1].isdigit():
            found[parts[2]] = int(parts[1])
    return found


def _version(python: str, module: str) -> str:
    code = f"import {module}; print({module}.__version__)"
    p = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else "not installed"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--python", default=sys.executable, help="the interpreter timed (default: this one)")
    ap.add_argument("--baseline", help="another checkout's fusionguard/_startup, timed as a variant too")
    args = ap.parse_args()
    python = args.python
    with tempfile.TemporaryDirectory() as tmp:
        envs = _envs(tmp, python, args.baseline)
        names = list(envs)
        for name in names:  # warm-up: page cache, .pyc files
            _once(python, envs[name])
        times: Dict[str, List[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                times[name].append(_once(python, envs[name]))
    pyver = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True
    ).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M')} UTC, {platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"timed: {python} (Python {pyver}, wrapt {_version(python, 'wrapt')}); {args.rounds} rounds, interleaved, `python -c pass`")
    print()
    print("| variant | median ms | IQR ms | paired difference to plain, median ms |")
    print("|---|---|---|---|")
    plain = times["plain"]
    for name in names:
        t = times[name]
        q = statistics.quantiles(t, n=4)
        diff = statistics.median(a - b for a, b in zip(t, plain))
        print(f"| {name} | {statistics.median(t) * 1e3:.1f} | {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f} | {diff * 1e3:+.1f} |")
    if "import wrapt" not in envs:
        return
    base = envs["plain"]
    runs = [_importtime(python, base, "wrapt") for _ in range(5)]
    print()
    print(
        "`-X importtime -c 'import wrapt'`, median of 5, cumulative ms: "
        + ", ".join(
            f"{m} {statistics.median(r.get(m, 0) for r in runs) / 1e3:.1f}" for m in ("wrapt", "asyncio", "importlib.metadata", "inspect")
        )
    )
    code = (
        "import sys, time, torch; a = 'asyncio' in sys.modules; t = time.perf_counter(); "
        "import wrapt; print(time.perf_counter() - t, a, torch.__version__)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base)
    if p.returncode == 0:
        after = [p.stdout.split()]
        after += [
            subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base, check=True).stdout.split()
            for _ in range(2)
        ]
        ms = statistics.median(float(a[0]) for a in after) * 1e3
        print(
            f"`import wrapt` after `import torch` (torch {after[0][2]}, which imported asyncio itself: {after[0][1]}), "
            f"median of 3: {ms:.1f} ms"
        )


if __name__ == "__main__":
    main()
