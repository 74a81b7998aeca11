"""The torch version matrix: one session per torch minor release, each in its own virtual env.

    nox -s tests                      # every release, floor to newest (GBs of downloads each)
    nox -s "tests(torch='2.9')"       # one release
    nox -s pythons                    # the other Python versions setup.cfg claims
    nox -s tests -- -k rescue         # extra arguments go to pytest

Each session installs that release's newest patch release from the package index (on Linux the
CUDA build with its nvidia-* wheels: it runs on a CPU too), then `-e .[test]`. The floor, the CI
release and the newest run the full suite; the releases between run the core files. A skip
always names the feature the release lacks (tests/conftest.py `needs`). Results:
docs/compatibility.md.
"""

from __future__ import annotations

import os
import shutil

import nox

# minor release -> its newest patch release (pip index versions torch, 2026-12-01)
TORCH = {
    "2.7": "2.7.1",
    "2.8": "2.8.0",
    "2.9": "2.9.1",
    "2.10": "2.10.0",
    "2.11": "2.11.0",
    "2.12": "2.12.1",
    "2.13": "2.13.0",
    "2.14": "2.14.1",
    "2.15": "2.15.0",
}
FLOOR, CI, NEWEST = "2.7", "2.13", "2.15"
FULL = {FLOOR, CI, NEWEST}
# What every release must keep: the dense guard, causes, compiled records, layers, rescue, API.
CORE = [
    "tests/test_api.py",
    "tests/test_dense.py",
    "tests/test_causes.py",
    "tests/test_compiled.py",
    "tests/test_rescue.py",
    "tests/test_watch.py",
]
PYTHON = "3.11"
# The other Python versions setup.cfg claims, each with the newest torch that supports it
# (torch 2.15 needs Python 3.11+).
PYTHONS = {"3.12": NEWEST, "3.13": NEWEST}  # 3.10: not claimed (docs/compatibility.md)

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"


def _install(session: nox.Session, torch: str) -> None:
    # Some pip configurations cap torch through a constraints file (PIP_CONSTRAINT / pip.conf);
    # an empty file of our own replaces it for this session only.
    # (absolute paths: tests change the working directory)
    tmp = os.path.abspath(session.create_tmp())
    constraints = os.path.join(tmp, "constraints.txt")
    open(constraints, "w").close()
    session.env["PIP_CONSTRAINT"] = constraints
    session.install(f"torch=={torch}")
    session.install("-e", ".[test]")
    session.env["TMPDIR"] = tmp
    session.env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")


def _pytest(session: nox.Session, files: list) -> None:
    try:
        session.run("python", "-c", "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)")
        session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files, *session.posargs)
    finally:
        # A CUDA build of torch with its nvidia-* wheels is 5 to 7 GB per environment: a matrix
        # keeps one at a time unless asked to keep them (FUSIONGUARD_NOX_KEEP=1).
        location = getattr(session.virtualenv, "location", None)
        if location and not os.environ.get("FUSIONGUARD_NOX_KEEP"):
            shutil.rmtree(location, ignore_errors=True)


@nox.session(python=PYTHON)
@nox.parametrize("torch", list(TORCH))
def tests(session: nox.Session, torch: str) -> None:
    """The suite on one torch minor release (full on the floor, CI's and the newest; core between)."""
    _install(session, TORCH[torch])
    _pytest(session, [] if torch in FULL else CORE)


@nox.session(python=list(PYTHONS))
def pythons(session: nox.Session) -> None:
    """The core files on each other claimed Python version (3.11 is the tests sessions')."""
    _install(session, TORCH[PYTHONS[str(session.python)]])
    _pytest(session, CORE)
