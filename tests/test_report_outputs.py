"""What ``fusionguard report`` writes (#32): an output that is an input is refused before anything
is written; the page's size bound holds for any log; the page shows invisible and direction
characters escaped; a report's outputs take the input logs' most restrictive mode; the run's
strings are redacted where fusionguard writes them."""

from __future__ import annotations

import json
import os
import stat

import pytest
from conftest import run_cli
from test_report_numbers import ev, header, write  # (one copy of the log builders of the report tests added in #32)

from fusionguard.report import html as report_html
from fusionguard.report.build import build


def small_log(path):
    return write(
        path,
        [
            header(),
            dict(
                ev("flex_call", 2, layer="layers.0", phase="forward", path="dense", cause="eager_call", action="warn", scores_bytes=1000),
                level="warning",
            ),
            ev("shutdown", 3, reason="exit"),
        ],
    )


# -- 1. an output that is an input ---------------------------------------------------------------------


def _clobber_cases(tmp_path):
    """(inputs, output path) pairs where the output is an input by some name."""
    run = tmp_path / "run"
    log = small_log(run / "fg.jsonl")
    small_log(run / "sub" / "other.jsonl")
    (run / "fg.jsonl.1").write_bytes(log.read_bytes())
    os.symlink(log, tmp_path / "alias.txt")
    os.link(log, tmp_path / "hard.html")
    os.symlink(run, tmp_path / "runlink")
    return [
        ([log], log),  # the issue's own case
        ([log], tmp_path / "alias.txt"),  # a symlink to it
        ([log], tmp_path / "hard.html"),  # a hard link
        ([tmp_path / "alias.txt"], log),  # the input named through a link
        ([run], run / "fg.jsonl"),  # a log inside an input directory
        ([run], run / "fg.jsonl.1"),  # a rotated part inside it
        ([run], run / "sub" / "other.jsonl"),
        ([run], tmp_path / "runlink" / "fg.jsonl"),  # the directory through a link
        ([run], run / "new.jsonl"),  # not there yet, but a log's name inside an input directory
    ]


@pytest.mark.parametrize("flag", ["-o", "--html", "--plot"])
def test_an_output_that_is_an_input_exits_2_and_writes_nothing(flag, tmp_path, capsys):
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    for inputs, out in _clobber_cases(tmp_path):
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()}
        rc, stdout, err = run_cli(capsys, *inputs, flag, out)
        assert rc == 2, (inputs, out, err)
        assert "is an input" in err and "Traceback" not in err and stdout == "", err
        after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()}
        assert after == before, (inputs, out)
        assert not (tmp_path / "run" / "new.jsonl").exists()


