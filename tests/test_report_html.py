"""``fusionguard report --html`` (#26): rendered by a real headless Chromium; the page's numbers
are ``--format json``'s, its chart's are ``--plot``'s, a log's markup stays text, hostile logs stay
within the stated size and time bounds."""

from __future__ import annotations

import html.parser
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from fusionguard.report import chart
from fusionguard.report import html as report_html
from fusionguard.report.build import build

HOSTILE = [
    "<script>alert(1)</script>",
    "</style><img src=x onerror=alert(2)>",
    "layers.1\x1b[31mred\x07\u202eevil",
    "lone\ud800surrogate",
    "layers.$\\notacommand{$x^",  # mathtext, were it parsed: --plot draws it as text
]
SITE = {"file": "train.py", "line": 7, "function": "attention"}


def ev(kind, seq, pid=100, rank=0, **fields):
    return {
        "event": kind,
        "level": "info",
        "ts": 1_800_000_000.0 + seq,
        "seq": seq,
        "pid": pid,
        "rank": rank,
        "thread": "MainThread",
        **fields,
    }


def header(pid, rank, host="node1"):
    cuda = {"available": True, "count": 2, "version": "13.0", "devices": ["NVIDIA H200", "NVIDIA H200"]}
    return ev(
        "header",
        1,
        pid=pid,
        rank=rank,
        schema=1,
        fusionguard="0.1.0",
        torch="2.13.0",
        triton="3.6.0",
        python="3.11.7",
        hostname=host,
        cuda=cuda,
        world_size=2,
        local_rank=rank,
    )


def write(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:  # json.dumps escapes the lone surrogate as \ud800, as a log may hold it
        for e in events:
            fh.write(json.dumps(e) + "\n")
    return path


def crash_run(tmp_path):
    """Two ranks: rank 0 fused, then stopped without a shutdown (killed); rank 1 ran layers.1
    dense and crashed with an out-of-memory error. Layer names and messages carry markup."""
    r0 = [header(100, 0)]
    seq = 2
    for layer in ("layers.0", "layers.1", *HOSTILE):
        for phase, peak in (("forward", 2_000_000), ("backward", 5_000_000)):
            r0.append(ev("layer_memory", seq, layer=layer, phase=phase, path="fused", alloc_delta=1000, peak_delta=peak))
            seq += 1
    r0.append(ev("flex_compile", seq, layer="layers.0", phase="forward", path="fused", template="triton"))
    r1 = [header(200, 1, host="node2")]
    seq = 2
    for layer in ("layers.0", HOSTILE[0]):
        r1.append(
            ev("layer_memory", seq, pid=200, rank=1, layer=layer, phase="forward", path="fused", alloc_delta=10, peak_delta=1_500_000)
        )
        seq += 1
    for phase, size in (("forward", 2_147_483_648), ("backward", 2_147_483_648)):
        r1.append(
            dict(
                ev(
                    "flex_call",
                    seq,
                    pid=200,
                    rank=1,
                    layer="layers.1",
                    phase=phase,
                    path="dense",
                    cause="recompile_limit",
                    call_site=SITE,
                    scores_bytes=size,
                    action="warn",
                ),
                level="warning",
            )
        )
        r1.append(
            ev(
                "layer_memory",
                seq + 1,
                pid=200,
                rank=1,
                layer="layers.1",
                phase=phase,
                path="dense",
                alloc_delta=5_000_000,
                peak_delta=size + 3 * 10**8,
            )
        )
        seq += 2
    r1.append(
        dict(
            ev(
                "flex_call",
                seq,
                pid=200,
                rank=1,
                layer=HOSTILE[1],
                phase="forward",
                path="dense",
                cause="<b>graph_break</b>",
                call_site={"file": "</td><script>x()</script>", "line": 1, "function": "f"},
                scores_bytes=10**6,
                action="raise",
            ),
            level="warning",
        )
    )
    r1.append(
        dict(
            ev(
                "crash",
                seq + 1,
                pid=200,
                rank=1,
                exc_type="torch.OutOfMemoryError",
                where="sys.excepthook",
                message="CUDA out of memory. Tried to allocate 2.15 GiB\n<script>alert(3)</script>",
                frames=["train.py:7 in attention", "</pre><script>alert(4)</script>"],
                cuda={"allocated": 130 * 10**9, "reserved": 138 * 10**9, "peak": 139 * 10**9},
            ),
            level="error",
        )
    )
    write(tmp_path / "run" / "fusionguard.rank0.jsonl", r0)
    write(tmp_path / "run" / "fusionguard.rank1.jsonl", r1)
    return tmp_path / "run"


# -- a light DOM of the page (the browser's, via --dump-dom) ----------------------------------------


class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children, self.parts = tag, dict(attrs), parent, [], []

    def text(self):
        return "".join(p if isinstance(p, str) else p.text() for p in self.parts)

    def all(self, tag=None, **attrs):
        for c in self.children:
            if (tag is None or c.tag == tag) and all(c.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items()):
                yield c
            yield from c.all(tag, **attrs)

    def has_class(self, name):
        return name in (self.attrs.get("class") or "").split()


class DOM(html.parser.HTMLParser):
    VOID = {"br", "meta", "img", "hr", "input", "link", "source", "area", "base", "col", "embed", "wbr"}

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Node("#root", {})
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.cur)
        self.cur.children.append(node)
        self.cur.parts.append(node)
        if tag not in self.VOID and not tag.endswith("/"):
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        node = Node(tag, attrs, self.cur)
        self.cur.children.append(node)
        self.cur.parts.append(node)

    def handle_endtag(self, tag):
        n = self.cur
        while n is not self.root and n.tag != tag:
            n = n.parent
        if n is not self.root:
            self.cur = n.parent

    def handle_data(self, data):
        self.cur.parts.append(data)


