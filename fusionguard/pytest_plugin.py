"""pytest plugin: ``pytest --fusionguard=strict`` (or ``=warn``) guards a whole test session.

Registered through the ``pytest11`` entry point, so it is loaded by every pytest run in an
environment where fusionguard is installed. The mode comes from ``--fusionguard=MODE`` or, without
it, the ini option ``fusionguard = strict`` (``pytest.ini``, ``[tool.pytest.ini_options]`` in
``pyproject.toml``, ...; also ``fusionguard_log = PATH``). Off, it does nothing: this module
imports neither torch nor fusionguard's patches, and no hook beyond the option parsing is
registered.

With the option, the guard is enabled at session start (log: ``--fusionguard-log PATH``, a file or
a directory, default ``fusionguard.jsonl`` in pytest's base temporary directory), and then:

- strict: a test that runs a dense FlexAttention path fails with the ``DenseFallbackError``
  verdict in its report, whatever its marks: a test that *catches* the error (``except
  RuntimeError: ...``) fails too, and so does an ``xfail`` / ``unittest.expectedFailure`` test (an
  expected failure would hide the verdict); ``fusionguard_allow_dense`` is the way to allow it.
- warn: dense calls run; each one is a ``DenseFallbackWarning`` (pytest's warnings summary) and is
  collected per test.
- each test carries its dense calls: ``user_properties`` entry ``fusionguard``, a JSON text (a list
  of {seq, phase, cause, action, traced, call_site, scores_bytes}; in junitxml and across xdist),
  a report section ``fusionguard (<phase>)`` with the verdicts; the terminal summary lists dense
  calls per test and per cause (allowed calls listed, never counted as dense, as in ``report``)
  and the log: under xdist, the files the workers wrote (``workeroutput``).
- ``FUSIONGUARD=off`` in the environment (the kill switch) wins over the option: nothing is
  enabled, and the header and summary say so.
- ``@pytest.mark.fusionguard_allow_dense`` runs a test inside ``fusionguard.allow_dense()`` (an
  eager reference computation, say): the dense calls that block allows are logged as allowed and
  do not fail it. By allow_dense()'s exact thread rule (docs/guarantees.md), on CUDA a backward
  whose forward ran outside the block and an activation-checkpointing re-run forward run on
  autograd's device thread, outside the block, and still fail the test (unless the test calls
  ``backward()`` under ``torch.autograd.set_multithreading_enabled(False)``).

A test that calls ``fusionguard.enable(...)`` / ``disable()`` itself changes the test session's guard;
the plugin puts its own configuration back before the next test.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import tempfile
from typing import Any, Dict, Generator, Iterator, List, Optional

import pytest

MODES = ("strict", "warn", "oom", "off")  # (activate.MODES: not imported, this module loads in every pytest run; a test checks them equal)
PROPERTY = "fusionguard"
MARKER = "fusionguard_allow_dense"


def _mode_word(value: str) -> str:
    return value.strip().lower()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("fusionguard", "fusionguard: catch FlexAttention's dense fallback")
    group.addoption(
        "--fusionguard",
        action="store",
        type=_mode_word,  # (case-insensitive, as FUSIONGUARD=, the ini option and enable(mode=))
        choices=MODES,
        default=None,
        metavar="MODE",
        help="guard FlexAttention for the session: strict (a dense call fails the test), "
        "warn (dense calls are reported), oom (dense calls run, one predicted not to fit its GPU fails the test), off (default)",
    )
    group.addoption(
        "--fusionguard-log",
        action="store",
        default=None,
        metavar="PATH",
        help="fusionguard JSON-lines log: a file, or a directory (one file per process); "
        "default: fusionguard.jsonl in pytest's base temporary directory",
    )
    parser.addini("fusionguard", "fusionguard mode for the session when --fusionguard is not given: strict, warn, oom or off", default="")
    parser.addini("fusionguard_log", "fusionguard log path when --fusionguard-log is not given", default="")


def _ini(config: Any, name: str) -> str:
    """An ini value without a trailing `` ; comment`` (pytest keeps an inline comment as part of
    the value: ``fusionguard_log = logs/fg.jsonl   ; optional`` would name a file ``fg.jsonl   ;
    optional``); a value that is only a comment is empty."""
    value = str(config.getini(name) or "")
    for i, ch in enumerate(value):
        if ch in ";#" and (i == 0 or value[i - 1] in " \t"):
            value = value[:i]
            break
    return value.strip()


def _mode(config: Any) -> Optional[str]:
    """``--fusionguard`` first, then the ini option; a bad ini value is a usage error."""
    mode = config.getoption("fusionguard", None)
    if mode is None:
        mode = _ini(config, "fusionguard").lower() or None
        if mode is not None and mode not in MODES:
            raise pytest.UsageError(f"ini option fusionguard = {mode!r}: use one of {', '.join(MODES)}")
    return mode


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: run the test inside fusionguard.allow_dense() (dense FlexAttention calls are "
        "logged as allowed and do not fail it under --fusionguard=strict)",
    )
    mode = _mode(config)
    if mode in (None, "off"):
        return
    # FUSIONGUARD=off in the environment is the kill switch: it wins over the option, as over
    # enable() in code; the session says so rather than reporting "no dense calls".
    config.pluginmanager.register(FusionGuardPlugin(config, mode, killed=_kill_switch()), "fusionguard-session")


def _kill_switch() -> bool:
    """``FUSIONGUARD=off``, read as ``activate.env_mode`` reads it (a test checks them alike)."""
    return os.environ.get("FUSIONGUARD", "").strip().lower() == "off"


def _is_xdist_controller(config: Any) -> bool:
    # pytest-xdist: the controller runs no tests; only its workers need the guard.
    return not hasattr(config, "workerinput") and config.getoption("dist", "no") not in ("no", None)


def _compact(event: Dict[str, Any]) -> Dict[str, Any]:
    site = event.get("call_site") or {}
    return {
        "seq": event.get("seq"),
        "phase": event.get("phase"),
        "cause": event.get("cause"),
        "action": event.get("action"),
        "traced": event.get("traced"),
        "call_site": f"{site.get('file')}:{site.get('line')}" if site else None,
        "scores_bytes": event.get("scores_bytes"),
    }


class FusionGuardPlugin:
    """The plugin's hooks for one test session (registered as ``fusionguard-session``), only when
    ``--fusionguard`` is strict, warn or oom."""

    def __init__(self, config: Any, mode: str, killed: bool = False) -> None:
        self.config = config
        self.mode = mode
        self.strict = mode == "strict"
        self.killed = killed  # FUSIONGUARD=off: nothing is enabled, the plugin says so
        self.log_path: Optional[str] = None
        self.fg_session: Any = None  # the fusionguard.Session of the test session
        self.guarding = not killed and not _is_xdist_controller(config)  # this process runs guarded tests
        self.worker_logs: List[str] = []  # (xdist controller) each worker's log, sent back as it ends
        # filled from reports, so that it also works under xdist (reports come from workers)
        self.dense: Dict[str, List[dict]] = collections.OrderedDict()
        self.tests = 0
        self.compile_records = 0  # flex_compile records (compiled graphs, not calls)
        self.internal_errors = 0

    # -- guard lifecycle ----------------------------------------------------------------
    def _default_log(self) -> str:
        factory = getattr(self.config, "_tmp_path_factory", None)
        if factory is not None:
            return str(factory.getbasetemp() / "fusionguard.jsonl")

        return os.path.join(tempfile.mkdtemp(prefix="fusionguard-"), "fusionguard.jsonl")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: Any) -> None:
        if not self.guarding:
            return
        path = self.config.getoption("fusionguard_log") or _ini(self.config, "fusionguard_log") or self._default_log()
        import fusionguard  # lazy: the plugin loads in every pytest run; fusionguard's runtime only when used

        # keep_all: every dense call of every test is reported, none folded into counters
        self.fg_session = fusionguard.Session(None, mode=self.mode, log_path=path, keep_all=True, name=f"pytest --fusionguard={self.mode}")
        self.fg_session.start()
        self.fg_session.restore()  # (a conftest's own enable() before the session: the session's settings)
        self.log_path = self.fg_session.log_path  # resolved (a directory becomes rank/pid file)
        self.fg_session.new_events()

    def _killed_text(self) -> str:
        given = f"--fusionguard={self.mode}" if self.config.getoption("fusionguard", None) else f"ini fusionguard = {self.mode}"
        return f"off: FUSIONGUARD=off in the environment (the kill switch) wins over {given}; FlexAttention calls are not checked, no log"

    def _configured_log(self) -> Optional[str]:
        """``--fusionguard-log`` / ``fusionguard_log`` as the workers resolve it (None: the default)."""
        path = self.config.getoption("fusionguard_log") or _ini(self.config, "fusionguard_log")
        if not path:
            return None
        full = os.path.abspath(os.path.expanduser(str(path)))
        if os.path.isdir(full) or str(path).endswith(("/", os.sep)):
            return os.path.join(full, "") + " (one file per process)"
        return full

    def _where(self) -> str:
        """Where the test session's log is: this process's file; on an xdist controller, the files
        the workers wrote (or, before they end, what they were told)."""
        if self.guarding:
            return self.log_path or "none (the log could not be opened: events in memory only)"
        logs = sorted(set(self.worker_logs))
        if len(logs) == 1:
            return logs[0]
        if 1 < len(logs) <= 4:
            return ", ".join(logs)
        if logs:
            return f"{len(logs)} files under {os.path.commonpath(logs)}"
        return self._configured_log() or "fusionguard.jsonl in each xdist worker's base temporary directory"

    def pytest_report_header(self, config: Any) -> str:
        if self.killed:
            return f"fusionguard: {self._killed_text()}"
        return f"fusionguard: {self.mode} mode, log: {self._where()}"

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: Any) -> None:
        if not self.guarding:
            return
        import fusionguard  # lazy: the plugin loads in every pytest run; fusionguard's runtime only when used

        self._take_new()  # events after the last test: fused/internal totals only
        self.fg_session.stop()
        fusionguard.disable()  # (also what a test's own enable() left)
        output = getattr(self.config, "workeroutput", None)  # an xdist worker: tell the controller
        if isinstance(output, dict) and self.log_path:
            output["fusionguard_log"] = self.log_path

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """(xdist controller) a worker ended: where its log is."""
        path = (getattr(node, "workeroutput", None) or {}).get("fusionguard_log")
        if isinstance(path, str):
            self.worker_logs.append(path)

    # -- per test -----------------------------------------------------------------------
    def _take_new(self) -> List[dict]:
        """Events logged since the last call (in memory, oldest first)."""
        fresh: List[dict] = self.fg_session.new_events()
        for event in fresh:
            if event.get("event") == "flex_compile":
                self.compile_records += 1
            elif event.get("event") == "internal_error":
                self.internal_errors += 1
        return fresh

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Iterator[None]:
        if not self.guarding:
            yield
            return
        self.fg_session.restore()  # a test that called enable() / disable() itself: the session's settings back
        self._take_new()  # whatever ran between tests is not this test's
        allow: Any = contextlib.nullcontext()
        if item.get_closest_marker(MARKER) is not None:
            import fusionguard  # lazy: the plugin loads in every pytest run; fusionguard's runtime only when used

            allow = fusionguard.allow_dense()
        with allow:
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Generator[None, Any, None]:
        outcome = yield
        if not self.guarding:
            return
        report = outcome.get_result()
        dense = [e for e in self._take_new() if e.get("event") == "flex_call"]
        if not dense:
            return
        from fusionguard.session import describe  # lazy: the plugin loads in every pytest run

        messages = [describe(e) for e in dense]
        # on the item: the teardown report (junitxml, xdist, our summary) then carries every phase
        entry = (PROPERTY, json.dumps([_compact(e) for e in dense]))  # JSON in junitxml, not a repr
        item.user_properties.append(entry)
        if report.when == "teardown":  # created before this point: add it there too
            report.user_properties.append(entry)
        report.sections.append((f"fusionguard ({report.when})", "\n\n".join(messages)))
        blocked = [m for e, m in zip(dense, messages) if e.get("action") == "raise"]
        if not blocked:
            return
        if hasattr(report, "wasxfail"):
            # xfail / unittest.expectedFailure: an expected failure (or an xpass) would hide the
            # verdict; only fusionguard_allow_dense allows a dense call.
            del report.wasxfail
            report.outcome = "failed"
            report.longrepr = (
                f"fusionguard ({self.mode}): {len(blocked)} dense FlexAttention call(s) blocked during {report.when} of a "
                "test marked as an expected failure; a blocked call fails the test whatever its marks "
                f"(use @pytest.mark.{MARKER} to allow it)\n\n" + "\n\n".join(blocked)
            )
        elif report.passed:
            # The DenseFallbackError was caught by the code under test: still a failure.
            report.outcome = "failed"
            report.longrepr = (
                f"fusionguard ({self.mode}): {len(blocked)} dense FlexAttention call(s) blocked during "
                f"{report.when}, but the DenseFallbackError did not reach pytest (caught by the code "
                "under test?)\n\n" + "\n\n".join(blocked)
            )

    # -- summary --------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call":
            self.tests += 1
        if report.when != "teardown":
            return
        for name, value in report.user_properties:
            if name == PROPERTY:
                try:
                    calls = json.loads(value) if isinstance(value, str) else list(value)
                except (TypeError, ValueError):
                    continue
                self.dense.setdefault(report.nodeid, []).extend(calls)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        tr.write_sep("=", "fusionguard")
        if self.killed:
            tr.write_line(f"{self._killed_text()} ({self.tests} test(s) ran unguarded)")
            return
        calls = [c for per_test in self.dense.values() for c in per_test]
        # allowed calls (fusionguard_allow_dense, allow_dense()) are on purpose: listed, never
        # counted as dense (as `fusionguard report` counts them)
        dense = [c for c in calls if c.get("action") != "allow"]
        dense_tests = sum(1 for per_test in self.dense.values() if any(c.get("action") != "allow" for c in per_test))
        allowed = len(calls) - len(dense)
        head = (
            f"{self.mode} mode: {len(dense)} dense FlexAttention call(s) in {dense_tests} of {self.tests} test(s)"
            if dense
            else f"{self.mode} mode: no dense FlexAttention calls in {self.tests} test(s)"
        )
        if allowed:
            allowed_tests = sum(1 for per_test in self.dense.values() if any(c.get("action") == "allow" for c in per_test))
            head += f"; {allowed} allowed dense call(s) in {allowed_tests} test(s) ({MARKER} or allow_dense(): not counted)"
        tr.write_line(f"{head}; log: {self._where()}")
        if calls:
            width = max(len(nodeid) for nodeid in self.dense)
            for nodeid, per_test in self.dense.items():
                kinds = collections.Counter(f"{c['phase']} {c['cause']} ({_ACTION.get(c['action'], c['action'])})" for c in per_test)
                detail = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in kinds.items())
                tr.write_line(f"  {nodeid:<{width}}  {len(per_test):>3}  {detail}")
        if dense:
            by_cause = collections.Counter(c["cause"] for c in dense)
            tr.write_line("by cause: " + ", ".join(f"{cause} {n}" for cause, n in by_cause.most_common()))
        extra = []
        if self.compile_records:
            extra.append(f"{self.compile_records} fused FlexAttention compile record(s)")
        if self.internal_errors:
            extra.append(f"{self.internal_errors} fusionguard internal error(s), see the log")
        if extra:
            tr.write_line("; ".join(extra))


_ACTION = {"raise": "blocked", "warn": "ran", "allow": "allowed"}