def test_an_output_beside_the_input_is_still_written(tmp_path, capsys):
    log = small_log(tmp_path / "run" / "fg.jsonl")
    rc, _, err = run_cli(capsys, log, "-o", tmp_path / "run" / "report.txt", "--html", tmp_path / "run" / "report.html")
    assert rc == 0, err
    assert (tmp_path / "run" / "report.txt").read_text().startswith("fusionguard report:")
    assert (tmp_path / "run" / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_two_outputs_naming_one_file_exit_2_and_write_nothing(tmp_path, capsys):
    """``-o x --html x`` (the page replaced the text report, exit 0), ``--plot x.png --html x.png``,
    ``--plot x`` (x.png) with ``--html x.png``, and one file named through a symlink."""
    log = small_log(tmp_path / "fg.jsonl")
    (tmp_path / "there.txt").write_text("keep")
    os.symlink(tmp_path / "there.txt", tmp_path / "alias")
    pairs = [("-o", "same.out", "--html", "same.out"), ("-o", "alias", "--html", "there.txt")]
    try:
        import matplotlib  # noqa: F401

        pairs += [("--plot", "p.png", "--html", "p.png"), ("--plot", "p", "--html", "p.png"), ("-o", "q.png", "--plot", "q")]
    except ImportError:
        pass
    for a, x, b, y in pairs:
        rc, out, err = run_cli(capsys, log, a, tmp_path / x, b, tmp_path / y)
        assert rc == 2 and "name the same file" in err and out == "", (a, x, b, y, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["alias", "fg.jsonl", "there.txt"], (a, x, b, y)
        assert (tmp_path / "there.txt").read_text() == "keep"
    rc, _, err = run_cli(capsys, log, "-o", os.devnull, "--html", os.devnull)
    assert rc == 0, err


FAULTHANDLER_TEXT = (
    "Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f01 (most recent call first):\n"
    '  File "/home/me/--password=hunter2hunter2/train.py", line 3 in step\n\n'
)


def test_a_native_crash_file_the_logs_name_is_never_written_over_and_its_text_is_redacted(tmp_path, capsys):
    """The faulthandler file is the only record of a segfault; the logs name it (not ``PATH``).
    Its frames are written by faulthandler, never redacted by fusionguard: the report redacts them."""
    run = tmp_path / "run"
    crash = run / "fg.pid100.crash"
    log = write(
        run / "fg.jsonl",
        [
            dict(header(), crash_file=str(crash)),
            dict(ev("flex_call", 2, layer="a", phase="forward", path="dense", cause="eager_call"), level="warning"),
        ],
    )
    crash.write_text(FAULTHANDLER_TEXT)
    for inputs in ([log], [run]):
        for flag in ("-o", "--html"):
            rc, out, err = run_cli(capsys, *inputs, flag, crash)
            assert rc == 2 and "crash file" in err and out == "", (inputs, flag, err)
            assert crash.read_text() == FAULTHANDLER_TEXT
    page = tmp_path / "r.html"
    for fmt in ("text", "json", "csv"):
        rc, out, err = run_cli(capsys, log, "--format", fmt, "--html", page)
        assert rc == 0, err
        assert "hunter2hunter2" not in out and "hunter2hunter2" not in page.read_text(), fmt
    assert "native crash (SIGSEGV)" in run_cli(capsys, log)[1]


def test_an_empty_html_path_is_a_usage_error(tmp_path, capsys):
    rc, out, err = run_cli(capsys, small_log(tmp_path / "fg.jsonl"), "--html", "")
    assert rc == 2 and "--html" in err and out == "", err


# -- smaller: invisible characters, a run ended by SIGTERM ------------------------------------------------

INVISIBLE = ["\u200f", "\u061c", "\u200b", "\u2028", "\ufeff", "\u202e"]  # RLM, ALM, ZWSP, LINE SEPARATOR, BOM, RLO
# soft hyphen, Mongolian vowel separator, invisible separator, variation selector, Hangul filler, tag characters (hidden ASCII)
MORE_INVISIBLE = ["\xad", "\u180e", "\u2063", "\ufe0f", "\u3164", "\U000e0041", "\U000e007f"]


def test_every_invisible_format_character_is_escaped_and_the_json_stays_json(tmp_path, capsys):
    name = "layers.0" + "".join(MORE_INVISIBLE) + "x"
    log = write(
        tmp_path / "fg.jsonl",
        [
            header(),
            dict(ev("flex_call", 2, layer=name, phase="forward", path="dense", cause="eager_call", action="warn"), level="warning"),
            ev("shutdown", 3, reason="exit"),
        ],
    )
    page = tmp_path / "r.html"
    for fmt in ("text", "json", "csv"):
        rc, out, err = run_cli(capsys, log, "--format", fmt, "--html", page)
        assert rc == 0, err
        assert not [hex(ord(c)) for c in MORE_INVISIBLE if c in out or c in page.read_text(encoding="utf-8")], fmt
        if fmt == "json":
            assert [r["layer"] for r in json.loads(out)["rows"]] == [name]  # (escaped, the same data)


def test_invisible_and_direction_characters_are_shown_escaped_in_every_output(tmp_path, capsys):
    name = "layers.0" + "".join(INVISIBLE) + "x"
    log = write(
        tmp_path / "fg.jsonl",
        [
            header(),
            dict(ev("flex_call", 2, layer=name, phase="forward", path="dense", cause="eager_call", action="warn"), level="warning"),
            ev("shutdown", 3, reason="exit"),
        ],
    )
    page = tmp_path / "r.html"
    for fmt in ("text", "json", "csv"):
        rc, out, err = run_cli(capsys, log, "--format", fmt, "--html", page)
        assert rc == 0, err
        for c in INVISIBLE:
            assert c not in out, (fmt, hex(ord(c)))
    text = page.read_text(encoding="utf-8")
    for c in INVISIBLE:
        assert c not in text and f"\\u{ord(c):04x}" in text, hex(ord(c))


def test_a_run_ended_by_sigterm_is_not_a_clean_banner(tmp_path, capsys):
    log = write(
        tmp_path / "fg.jsonl",
        [header(), ev("flex_run", 2, layer="a", phase="forward", path="fused", flex_calls=1), ev("shutdown", 3, reason="sigterm")],
    )
    kind, sentence = report_html.ending(build([str(log)]))
    assert kind == "terminated" and "SIGTERM" in sentence and "clean" not in sentence
    page = tmp_path / "r.html"
    assert run_cli(capsys, log, "--html", page)[0] == 0
    banner = page.read_text(encoding="utf-8").split('<header class="banner ', 1)[1].split('"', 1)[0]
    assert banner == "b-stopped"


# -- 7. the page's bound -------------------------------------------------------------------------------


def quote_flood(path, layers=300, causes=9, ranks=1):
    """The issue's shape, smaller: every string 400 ``"`` (six bytes each once HTML-escaped)."""
    q = '"' * 400
    events, seq = [], 2
    for rank in range(ranks):
        events.append(header(pid=100 + rank, rank=rank))
        for i in range(layers):
            for c in range(causes):
                events.append(
                    dict(
                        ev(
                            "flex_call",
                            seq,
                            pid=100 + rank,
                            rank=rank,
                            layer=f"{q}{i}",
                            phase="forward",
                            path="dense",
                            cause=f"{q}{c}",
                            action="warn",
                            scores_bytes=1000,
                            call_site={"file": q, "line": i, "function": q},
                        ),
                        level="warning",
                    )
                )
                seq += 1
    return write(path, events)


def test_the_page_stays_within_its_bound_for_any_log_and_says_what_was_cut(tmp_path, capsys, monkeypatch):
    """The bound is measured on what is written (escaping grows a ``"`` six-fold). Here the
    bound is 1 MB so that a small log overflows it; docs/cli.md's is 16 MB."""
    log = quote_flood(tmp_path / "fg.jsonl")
    monkeypatch.setattr(report_html, "MAX_PAGE_BYTES", 1_000_000)
    page = tmp_path / "r.html"
    rc, _, err = run_cli(capsys, log, "--html", page)
    assert rc == 0, err
    size = page.stat().st_size
    assert size <= 1_000_000, size
    text = page.read_text(encoding="utf-8")
    assert text.rstrip().endswith("</html>") and 'id="cut"' in text and "cut to stay within 1,000,000 bytes" in text
    assert "DENSE: 2,700 dense FlexAttention calls" in text  # the verdict is never cut
    monkeypatch.setattr(report_html, "MAX_PAGE_BYTES", 100)  # below any page: the least page, still saying why
    assert run_cli(capsys, log, "--html", page)[0] == 0
    text = page.read_text(encoding="utf-8")
    assert "DENSE: 2,700 dense" in text and "only the verdict: every section was left out" in text and page.stat().st_size < 20_000


# -- 11. secrets -----------------------------------------------------------------------------------------

SECRETS = {
    "hf": "hf_abcdefghijklmnopqrstuvwxyz0123",
    "url": "https://alice:s3cr3tPassw0rd@example.com/repo.git",
    "bearer": "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9abcdef.0123456789abcdef",
    "bearer2": "bearer abcdef0123456789ABCDEF.xyz",
    "aws": "AKIAABCDEFGHIJKLMNOP",
    "gcp": "AIzaSyA1234567890abcdefghijklmnopqrstuv",
    "option": "--password=hunter2hunter2",
    "option2": "--api-key hunter3hunter3",
    "quoted": "--password 'hunter4hunter4'",  # quoted values, a query parameter, a variable, Basic, no user
    "quoted2": '--api-key "hunter5 hunter5"',
    "query": "https://example.com/x?a=1&token=hunter6hunter6",
    "sas": "https://acct.blob.core.windows.net/c/b?sv=2020&sig=hunter7hunter7",
    "env": "AWS_SECRET_ACCESS_KEY=hunter8hunter8",
    "yaml": "password: hunter9hunter9",
    "basic": "Authorization: Basic aHVudGVyMTA6aHVudGVyMTA=",
    "nouser": "https://:hunter11hunter11@example.com/",
}
LEAKS = [
    "abcdefghijklmnopqrstuvwxyz0123",
    "s3cr3tPassw0rd",
    "eyJhbGciOiJIUzI1NiJ9abcdef",
    "abcdef0123456789ABCDEF",
    "AKIAABCDEFGHIJKLMNOP",
    "AIzaSyA1234567890abcdefghijklmnopqrstuv",
    "hunter2hunter2",
    "hunter3hunter3",
    "hunter4",
    "hunter5",
    "hunter6",
    "hunter7",
    "hunter8",
    "hunter9",
    "aHVudGVyMTA6",
    "hunter11",
]


def test_redact_text_covers_every_secret_shape_and_keeps_ordinary_text():
    from fusionguard.eventlog.redact import redact_text

    for name, secret in SECRETS.items():
        out = redact_text(f"failed: {secret} (while loading)")
        assert not any(leak in out for leak in LEAKS), (name, out)
        assert "<redacted>" in out and out.startswith("failed: ") and out.endswith(" (while loading)"), out
    for ordinary in (
        "KeyError: 'layers.0.self_attn'",
        "tensor 'q' size mismatch at index 2. expected 2048, actual 1536",
        "/home/me/train.py:7 in attention",
        "https://example.com/a:b",
        "--lr 3e-4 --steps 512",
        "num_key_value_heads=8 key=layers.0 max_tokens=512",
        "unexpected token: ')' in score_mod",
        "basic block",
    ):
        assert redact_text(ordinary) == ordinary


CRASH_SCRIPT = """
import sys, warnings
import torch
import fusionguard
from torch.nn.attention.flex_attention import flex_attention
warnings.simplefilter("ignore")
fusionguard.enable(log_path=sys.argv[1])
q = torch.randn(1, 2, 16, 8)
flex_attention(q, q, q)
raise RuntimeError("could not fetch " + sys.argv[2] + " with token " + sys.argv[3] + "; " + sys.argv[4])
"""


def test_a_crash_with_secrets_is_redacted_in_the_log_and_the_report_outputs_keep_its_mode(tmp_path, capsys):
    """A real process: its crash message holds a Hugging Face token, a URL with a password and a
    bearer token. None reaches the log or the page; the page, CSV, text and plot are as private as
    the log (0600 by default), whatever the umask."""
    import sys

    import forkserver  # (a process of its own, not a fresh interpreter: tests/forkserver.py)
    from conftest import child_env

    log = tmp_path / "fg.jsonl"
    p = forkserver.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(log), SECRETS["url"], SECRETS["hf"], SECRETS["bearer"]],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1 and "RuntimeError" in p.stderr, p.stderr[-2000:]
    text = log.read_text()
    assert '"crash"' in text and "could not fetch" in text
    assert not any(leak in text for leak in LEAKS), [leak for leak in LEAKS if leak in text]
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    old = os.umask(0o022)
    try:
        outs = {"--html": tmp_path / "r.html", "-o": tmp_path / "r.csv"}
        args = [log, "--format", "csv"] + [x for kv in outs.items() for x in kv]
        try:
            import matplotlib  # noqa: F401

            outs["--plot"] = tmp_path / "r.png"
            args += ["--plot", outs["--plot"]]
        except ImportError:
            pass
        rc, _, err = run_cli(capsys, *args)
    finally:
        os.umask(old)
    assert rc == 0, err
    for flag, path in outs.items():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, (flag, oct(path.stat().st_mode))
    page = outs["--html"].read_text(encoding="utf-8")
    assert "could not fetch" in page and not any(leak in page for leak in LEAKS)
