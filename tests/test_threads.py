"""Many threads, one log: thousands of concurrent events and real dense flex_attention calls.

The seed's pattern (GPU groups driven from threads of one process) on CPU: 8 threads each emit
volume events through fusionguard's own log and run eager flex_attention in strict mode, half of
them inside ``allow_dense()``. The log must lose nothing, tear nothing, keep each thread's order,
name the right thread, and ``allow_dense()`` must not leak from one thread to another.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict

import pytest
import torch
from conftest import qkv
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.core import state as _state

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

THREADS = 8
EVENTS_PER_THREAD = 750  # 6000 volume events in all
FLEX_PER_THREAD = 3
BIG = 9000  # every 50th event carries a payload larger than a pipe buffer (4096)


def test_thousands_of_events_from_eight_threads(guard):
    q0, k0, v0 = qkv()
    with torch.no_grad():
        flex_attention(q0, k0, v0)  # warm PyTorch's own eager wrapper up before the guard is on
    log = guard(strict=True, max_events=100_000, keep_all=True)  # every allowed call logged, not sampled
    start = threading.Barrier(THREADS)
    failures = []
    raised = {}
    verdicts = defaultdict(list)  # the DenseFallbackError.event each thread got

    def work(index: int) -> None:
        name = threading.current_thread().name
        allowed = index % 2 == 0
        q, k, v = qkv(L=16, seed=index)
        blocked = 0
        try:
            start.wait(timeout=30)
            for i in range(EVENTS_PER_THREAD):
                pad = "x" * BIG if i % 50 == 0 else ""
                _state.STATE.log.emit("info", "stress", i=i, who=name, pad=pad)
                if i % (EVENTS_PER_THREAD // FLEX_PER_THREAD) == 0:
                    with torch.no_grad():
                        if allowed:
                            with fusionguard.allow_dense():
                                flex_attention(q, k, v)
                        else:
                            try:
                                flex_attention(q, k, v)
                            except fusionguard.DenseFallbackError as err:
                                blocked += 1
                                verdicts[name].append(err.event)
        except BaseException as exc:  # reported below, in the test's thread
            failures.append((name, repr(exc)))
        raised[name] = blocked

    threads = [threading.Thread(target=work, args=(n,), name=f"fg-stress-{n}") for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert failures == []

    # the file: every line one complete JSON object
    raw = log.read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.decode("utf-8").split("\n")[:-1]
    events = [json.loads(line) for line in lines]  # raises on a torn or interleaved line
    kinds = defaultdict(int)
    for e in events:
        kinds[e["event"]] += 1
    assert kinds["internal_error"] == 0, [e for e in events if e["event"] == "internal_error"]
    assert kinds["header"] == 1
    assert kinds["stress"] == THREADS * EVENTS_PER_THREAD
    assert kinds["flex_call"] == THREADS * FLEX_PER_THREAD
    assert len(events) == sum(kinds.values())

    # nothing lost: seq numbers unique, without gaps, and the same set as in memory
    seqs = [e["seq"] for e in events]
    assert len(set(seqs)) == len(seqs)
    assert sorted(seqs) == list(range(1, len(seqs) + 1))
    assert sorted(e["seq"] for e in fusionguard.events()) == sorted(seqs)

    by_thread = defaultdict(list)
    for e in events:
        by_thread[e["thread"]].append(e)
    assert sorted(by_thread) == sorted(["MainThread"] + [t.name for t in threads])
    for t in threads:
        mine = by_thread[t.name]
        # per-thread order: file order is the thread's emission order, seq increases with it
        stress = [e for e in mine if e["event"] == "stress"]
        assert [e["i"] for e in stress] == list(range(EVENTS_PER_THREAD))
        assert all(e["who"] == t.name for e in stress), "thread field names the emitting thread"
        assert all(len(e["pad"]) == (BIG if e["i"] % 50 == 0 else 0) for e in stress)
        mine_seqs = [e["seq"] for e in mine]
        assert mine_seqs == sorted(mine_seqs)
        # the dense calls: the right thread, device, call site, and allow_dense() per thread only
        calls = [e for e in mine if e["event"] == "flex_call"]
        index = int(t.name.rsplit("-", 1)[1])
        expected = "allow" if index % 2 == 0 else "raise"
        assert [c["action"] for c in calls] == [expected] * FLEX_PER_THREAD, t.name
        assert raised[t.name] == (FLEX_PER_THREAD if expected == "raise" else 0)
        # the error's event is this thread's own record (not another thread's latest event)
        got = verdicts[t.name]
        assert [(v.get("thread"), v.get("action")) for v in got] == [(t.name, "raise")] * len(got)
        assert [v.get("seq") for v in got] == ([c["seq"] for c in calls] if got else [])
        for c in calls:
            assert c["device"] == "cpu" and c["q_shape"] == [1, 2, 16, 8] and c["pid"] == events[0]["pid"]
            assert c["call_site"]["file"] == __file__ and c["call_site"]["function"] == "work"
