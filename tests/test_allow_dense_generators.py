"""``allow_dense()`` opened inside a generator (issue #32 point 2): a generator that user code
iterates is allowed only while its own code runs, never the consumer's code between its yields
(sync and async generators). Generators driven as context managers keep the block open for the
code inside the ``with`` (``contextlib``, pytest fixtures, async yield fixtures, pluggy
hookwrappers). Real strict mode, real dense calls (CPU, inference), real inner pytest sessions.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from conftest import flex_events, qkv, run_forked
from torch.nn.attention.flex_attention import flex_attention

import fusionguard

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
pytest_plugins = ["pytester"]


def dense():
    q, k, v = qkv()
    with torch.no_grad():
        return flex_attention(q, k, v)


def attempt(outcomes, name):
    try:
        dense()
        outcomes.append((name, "ran"))
    except fusionguard.DenseFallbackError:
        outcomes.append((name, "blocked"))


def test_a_generator_s_block_does_not_cover_the_loop_that_consumes_it(guard, math_spy):
    guard(strict=True)
    outcomes = []

    def reference_batches():
        with fusionguard.allow_dense():
            for _ in range(2):
                yield dense()  # the generator's own call: allowed

    for _ref in reference_batches():
        attempt(outcomes, "consumer")  # between yields: the block must not cover this
    attempt(outcomes, "after")
    assert outcomes == [("consumer", "blocked")] * 2 + [("after", "blocked")]
    assert len(math_spy) == 2  # the generator's own two calls
    assert [e["action"] for e in flex_events()] == ["allow", "raise", "allow", "raise", "raise"]


def test_next_and_yield_from_follow_the_same_rule(guard, math_spy):
    guard(strict=True)
    outcomes = []

    def inner():
        with fusionguard.allow_dense():
            attempt(outcomes, "inner")
            yield 1
            attempt(outcomes, "inner again")
            yield 2

    def outer():
        yield from inner()

    gen = outer()
    next(gen)
    attempt(outcomes, "consumer")
    next(gen)
    attempt(outcomes, "consumer again")
    gen.close()
    assert outcomes == [("inner", "ran"), ("consumer", "blocked"), ("inner again", "ran"), ("consumer again", "blocked")]


def test_a_contextmanager_opened_inside_an_iterated_generator_covers_only_that_generator(guard, math_spy):
    """The block is opened by a context manager, itself entered by a generator the user
    iterates: the generator is what the block belongs to."""
    guard(strict=True)
    outcomes = []

    @contextlib.contextmanager
    def reference_mode():
        with fusionguard.allow_dense():
            yield

    def batches():
        with reference_mode():
            attempt(outcomes, "generator")
            yield

    for _ in batches():
        attempt(outcomes, "consumer")
    assert outcomes == [("generator", "ran"), ("consumer", "blocked")]


def test_the_consumer_s_own_outer_block_still_allows(guard, math_spy):
    guard(strict=True)
    outcomes = []

    def gen():
        with fusionguard.allow_dense():
            yield

    with fusionguard.allow_dense():
        for _ in gen():
            attempt(outcomes, "consumer")
    attempt(outcomes, "after")
    assert outcomes == [("consumer", "ran"), ("after", "blocked")]


def test_an_async_generator_s_block_does_not_cover_the_async_for_body(guard, math_spy):
    guard(strict=True)
    outcomes = []

    async def reference_batches():
        with fusionguard.allow_dense():
            for _ in range(2):
                attempt(outcomes, "agen")
                await asyncio.sleep(0)
                yield

    async def main():
        async for _ in reference_batches():
            attempt(outcomes, "consumer")
        agen = reference_batches()
        await agen.__anext__()  # an explicit await of the user's: the same rule
        attempt(outcomes, "awaited")
        await agen.aclose()

    asyncio.run(main())
    assert outcomes == [("agen", "ran"), ("consumer", "blocked")] * 2 + [("agen", "ran"), ("awaited", "blocked")]


def test_context_managers_keep_today_s_rule(guard, math_spy):
    """``contextlib`` managers (sync, async, an ExitStack): the block covers the ``with`` body."""
    guard(strict=True)
    outcomes = []

    @contextlib.contextmanager
    def reference_mode():
        with fusionguard.allow_dense():
            yield

    @contextlib.asynccontextmanager
    async def async_reference_mode():
        with fusionguard.allow_dense():
            yield

    with reference_mode():
        attempt(outcomes, "with")
    with contextlib.ExitStack() as stack:
        stack.enter_context(fusionguard.allow_dense())
        attempt(outcomes, "exit stack")

    async def main():
        async with async_reference_mode():
            attempt(outcomes, "async with")

    asyncio.run(main())
    attempt(outcomes, "after")
    assert outcomes == [("with", "ran"), ("exit stack", "ran"), ("async with", "ran"), ("after", "blocked")]


FIXTURE_TESTS = """
import contextlib

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import fusionguard


def attend():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with torch.no_grad():
        return flex_attention(q, k, v)


@pytest.fixture
def reference():
    with fusionguard.allow_dense():
        yield


@pytest.fixture
async def async_reference():
    with fusionguard.allow_dense():
        yield


def test_sync_fixture(reference):
    attend()


@pytest.mark.anyio
async def test_async_yield_fixture(async_reference):
    attend()


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.fusionguard_allow_dense
def test_marker():
    attend()


def test_blocked():
    attend()
"""


def test_pytest_fixtures_and_the_marker_keep_today_s_rule(pytester):
    """A yield fixture (and an async one, anyio's runner) opening the block covers the test;
    the plugin's marker (a pluggy hookwrapper) too; a test with neither is blocked."""
    pytest.importorskip("anyio")
    pytester.makepyfile(test_inner=FIXTURE_TESTS)
    result = run_forked(
        pytester, "-p", "fusionguard.pytest_plugin", "--fusionguard=strict", "-p", "no:cacheprovider", unused=["hypothesispytest"]
    )
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*FAILED test_inner.py::test_blocked*"])
