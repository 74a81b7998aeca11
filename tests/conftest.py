"""Shared helpers: tiny shapes, a direct operator call (the CPU way to get a backward), a guard
fixture that always disables and forgets, and one Inductor-compiled function shared by tests."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# One intra-op thread for the tests and their subprocesses: tiny shapes gain nothing from more,
# and torch 2.7's C++ FlexAttention template emits unbalanced braces (CppCompileError) for any
# score_mod when Inductor generates it for more than one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import fusionguard  # noqa: E402
from fusionguard import _testing, torch_internals  # noqa: E402

HOP_MODULE = importlib.import_module("torch._higher_order_ops.flex_attention")
PUBLIC = importlib.import_module("torch.nn.attention.flex_attention")


def qkv(L=16, KV=None, B=1, HQ=2, HKV=2, D=8, requires_grad=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    KV = KV or L
    q = torch.randn(B, HQ, L, D, generator=g, dtype=dtype)
    k = torch.randn(B, HKV, KV, D, generator=g, dtype=dtype)
    v = torch.randn(B, HKV, KV, D, generator=g, dtype=dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def op_args(q, k, v, block_mask=None, score_mod=None):
    """Arguments of torch.ops.higher_order.flex_attention, as the public API builds them."""
    if block_mask is None:
        block_mask = PUBLIC.create_block_mask(causal, None, None, q.shape[-2], k.shape[-2], device=str(q.device))
    options = PUBLIC._apply_kernel_options(q, k, v, return_lse=True, kernel_options=None)
    score_mod = score_mod or PUBLIC._identity
    return (q, k, v, score_mod, block_mask.as_tuple(), 1.0 / math.sqrt(q.shape[-1]), options)


def op_call(q, k, v, **kw):
    """flex_attention operator called directly: on CPU the only way to run a dense backward."""
    return HOP_MODULE.flex_attention(*op_args(q, k, v, **kw))


def run_cli(capsys, *args):
    """``fusionguard report ARGS`` in-process: (exit status, stdout, stderr)."""
    from fusionguard import cli

    rc = cli.main(["report", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def fresh_hf_wrapper():
    """Forget transformers' singleton torch.compile(flex_attention) and Dynamo's caches."""
    from transformers.integrations import flex_attention as hf_flex

    torch._dynamo.reset()
    hf_flex.WrappedFlexAttention._instance = None
    hf_flex.WrappedFlexAttention._is_flex_compiled = False
    hf_flex.WrappedFlexAttention._compiled_flex_attention = None


def read_jsonl(path):
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


@pytest.fixture
def guard(tmp_path, monkeypatch):
    """``guard(strict=...)`` enables fusionguard with a log in tmp_path; always cleaned up."""
    log = tmp_path / "fg.jsonl"

    def _enable(strict=None, **kw):
        kw.setdefault("log_path", str(log))
        if strict is not None:  # (named only when given: strict and mode named together must agree)
            kw["strict"] = strict
        fusionguard.enable(**kw)
        return log

    _enable.log = log
    yield _enable
    fusionguard.disable()
    _testing.reset_for_tests()


# --- What this torch release lacks: tests skip by feature, never by version number ---------------


def _lacks_rescue():
    try:
        torch_internals.setup_compilation_env_home()
    except torch_internals.Unavailable as exc:
        return str(exc)
    return None


def _lacks_debug_flag():
    if torch_internals.has_debug_flag():
        return None
    return f"torch {torch_internals.torch_version()} has no {PUBLIC.__name__}._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG flag (added in 2.9)"


def _lacks_graph_text():
    cls = torch_internals.compiled_fx_graph()
    fields = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    if fields & {"inductor_post_grad_graph_str", "runnable_graph_str"}:
        return None
    return (
        f"torch {torch_internals.torch_version()}'s CompiledFxGraph keeps no graph text (added in 2.8): a graph "
        "compiled while fusionguard was off cannot be identified"
    )


def _lacks_pressure():
    try:
        torch_internals.flex_trace_method()
    except torch_internals.Unavailable as exc:
        return str(exc)
    return None


def _lacks_context_parallel():
    try:
        torch_internals.context_parallel_flex()
    except torch_internals.Unavailable as exc:  # (a LookupError for a partial find: the test fails, as it should)
        return str(exc)
    return None


FEATURES = {
    "rescue": _lacks_rescue,
    "debug_flag": _lacks_debug_flag,
    "graph_text": _lacks_graph_text,
    "pressure": _lacks_pressure,
    "context_parallel": _lacks_context_parallel,
}


def lacks(feature):
    """Why this torch release cannot run ``feature`` (a sentence naming it), or None."""
    return FEATURES[feature]()


def needs(*features):
    """``@needs("rescue")``: skip, naming the missing feature, where this release lacks it. The
    collection hook below marks these tests ``needs`` (``pytest -m needs`` selects them)."""
    missing = [why for why in (lacks(f) for f in features) if why]
    return pytest.mark.skipif(bool(missing), reason="; ".join(missing) or "-", needs=features)  # (skipif reads condition and reason only)


def recompile_limit(n):
    """``{option: n}`` for Dynamo's per-frame recompile limit, under this release's name."""
    return {torch_internals.recompile_limit_option(): n}


@pytest.fixture
def dynamo_config():
    """``dynamo_config(recompile_limit=1)``: torch._dynamo.config.patch, undone after the test
    (``recompile_limit`` is ``cache_size_limit`` on releases before 2.7)."""
    stack = contextlib.ExitStack()

    def patch(**values):
        if "recompile_limit" in values:
            values.update(recompile_limit(values.pop("recompile_limit")))
        stack.enter_context(torch._dynamo.config.patch(**values))

    yield patch
    stack.close()


@pytest.fixture
def dynamo_silenced():
    """Dynamo's logs silenced as a host may do (``set_logs(dynamo=logging.ERROR)``), undone after."""
    import logging

    torch._logging.set_logs(dynamo=logging.ERROR)
    yield
    torch._logging.set_logs()


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # (reset() keeps them: an earlier test's graph breaks would read as this one's)
    yield
    torch._dynamo.reset()