# -- the browser ------------------------------------------------------------------------------------


def chromium():
    for name in (os.environ.get("FUSIONGUARD_CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


BROWSER = chromium()
_no_browser = pytest.mark.skipif(
    BROWSER is None, reason="no Chromium on this machine (CI installs Debian's chromium: apt-get install -y chromium)"
)


def needs_browser(test):
    """Skipped without Chromium; marked ``browser`` (``pytest -m browser`` runs only these)."""
    return pytest.mark.browser(_no_browser(test))


def browse(page: Path, tmp_path: Path, *extra: str, timeout: int = 180):
    """Chromium, headless, on ``page``: (the DOM after loading, the console messages)."""
    profile = tmp_path / f"chromium-profile-{time.monotonic_ns()}"
    cmd = [
        BROWSER,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        *extra,
        page.resolve().as_uri(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    return out.stdout, console


def rendered(tmp_path, capsys, run):
    """(the page's DOM as Chromium built it, its console messages, the JSON report)."""
    page = tmp_path / "report.html"
    rc, _, err = run_cli(capsys, run, "--html", page)
    assert rc == 0 and "HTML report written" in err, err
    rc, out, err = run_cli(capsys, run, "--format", "json")
    assert rc == 0, err
    dom, console = browse(page, tmp_path, "--dump-dom")
    assert "</html>" in dom, dom[-2000:]
    return DOM(dom).root, console, json.loads(out)


@needs_browser
def test_console_messages_are_seen_at_all(tmp_path):
    """The check below is live: a page with a script error shows it (the report page has no script)."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><p>x</p><script>console.error('visible'); no_such_function();</script>")
    _, console = browse(bad, tmp_path, "--dump-dom")
    assert any("visible" in line for line in console) and any("no_such_function" in line for line in console), console


@needs_browser
def test_page_renders_with_the_json_numbers_and_markup_as_text(tmp_path, capsys):
    root, console, rep = rendered(tmp_path, capsys, crash_run(tmp_path))
    assert console == []
    # no element came from a log: one style (ours), no script, image, iframe or form anywhere
    assert [n.tag for n in root.all() if n.tag in ("script", "img", "iframe", "form", "object", "embed")] == []
    assert len(list(root.all("style"))) == 1

    table = next(root.all("table", id="layers"))
    rows = [tr for tr in table.all("tr") if tr.has_class("row")]
    assert len(rows) == len(rep["rows"]) == int(table.attrs["data-rows"])
    for tr, row in zip(rows, rep["rows"]):
        cells = list(tr.all("td"))
        assert cells[1].text() == row["phase"]
        values = {td.attrs["data-col"]: td for td in cells if "data-col" in td.attrs}
        for col in ("dense", "allowed", "blocked", "fused", "compiles", "inlined"):
            assert int(values[col].attrs["data-value"]) == row[col], (row["layer"], col)
            assert values[col].text() == f"{row[col]:,}"
        for col in ("peak_delta_max", "alloc_delta_max", "scores_bytes_max"):
            got = values[col].attrs["data-value"]
            assert (None if got == "" else float(got)) == row[col], (row["layer"], col)
    layers = [tr.attrs["data-layer"] for tr in rows]
    texts = [next(tr.all("td")).text() for tr in rows]
    assert layers == texts
    # injected markup is text, shown as written; control characters visible
    assert "<script>alert(1)</script>" in texts and "</style><img src=x onerror=alert(2)>" in texts
    assert "layers.1\\x1b[31mred\\x07\\u202eevil" in texts
    assert not any("surrogate" in t for t in texts)  # (the reader skips a line holding a lone surrogate: a corrupt line)

    page = root.text()
    assert "crash with torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.15 GiB on rank 1" in page
    assert "<script>alert(3)</script>" in page and "</pre><script>alert(4)</script>" in page
    assert next(root.all("header", id="verdict")).attrs["data-ending"] == "crash"
    ranks = next(root.all("table", id="ranks"))
    assert [th.text() for th in ranks.all("th")][2:] == ["rank 0", "rank 1"]
    assert {e.text() for e in next(root.all("table", id="first-events")).all("b")} >= {"header", "flex_call", "crash", "layer_memory"}

    # the chart: one bar per row with a memory figure, its bytes the row's
    bars = [r for r in root.all("rect") if r.has_class("bar")]
    expect = {(b["index"], b["phase"]): b["value"] for b in chart.memory_bars(rep)}
    assert {(int(b.attrs["data-index"]), b.attrs["data-phase"]): float(b.attrs["data-bytes"]) for b in bars} == expect
    by = {(r["layer"], r["phase"]): r["peak_delta_max"] for r in rep["rows"]}
    names = chart.layers(rep["rows"])
    assert all(by[(names[i], p)] == v for (i, p), v in expect.items())


def test_the_plot_draws_the_html_charts_numbers(tmp_path, capsys):
    """``--plot``'s bars (read back from the matplotlib figure) are the HTML chart's bars."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    plot_module = sys.modules["fusionguard.report.plot"]
    rep = build([str(crash_run(tmp_path))])
    page = DOM(report_html.render_html(rep)).root
    svg = {
        (int(b.attrs["data-index"]), b.attrs["data-phase"]): float(b.attrs["data-bytes"]) for b in page.all("rect") if b.has_class("bar")
    }
    fig, note = plot_module.figure(rep)
    try:
        unit, scale = chart.unit(max(svg.values()))
        drawn = {tuple(p.get_gid().split("|")): p.get_height() * scale for p in fig.axes[0].patches if p.get_gid()}
    finally:
        plt.close(fig)
    assert note == ""
    assert {(int(i), ph): v for (i, ph), v in drawn.items()} == pytest.approx(svg)
    # counts mode (no memory figures): the same bars, as calls
    rep["rows"] = [dict(r, peak_delta_max=None, scores_bytes_max=None) for r in rep["rows"]]
    page = DOM(report_html.render_html(rep)).root
    svg_calls = {
        (int(b.attrs["data-index"]), b.attrs["data-phase"], b.attrs["data-what"]): int(b.attrs["data-calls"])
        for b in page.all("rect")
        if b.has_class("bar")
    }
    fig, note = plot_module.figure(rep)
    try:
        drawn = {tuple(p.get_gid().split("|")): p.get_height() for p in fig.axes[0].patches if p.get_gid()}
    finally:
        plt.close(fig)
    assert "call" in note and svg_calls and {(int(i), ph, w): v for (i, ph, w), v in drawn.items()} == svg_calls


def test_the_plot_of_many_layers_escapes_what_it_draws_and_counts_the_rest(tmp_path):
    """``--plot`` escapes the rows of the layers it draws and only the names and numbers of the
    others: the same figure as with the whole report escaped (texts, bars, the note on layers not
    drawn), where the one memory figure is in a row it does not draw (so the chart is a memory one)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from fusionguard.report.render import escaped

    plot_module = sys.modules["fusionguard.report.plot"]
    rep = build([str(crash_run(tmp_path))])
    base = rep["rows"][0]
    rows = []
    for i in range(chart.MAX_LAYERS + 30):
        for phase in ("forward", "backward"):
            rows.append(
                dict(
                    base,
                    layer=f"L\x1b[31m<b>{i}",
                    phase=phase,
                    dense=i % 3,
                    peak_delta_max=None,
                    scores_bytes_max=None,
                    causes={"eager\x07": 1} if i % 3 else {},
                )
            )
    rows[-1]["peak_delta_max"] = 5e6  # (beyond the drawn layers)
    rows[0]["scores_bytes_max"] = 2e6
    rows[-3]["layer"], rows[-5]["layer"] = None, 7  # (a hand-made report's layers, not drawn: as before, no error)

    def picture(fig):
        texts = sorted(t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text")) if t.get_text())
        bars = sorted((p.get_gid(), round(p.get_height(), 9)) for p in fig.axes[0].patches if p.get_gid())
        return texts, bars

    fig, note = plot_module.figure(rep := dict(rep, rows=rows))
    with plt.rc_context({"text.parse_math": False}):
        old = plot_module._plot_memory(escaped(rep))
    try:
        assert picture(fig) == picture(old)
        assert any("+32 more layers not drawn" in t for t in picture(fig)[0])
        assert "\x1b" not in "".join(picture(fig)[0]) and any("\\x1b" in t for t in picture(fig)[0])
    finally:
        plt.close(fig)
        plt.close(old)
    assert "dense bars show the score-matrix size" not in note  # (a measured peak, though not drawn)


def test_a_lone_surrogate_is_shown_escaped_and_the_page_encodes(tmp_path):
    """A report dict holding a lone surrogate (put in by hand: the reader skips such lines)."""
    rep = build([str(crash_run(tmp_path))])
    rep["rows"][0]["layer"] = "lone\ud800surrogate<b>"
    page = report_html.render_html(rep)
    page.encode("utf-8")  # would raise on a lone surrogate
    texts = [next(tr.all("td")).text() for tr in DOM(page).root.all("tr") if tr.has_class("row")]
    assert texts[0] == "lone\\ud800surrogate<b>"


def test_hostile_strings_in_the_plot_are_drawn_as_text(tmp_path, capsys):
    """The same hostile names through ``--plot``: a PNG is written, no mathtext or markup error."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    rc, _, err = run_cli(capsys, crash_run(tmp_path), "--plot", out)
    assert rc == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def hostile_flood(path: Path, n: int = 100_000):
    """``n`` events (the stated bound: 10^5), each with a new 300-character layer name of
    markup and control bytes, a new cause, across 300 ranks; one process per rank."""
    junk = ("<script>alert(1)</script></style>\x1b[2J\x00\u202e" * 10)[:300]
    events = []
    for i in range(n):
        rank = i % 300
        events.append(
            dict(
                ev(
                    "flex_call",
                    2 + i,
                    pid=1000 + rank,
                    rank=rank,
                    layer=f"{junk}{i}",
                    phase="forward" if i % 2 else "backward",
                    path="dense",
                    cause=f"{junk[:100]}{i % 50}",
                    call_site={"file": junk, "line": i, "function": junk},
                    scores_bytes=i * 1000,
                    action="warn",
                ),
                level="warning",
            )
        )
    write(path, events)
    return path


@pytest.mark.browser  # (in part: the rest runs without Chromium)
def test_hostile_flood_stays_within_the_stated_bounds(tmp_path, capsys):
    """10^5 hostile events: the page stays under MAX_PAGE_BYTES and renders (from the report
    dict) within 10 s on one shared CPU core; ``--plot`` draws its first ``chart.MAX_LAYERS``
    layers; a fresh Chromium loads the page with no console message."""
    log = hostile_flood(tmp_path / "flood.jsonl")
    rep = build([str(log)])
    t0 = time.perf_counter()
    page = report_html.render_html(rep)
    took = time.perf_counter() - t0
    size = len(page.encode("utf-8"))
    assert size < report_html.MAX_PAGE_BYTES, size
    assert took < 10, took
    assert "<script>" not in page and "</style>" not in page.split("</head>", 1)[1] and "\x1b" not in page and "\x00" not in page
    dom = DOM(page).root
    rows = [tr for tr in next(dom.all("table", id="layers")).all("tr") if tr.has_class("row")]
    assert len(rows) == report_html.MAX_TABLE_ROWS < len(rep["rows"])
    assert f"+{len(rep['rows']) - report_html.MAX_TABLE_ROWS:,} more layer/phase rows not shown" in dom.text()
    pytest.importorskip("matplotlib")
    t0 = time.perf_counter()
    rc, _, err = run_cli(capsys, log, "--format", "csv", "-o", tmp_path / "flood.csv", "--plot", tmp_path / "flood.png")
    assert rc == 0, err
    assert time.perf_counter() - t0 < 180 and (tmp_path / "flood.png").stat().st_size > 10_000
    if BROWSER is not None:
        path = tmp_path / "flood.html"
        path.write_text(page, encoding="utf-8")
        dom_text, console = browse(path, tmp_path, "--dump-dom")
        assert console == [] and dom_text.rstrip().endswith("</html>")
        assert [n.tag for n in DOM(dom_text).root.all() if n.tag in ("script", "img")] == []


def test_unwritable_html_path_is_a_usage_error(tmp_path, capsys):
    rc, _, err = run_cli(capsys, crash_run(tmp_path), "--html", tmp_path / "no" / "such" / "dir" / "r.html")
    assert rc == 2 and "cannot write --html" in err


ENDING_SCRIPT = """
import sys, warnings
import torch
import fusionguard
from torch.nn.attention.flex_attention import flex_attention
warnings.simplefilter("ignore")
fusionguard.enable(log_path=sys.argv[1])
q = torch.randn(1, 2, 16, 8)
flex_attention(q, q, q)
"""
ENDINGS = {
    "clean": ("", "clean: every process shut down (exit)"),
    "crash": (
        "raise RuntimeError('boom </style><script>x()</script>')",
        "crash with RuntimeError: boom </style><script>x()</script> on rank 0",
    ),
    "native": ("import faulthandler; faulthandler._sigsegv()", "native crash: native crash (SIGSEGV) on rank 0"),
    "stopped": (
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        "stopped without shutdown (rank 0): SIGKILL and the OOM killer leave the same log",
    ),
}


def test_the_banner_says_how_real_runs_ended(tmp_path, capsys):
    """Real processes: a clean exit, an uncaught exception, a real SIGSEGV, a SIGKILL."""
    import forkserver  # (processes of their own, not fresh interpreters: tests/forkserver.py)
    from conftest import child_env

    procs = {}
    for kind, (tail, _) in ENDINGS.items():
        log = tmp_path / kind / "fg.jsonl"
        log.parent.mkdir()
        cmd = [sys.executable, "-c", ENDING_SCRIPT + tail, str(log)]
        procs[kind] = (log, forkserver.popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for kind, (log, p) in procs.items():
        _, err = p.communicate(timeout=300)
        page = tmp_path / f"{kind}.html"
        rc, _, cli_err = run_cli(capsys, log, "--html", page)
        assert rc == 0, (kind, cli_err, err[-2000:])
        root = DOM(page.read_text(encoding="utf-8")).root
        banner = next(root.all("header", id="verdict"))
        assert banner.attrs["data-ending"] == kind, (kind, banner.text(), err[-2000:])
        assert ENDINGS[kind][1] in banner.text(), banner.text()
        assert banner.text().startswith("DENSE: 1 dense FlexAttention call")
        assert [n.tag for n in root.all() if n.tag in ("script", "img")] == []
        rc, out, _ = run_cli(capsys, log, "--format", "json")  # the real log's table: --format json's
        rows = [tr for tr in root.all("tr") if tr.has_class("row")]
        cells = [{td.attrs["data-col"]: td.attrs["data-value"] for td in tr.all("td") if "data-col" in td.attrs} for tr in rows]
        assert [(tr.attrs["data-layer"], int(c["dense"]), int(c["fused"]), int(c["blocked"])) for tr, c in zip(rows, cells)] == [
            (r["layer"], r["dense"], r["fused"], r["blocked"]) for r in json.loads(out)["rows"]
        ]


def findings_run(tmp_path):
    """A log with each of #25's findings: recompile pressure (a hostile function name), a model
    that never called FlexAttention, eager mask builds, a call the oom mode blocked."""
    site = {"file": "train.py", "line": 9, "function": "<script>alert(5)</script>"}
    return write(
        tmp_path / "findings.jsonl",
        [
            header(100, 0),
            ev(
                "recompile_pressure",
                2,
                file="train.py",
                line=9,
                function="<script>alert(5)</script>",
                compiles=4,
                limit=8,
                varies="q dim 2 varies",
                reason="tensor 'q' size mismatch at index 2. expected 2048, actual 1536",
                fix="mark the dim dynamic",
            ),
            ev("no_flex_calls", 3, model="</style>Llama", attn_implementation="sdpa"),
            {
                **ev("mask_build", 4, path="dense", shape=[1, 1, 4096, 4096], estimated_bytes=170_000_000, action="warn", call_site=site),
                "kind": "block_mask",
            },
            ev(
                "flex_call",
                5,
                layer="layers.0",
                phase="backward",
                path="dense",
                cause="eager_call",
                action="raise",
                allowed=False,
                scores_bytes=4_000_000_000,
                predicted_bytes=9_100_000_000,
                free_bytes=4_000_000_000,
                blocked_by="oom",
                call_site=site,
            ),
            ev("shutdown", 6, reason="exit"),
        ],
    )


@pytest.mark.browser  # (in part: the rest runs without Chromium)
def test_the_banner_shows_the_text_reports_findings_as_text(tmp_path, capsys):
    """#25's findings on the page (S2): the text report's own lines, escaped; checked in the page
    source here and, where a Chromium is installed, in the DOM it builds."""
    from fusionguard.report.render import notice_lines

    run = findings_run(tmp_path)
    rep = build([str(run)])
    lines = notice_lines(rep)
    assert lines[0].startswith("recompile pressure: 1 frame at 4 of 8 compiles (q dim 2 varies)")
    assert any(x.startswith("no FlexAttention: 1 watched model") for x in lines)
    assert any(x.startswith("DENSE MASKS: 1 eager mask build(s)") for x in lines)
    assert lines[-1].startswith("oom mode: 1 dense call(s) blocked, predicted not to fit (needed 9.10 GB, the device could give 4.00 GB")
    page = report_html.render_html(rep)
    assert "<script>alert(5)" not in page and "&lt;script&gt;alert(5)&lt;/script&gt;" in page and "</style>Llama" not in page
    if BROWSER is None:
        return
    path = tmp_path / "findings.html"
    path.write_text(page)
    dom, console = browse(path, tmp_path, "--dump-dom")
    assert console == []
    root = DOM(dom).root
    assert [n.tag for n in root.all() if n.tag in ("script", "img")] == []
    shown = [p.text() for p in next(root.all("div", id="notices")).all("p") if p.has_class("notice")]
    assert shown == lines  # the same words, markup as text
