"""The pytest plugin, run in real inner pytest sessions (pytester, one process per session: forked
from tests/forkserver.py, or a fresh interpreter where what the plugin imports is checked).

Inner tests are tiny: eager flex_attention on 1x2x16x8 CPU tensors, inference only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import read_jsonl, run_forked

pytest_plugins = ["pytester"]

PLUGIN = ("-p", "fusionguard.pytest_plugin")

HELPERS = """
import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import fusionguard


def attend():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with torch.no_grad():
        return flex_attention(q, k, v)
"""

STRICT_TESTS = (
    HELPERS
    + """

def test_clean():
    assert torch.ones(2).sum() == 2


def test_dense():
    attend()


def test_swallowed():
    try:
        attend()
    except RuntimeError:
        pass  # code under test hiding the error: the plugin still fails the test


@pytest.mark.fusionguard_allow_dense
def test_reference():
    attend()  # an eager reference computation, allowed on purpose


def test_turns_the_guard_off():
    fusionguard.disable()


def test_guarded_again():
    assert fusionguard.is_enabled()
    attend()
"""
)


def section(stdout: str, title: str) -> str:
    """The text of one '=== title ===' section of the terminal output."""
    text = "\n".join(stdout)
    match = re.search(rf"^=+ {re.escape(title)} =+$(.*?)(?=^=+ .* =+$|\Z)", text, re.M | re.S)
    assert match, f"no {title!r} section in:\n{text}"
    return match.group(1)


def test_strict_fails_dense_tests_with_the_verdict(pytester):
    pytester.makepyfile(test_inner=STRICT_TESTS)
    result = run_forked(pytester, *PLUGIN, "--fusionguard=strict", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=3)
    out = "\n".join(result.outlines)
    result.stdout.fnmatch_lines(["fusionguard: strict mode, log: *fusionguard.jsonl"])
    # the failing test's report: the DenseFallbackError with the whole verdict, and our section
    result.stdout.fnmatch_lines(
        [
            "*_ test_dense _*",
            "*DenseFallbackError: fusionguard: dense FlexAttention forward blocked before it allocated "
            "a 2.05 KB score matrix (strict mode)",
            "*at:*test_inner.py:* in attend",
            "*cause:    eager_call*",
            "*fix:*torch.compile*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_swallowed _*",
            "fusionguard (strict): 1 dense FlexAttention call(s) blocked during call, but the DenseFallbackError did not reach pytest*",
            "fusionguard: dense FlexAttention forward blocked*",
        ]
    )
    assert "fusionguard (call)" in out  # report section with the verdicts
    summary = section(result.outlines, "fusionguard")
    assert (
        "strict mode: 3 dense FlexAttention call(s) in 3 of 6 test(s); 1 allowed dense call(s) in 1 test(s) "
        "(fusionguard_allow_dense or allow_dense(): not counted); log: " in summary
    )
    assert re.search(r"test_inner.py::test_dense\s+1  forward eager_call \(blocked\)", summary)
    assert re.search(r"test_inner.py::test_swallowed\s+1  forward eager_call \(blocked\)", summary)
    assert re.search(r"test_inner.py::test_reference\s+1  forward eager_call \(allowed\)", summary)
    assert re.search(r"test_inner.py::test_guarded_again\s+1  forward eager_call \(blocked\)", summary)
    assert "test_clean" not in summary and "by cause: eager_call 3" in summary
    result.stdout.fnmatch_lines(
        [
            "FAILED test_inner.py::test_dense - *DenseFallbackError*",
            "FAILED test_inner.py::test_swallowed*",
            "FAILED test_inner.py::test_guarded_again*",
        ],
        consecutive=False,
    )
    # the log: in the session's base temporary directory, one record per dense call
    (log,) = pytester.path.rglob("fusionguard.jsonl")
    events = read_jsonl(log)
    calls = [e for e in events if e["event"] == "flex_call"]
    assert [c["action"] for c in calls] == ["raise", "raise", "allow", "raise"]
    assert all(c["call_site"]["function"] == "attend" for c in calls)
    assert [e["event"] for e in events].count("header") == 2, "re-enabled after the test turned it off"
    assert events[-1]["event"] == "shutdown"


def test_warn_collects_dense_calls_and_reports_them(pytester):
    pytester.makepyfile(
        test_inner=HELPERS
        + """