def flex_events(kind="flex_call"):
    return [e for e in fusionguard.events() if e["event"] == kind]


@pytest.fixture
def math_spy(monkeypatch):
    """Counts real executions of the dense score-matrix math (``_math_attention_inner``, used by
    both ``sdpa_dense`` and ``sdpa_dense_backward``).

    A spy, not a mock: it calls PyTorch's own function and counts."""
    calls = []
    original = HOP_MODULE._math_attention_inner

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(HOP_MODULE, "_math_attention_inner", spy)
    return calls


ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PYTHONPATH", str(ROOT))

import forkserver  # noqa: E402  (its server's environment is this one, before any test's monkeypatch)

#: Installed pytest plugins that the tests' inner sessions do not use (no hypothesis test; anyio only
#: where a test says so): each imports its package on every session start (hypothesis's: 77 modules at
#: the terminal summary) and pytest rewrites the asserts of every module of a plugin's distribution,
#: about 2 CPU s a session. Inner sessions pass ``-p no:NAME`` for them (xdist's workers inherit it).
UNUSED_PLUGINS = ("hypothesispytest", "anyio")


def plugins_off(names=UNUSED_PLUGINS) -> tuple:
    """``-p no:NAME`` for each plugin name: arguments of an inner pytest session."""
    return tuple(arg for name in names for arg in ("-p", f"no:{name}"))


