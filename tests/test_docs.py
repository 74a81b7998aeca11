"""Every fenced block of README.md and docs/*.md: marked, and run on CPU where it is meant to run,
each in a fresh directory; every documented output compared with the real one (normalised).
``FUSIONGUARD_DOCS_UPDATE=1`` rewrites the documented outputs from the real ones (then review the
diff). The marks and the glue: tests/docs_blocks.py and docs/internals.md, "Documented blocks".

Cost: Python blocks and ``fusionguard`` commands run in this process; the compiled glue model is
the quickstart's compile again (an Inductor cache hit); each producer runs once per session."""

from __future__ import annotations

import warnings

import docs_blocks as db
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ALL = db.blocks()
RUN = [b for b in ALL if b.kind == "run"]
OUTPUT_OF = [b for b in ALL if b.kind == "output" and "of" in b.args and "gpu" not in b.flags]


def following_output(block: db.Block) -> db.Block | None:
    """The ``output`` block (without ``of=``) right after ``block`` in its file, if any."""
    i = ALL.index(block)
    nxt = ALL[i + 1] if i + 1 < len(ALL) else None
    if nxt and nxt.file == block.file and nxt.kind == "output" and "of" not in nxt.args:
        return nxt
    return None


def check(block: db.Block, real: str, dirs) -> None:
    ok, why = db.matches(block, real)
    if ok:
        return
    if db.UPDATE and db.update(block, db.shown(real, *dirs)):
        warnings.warn(f"FUSIONGUARD_DOCS_UPDATE: rewrote the output at {block.id}", stacklevel=1)
        return
    pytest.fail(f"{block.id}: the documented output is not the real one (FUSIONGUARD_DOCS_UPDATE=1 rewrites it)\n{why}")


@pytest.fixture(scope="module")
def producers(tmp_path_factory):
    return db.Producers(tmp_path_factory.mktemp)


def test_every_block_is_marked():
    """A block without a mark (or with one this test does not know) fails: nothing slips through."""
    bad = []
    for b in ALL:
        if b.mark is None:
            bad.append(f"{b.id}: no <!-- doc: ... --> mark on the line before the fence")
        elif b.kind not in db.KINDS:
            bad.append(f"{b.id}: unknown mark {b.mark!r} (one of {sorted(db.KINDS)})")
        elif b.args.get("setup", "") not in db.SETUPS:
            bad.append(f"{b.id}: unknown setup {b.args['setup']!r}")
        elif b.kind == "output" and "of" in b.args and b.args["of"] not in db.Producers(lambda n: None).funcs:
            bad.append(f"{b.id}: unknown producer {b.args['of']!r}")
        elif b.kind == "output" and "of" not in b.args and (ALL.index(b) == 0 or ALL[ALL.index(b) - 1].kind != "run"):
            bad.append(f"{b.id}: an output without of= must follow a run block")
        elif b.kind in ("run", "gpu") and not (b.python or b.shell):
            bad.append(f"{b.id}: a {b.kind} block must be python or bash, not {b.lang or 'plain'!r}")
    assert not bad, "\n".join(bad)
    assert len(ALL) >= 23 and RUN and OUTPUT_OF


def test_gpu_and_run_blocks_compile():
    """The Python of every run and GPU block parses (the GPU ones run in tests/gpu/test_docs_cuda.py)."""
    for b in ALL:
        if b.kind in ("run", "gpu") and b.python:
            compile(b.text, b.id, "exec")


def test_marks_are_parsed_from_an_unmarked_block(tmp_path, monkeypatch):
    """The mark check itself: a new block without a mark is found, with its line."""
    (tmp_path / "x.md").write_text("text\n\n```python\nprint(1)\n```\n\n<!-- doc: run -->\n```bash\nfusionguard --version\n```\n")
    monkeypatch.setattr(db, "ROOT", tmp_path)
    found = db.blocks(["x.md"])
    assert [(b.line, b.mark, b.kind) for b in found] == [(3, None, ""), (8, "run", "run")]


def test_normalise_keeps_counts_and_words():
    a = db.normalise(
        "fusionguard report: 1 file, 1 process, rank 0, 8 events\n  versions: torch 2.13.0+cpu\n"
        "  time: 2026-12-01 05:39:17.227 UTC (7.4s)\n  at: /tmp/x/train.py:7 in f; 262.14 KB\n"
    )
    # (the header's event count is normalised: where the run is slow, the flusher's periodic counter
    # adds an event, as in CI once; every other count is kept)
    assert a == [
        "fusionguard report: 1 file, 1 process, rank 0, <n> events",
        "versions: torch <v>",
        "time: <time> (<v>)",
        "at: train.py:7 in f; <size>",
    ]
    assert db.normalise("7 events") != db.normalise("8 events")
    assert db.normalise("DENSE: 1 dense call") != db.normalise("DENSE: 2 dense call")


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_run_block(block, tmp_path, producers):
    producers.quickstart_log()  # the shared compile first: the glue model's compile is then a cache hit
    with db.cleaned():
        out = db.run_block(block, tmp_path)
    nxt = following_output(block)
    if nxt is not None:
        check(nxt, out, [tmp_path, db.ROOT])


def test_a_block_leaves_torch_logging_as_it_found_it(tmp_path):
    """docs/logging.md's ``set_logs(modules={"fusionguard": ...})`` runs before ``enable()``: torch then
    registers the name itself (any importable module), and ``disable()`` rightly leaves torch's own
    registration. ``cleaned()`` must take it back, or every later test in this process starts with
    fusionguard registered (test_undo_registry.py failed so, behind this block on one xdist worker)."""
    from fusionguard import torch_internals as ti

    (block,) = [b for b in RUN if b.python and 'set_logs(modules={"fusionguard"' in b.text]
    assert not ti.torch_log_registered("fusionguard"), "registered before the block: an earlier test left it"
    with db.cleaned():
        db.run_block(block, tmp_path)
        assert ti.torch_log_registered("fusionguard")
    assert not ti.torch_log_registered("fusionguard")


@pytest.mark.parametrize("block", OUTPUT_OF, ids=[b.id for b in OUTPUT_OF])
def test_output_block(block, producers):
    real, dirs = producers.get(block.args["of"])
    check(block, real, dirs)