def test_twice():
    attend()
    attend()


def test_clean():
    pass
"""
    )
    log = pytester.path / "logs" / "fg.jsonl"
    junit = pytester.path / "junit.xml"
    result = run_forked(
        pytester, *PLUGIN, "--fusionguard=warn", f"--fusionguard-log={log}", f"--junitxml={junit}", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*DenseFallbackWarning: fusionguard: dense FlexAttention forward is materialising a 2.05 KB score matrix"])
    summary = section(result.outlines, "fusionguard")
    assert f"warn mode: 2 dense FlexAttention call(s) in 1 of 2 test(s); log: {log}" in summary
    assert re.search(r"test_inner.py::test_twice\s+2  forward eager_call \(ran\) x2", summary)
    calls = [e for e in read_jsonl(log) if e["event"] == "flex_call"]
    assert [c["action"] for c in calls] == ["warn", "warn"]
    # the per-test record travels on the report (user_properties: junitxml, xdist)
    xml = junit.read_text()
    assert '<property name="fusionguard"' in xml and "eager_call" in xml


def test_off_by_default_imports_nothing_heavy(pytester):
    pytester.makepyfile(
        test_inner="""
import sys


def test_untouched(request):
    assert "torch" not in sys.modules, "the plugin imported torch"
    assert not request.config.pluginmanager.has_plugin("fusionguard-session")
    assert "fusionguard.pytest_plugin" in sys.modules
"""
    )
    for extra in ((), ("--fusionguard=off",)):
        result = pytester.runpytest_subprocess(*PLUGIN, *extra, "-p", "no:cacheprovider")
        result.assert_outcomes(passed=1)
        # no header line, no summary section (the "plugins:" line may name the distribution)
        noise = [line for line in result.outlines if "fusionguard:" in line or re.match(r"=+ fusionguard =+$", line)]
        assert noise == [], result.outlines
    assert not list(pytester.path.rglob("fusionguard*.jsonl"))


MARKED_TESTS = (
    HELPERS
    + """
import unittest


@pytest.mark.xfail(reason="known to be slow")
def test_xfail_dense():
    attend()


@pytest.mark.xfail(reason="catches it", strict=False)
def test_xfail_swallowed():
    try:
        attend()
    except RuntimeError:
        pass


@pytest.mark.xfail(reason="a genuine expected failure")
def test_xfail_unrelated():
    assert False


class Case(unittest.TestCase):
    @unittest.expectedFailure
    def test_expected_failure_dense(self):
        attend()


@pytest.mark.xfail(reason="allowed on purpose")
@pytest.mark.fusionguard_allow_dense
def test_xfail_allowed():
    attend()
    assert False
"""
)


def test_a_blocked_call_fails_the_test_whatever_its_marks(pytester):
    """Under strict mode an xfail / unittest.expectedFailure test that runs dense FlexAttention
    must not report XFAIL (that hides the verdict); fusionguard_allow_dense is the way to allow it."""
    pytester.makepyfile(test_inner=MARKED_TESTS)
    result = run_forked(pytester, *PLUGIN, "--fusionguard=strict", "-p", "no:cacheprovider", "-rfx")
    result.assert_outcomes(failed=3, xfailed=2)
    result.stdout.fnmatch_lines(
        [
            "FAILED test_inner.py::test_xfail_dense*",
            "FAILED test_inner.py::test_xfail_swallowed*",
            "FAILED test_inner.py::Case::test_expected_failure_dense*",
        ],
        consecutive=False,
    )
    out = "\n".join(result.outlines)
    assert "a blocked call fails the test whatever its marks" in out
    assert "XFAIL test_inner.py::test_xfail_unrelated" in out and "XFAIL test_inner.py::test_xfail_allowed" in out


def test_junitxml_property_is_json_and_the_ini_option_turns_it_on(pytester):
    pytester.makepyfile(test_inner=HELPERS + "\n\ndef test_dense():\n    attend()\n")
    pytester.makeini("[pytest]\nfusionguard = warn\nfusionguard_log = logs/fg.jsonl\n")
    junit = pytester.path / "junit.xml"
    result = run_forked(pytester, *PLUGIN, f"--junitxml={junit}", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["fusionguard: warn mode, log: *fg.jsonl"])
    import xml.etree.ElementTree as ET

    (prop,) = [p for p in ET.parse(junit).iter("property") if p.get("name") == "fusionguard"]
    (call,) = __import__("json").loads(prop.get("value"))
    assert (call["phase"], call["cause"], call["action"]) == ("forward", "eager_call", "warn")
    assert (pytester.path / "logs" / "fg.jsonl").exists()

    # the command line wins over the ini file; a bad ini value is a usage error
    result = run_forked(pytester, *PLUGIN, "--fusionguard=strict", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    pytester.makeini("[pytest]\nfusionguard = loud\n")
    result = run_forked(pytester, *PLUGIN, "-p", "no:cacheprovider")
    assert result.ret == 4 and "fusionguard = 'loud': use one of strict, warn, oom, off" in "\n".join(result.errlines)


# -- #27 part 5: the summary says what happened ----------------------------------------------------


def test_allowed_calls_are_listed_never_counted_as_dense_as_report_counts_them(pytester):
    pytester.makepyfile(
        test_inner=HELPERS
        + """