def in_own_process(test):
    """Run ``test`` in a child pytest process (forked from tests/forkserver.py): it leaves process-wide PyTorch state behind that
    later tests must not inherit (torch 2.7 runs flex_attention's internal compile uncompiled for
    the rest of the process after one call with Dynamo disabled). The child must report a pass."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("FUSIONGUARD_TEST_CHILD"):
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
        node = re.sub(r"@[\w.-]+$", "", node)  # (xdist's --dist loadgroup suffixes the id with its group)
        env = dict(os.environ, FUSIONGUARD_TEST_CHILD="1")
        # one test, no workers, in a grandchild of tests/forkserver.py: a process with only torch imported
        # (as `python -m pytest` in a fresh interpreter would have, without its start)
        main = "import sys, pytest; sys.exit(pytest.console_main())"
        cmd = [sys.executable, "-c", main, "-q", "-p", "no:cacheprovider", *plugins_off(), "-n0", node]
        out = forkserver.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        passed = any(line.startswith("1 passed") for line in out.stdout.splitlines())  # not skipped
        assert out.returncode == 0 and passed, out.stdout[-4000:] + out.stderr[-2000:]

    return run


def run_forked(pytester, *args, unused=UNUSED_PLUGINS):
    """``pytester.runpytest_subprocess(*args)`` with the inner session forked from tests/forkserver.py:
    a process of its own with only torch imported (no fusionguard, no outer pytest state), without a
    fresh interpreter's 3.5 CPU s start. The same arguments, cwd and environment as pytester's, and
    the ``unused`` plugins off."""

    def popen(cmdargs, stdout, stderr, stdin=None, **kw):
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
        proc = forkserver.popen(cmdargs, env=env, cwd=os.getcwd(), stdin=subprocess.PIPE, stdout=stdout, stderr=stderr)
        proc.stdin.close()
        return proc

    main = (sys.executable, "-c", "import sys, pytest; sys.exit(pytest.console_main())")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pytester, "_getpytestargs", lambda: main + plugins_off(unused))
        mp.setattr(pytester, "popen", popen)
        return pytester.runpytest_subprocess(*args)


def child_env(**extra):
    """The environment for a child Python process of a test: this checkout first on PYTHONPATH,
    and no FUSIONGUARD / FUSIONGUARD_LOG of the outer shell (each test says what it wants)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for name in ("FUSIONGUARD_LOG", "FUSIONGUARD"):
        env.pop(name, None)
    env.update(extra)
    return env


class Lines(logging.Handler):
    """What fusionguard's logger said (pytest runs with -p no:logging: no caplog)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def fg_records():
    """The lines logged through ``logging.getLogger("fusionguard")`` during the test."""
    logger = logging.getLogger("fusionguard")
    handler = Lines()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


# --- In parallel (setup.cfg: -n auto --dist loadgroup) ------------------------------------------


@pytest.hookimpl(hookwrapper=True)  # (around xdist's own hook, which reads the groups)
def pytest_collection_modifyitems(config, items):
    """Tests that share a module- or class-scoped fixture run on one xdist worker (spread over
    two, each worker would build it: test_crash.py's torch subprocesses, test_hf.py's compiled
    models); the GPU tests run on one worker, one after the other, as they would alone."""
    _mark_groups(items)
    yield
    if getattr(config.option, "loadgroup", False):  # (an xdist worker under --dist loadgroup)
        _suffix_group_ids(items)


def _suffix_group_ids(items):
    """xdist's loadgroup scheduler reads an item's group from its node id (``ID@GROUP``), which
    xdist's worker writes into ``item._nodeid``; pytest 9 keeps the id in ``item._id``, so the
    write is lost and every group is spread over the workers (pytest-dev/pytest-xdist#1386: each
    worker built test_hf.py's compiled models, test_crash.py's runs, ...). Written here where
    xdist's write did not take; an id that cannot be written is an error, not a silent spread."""
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(groups)
        if not groups or item.nodeid.endswith(suffix):
            continue
        item._id = type(item._id).parse(item.nodeid + suffix)
        assert item.nodeid.endswith(suffix), item.nodeid


def _mark_groups(items):
    for item in items:
        features = [f for m in item.iter_markers("skipif") for f in m.kwargs.get("needs", ())]
        if features:
            item.add_marker(pytest.mark.needs(*features))
        if "gpu" in item.path.parts[-2:-1]:
            item.add_marker(pytest.mark.xdist_group("gpu"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        for name in info.names_closure if info else ():
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope in ("module", "class", "package"):
                item.add_marker(pytest.mark.xdist_group(item.path.name))
                break