@pytest.mark.fusionguard_allow_dense
def test_reference():
    attend()


def test_clean():
    pass
"""
    )
    log = pytester.path / "fg.jsonl"
    result = run_forked(pytester, *PLUGIN, "--fusionguard=strict", f"--fusionguard-log={log}", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    summary = section(result.outlines, "fusionguard")
    assert (
        f"strict mode: no dense FlexAttention calls in 2 test(s); 1 allowed dense call(s) in 1 test(s) "
        f"(fusionguard_allow_dense or allow_dense(): not counted); log: {log}" in summary
    ), summary
    assert re.search(r"test_inner.py::test_reference\s+1  forward eager_call \(allowed\)", summary)
    assert "by cause" not in summary
    # the same verdict as `fusionguard report`
    import subprocess
    import sys

    gate = subprocess.run(
        [sys.executable, "-m", "fusionguard", "report", str(log), "--fail-on-dense"], capture_output=True, text=True, timeout=120
    )
    assert gate.returncode == 0, gate.stderr
    assert "1 allowed dense call" in gate.stdout


def test_under_xdist_the_summary_points_at_the_log_the_workers_wrote(pytester):
    import xdist  # noqa: F401  (pytest-xdist: in the test extra)

    pytester.makepyfile(test_inner=HELPERS + "\n\ndef test_a():\n    attend()\n\n\ndef test_b():\n    attend()\n")
    log = pytester.path / "logs" / "fg.jsonl"
    result = run_forked(pytester, *PLUGIN, "-n", "2", "--fusionguard=warn", f"--fusionguard-log={log}", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    out = "\n".join(result.outlines)
    assert "base temporary" not in out, out
    result.stdout.fnmatch_lines([f"fusionguard: warn mode, log: {log}"])
    summary = section(result.outlines, "fusionguard")
    assert f"warn mode: 2 dense FlexAttention call(s) in 2 of 2 test(s); log: {log}" in summary, summary
    events = read_jsonl(log)
    assert [e["event"] for e in events].count("flex_call") == 2 and len({e["pid"] for e in events}) == 2, "both workers wrote it"

    # no --fusionguard-log: each worker's own file, named
    result = run_forked(pytester, *PLUGIN, "-n", "2", "--fusionguard=warn", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    line = next(x for x in section(result.outlines, "fusionguard").splitlines() if "log: " in x)
    named = line.split("log: ", 1)[1].split(", ")
    assert len(named) == 2 and all(name.endswith("fusionguard.jsonl") for name in named), line
    assert sum([e["event"] for e in read_jsonl(name)].count("flex_call") for name in named) == 2


def test_the_kill_switch_wins_over_the_option_and_the_summary_says_so(pytester, monkeypatch):
    pytester.makepyfile(test_inner=HELPERS + "\n\ndef test_dense():\n    attend()\n    assert not fusionguard.is_enabled()\n")
    monkeypatch.setenv("FUSIONGUARD", "off")
    result = run_forked(pytester, *PLUGIN, "--fusionguard=strict", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)  # the dense call ran: nothing was guarded
    out = "\n".join(result.outlines)
    assert "no dense FlexAttention calls" not in out, out
    message = (
        "off: FUSIONGUARD=off in the environment (the kill switch) wins over --fusionguard=strict; "
        "FlexAttention calls are not checked, no log"
    )
    result.stdout.fnmatch_lines([f"fusionguard: {message}"])
    assert f"{message} (1 test(s) ran unguarded)" in section(result.outlines, "fusionguard")
    assert not list(pytester.path.rglob("fusionguard*.jsonl"))


def test_the_documented_ini_block_copied_verbatim_writes_logs_fusionguard_jsonl(pytester):
    """#37 point 1: docs/pytest.md's block, and the old block with an inline ``; optional``
    comment (which pytest keeps in the value): both write logs/fusionguard.jsonl."""
    docs = (Path(__file__).parent.parent / "docs" / "pytest.md").read_text()
    block = re.search(r"```ini\n(.*?)```", docs, re.S).group(1)
    pytester.makepyfile(test_inner=HELPERS + "\n\ndef test_ok():\n    assert True\n")
    for ini in (block, "[pytest]\nfusionguard = warn   ; a comment\nfusionguard_log = logs/fusionguard.jsonl   ; optional\n"):
        pytester.makeini(ini)
        result = run_forked(pytester, *PLUGIN, "-p", "no:cacheprovider")
        result.assert_outcomes(passed=1)
        assert (pytester.path / "logs" / "fusionguard.jsonl").is_file(), result.stdout.lines
        assert [p.name for p in (pytester.path / "logs").iterdir()] == ["fusionguard.jsonl"]
        (pytester.path / "logs" / "fusionguard.jsonl").unlink()


@pytest.mark.parametrize("value", [None, "", "off", " OFF ", "Off\n", "of", "warn", "strict", "bogus"])
def test_the_plugin_reads_modes_and_the_kill_switch_as_activate_does(monkeypatch, value):
    """One list of mode words (``activate.MODES``; the plugin keeps a copy it does not import: it
    loads in every pytest run), and one reading of ``FUSIONGUARD=off``; ``enable(mode=...)``'s
    words are the same but the kill switch."""
    from fusionguard import activate, pytest_plugin
    from fusionguard.core import config

    assert pytest_plugin.MODES == activate.MODES and config.MODES == tuple(m for m in activate.MODES if m != "off")
    if value is None:
        monkeypatch.delenv("FUSIONGUARD", raising=False)
    else:
        monkeypatch.setenv("FUSIONGUARD", value)
    monkeypatch.setattr(activate, "_told", set())  # (a bad value's note: said here, never again)
    assert pytest_plugin._kill_switch() == (activate.env_mode() == "off")


def test_the_documented_switch_keeps_pytest_from_loading_the_installed_plugin(pytester):
    """docs/pytest.md: ``-p no:<the pytest11 entry point's name>`` turns off the plugin that installing
    fusionguard registers: an ini ``fusionguard = strict`` then guards nothing, ``--fusionguard`` is a usage error."""
    root = Path(__file__).parent.parent
    name = re.search(r"pytest11 =\s*\n\s*(\S+) = fusionguard\.pytest_plugin\n", (root / "setup.cfg").read_text()).group(1)
    assert f"pytest -p no:{name}`" in (root / "docs" / "pytest.md").read_text()
    pytester.makeini("[pytest]\nfusionguard = strict\n")
    inner = f"""

def test_dense():
    import importlib.metadata

    assert {name!r} in [e.name for e in importlib.metadata.entry_points(group="pytest11")]  # (installed: pytest loads it)
    attend()
    assert not fusionguard.is_enabled()
"""
    pytester.makepyfile(test_inner=HELPERS + inner)
    run_forked(pytester, "-p", "no:cacheprovider").assert_outcomes(failed=1)  # (loaded from the entry point alone: strict)
    off = run_forked(pytester, "-p", f"no:{name}", "-p", "no:cacheprovider")
    off.assert_outcomes(passed=1)
    assert "Unknown config option: fusionguard" in off.stdout.str()
    assert not [line for line in off.outlines if re.match(r"=+ fusionguard =+$", line)]
    usage = run_forked(pytester, "-p", f"no:{name}", "-p", "no:cacheprovider", "--fusionguard=strict")
    assert usage.ret == 4 and "unrecognized arguments: --fusionguard=strict" in usage.stderr.str()
