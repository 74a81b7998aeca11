"""The fenced blocks of README.md and docs/*.md, their marks, the glue a reader would add, and the
real outputs the documented ones are compared with (shared by tests/test_docs.py on CPU and
tests/gpu/test_docs_cuda.py on CUDA).

Each fenced block is preceded by one HTML comment that says what it is (docs/internals.md,
"Documented blocks"):

    <!-- doc: run -->                   runs on CPU as written (Python in-process, shell line by line)
    <!-- doc: run setup=NAME -->        the same, after the hidden glue SETUPS[NAME] (a model, q, k, v, a log)
    <!-- doc: run parallel -->          a shell block whose lines are independent: run at once
    <!-- doc: gpu setup=NAME -->        needs a CUDA GPU: runs in tests/gpu/test_docs_cuda.py
    <!-- doc: fragment -->              not runnable alone (an elision, your own model, installs, a cluster)
    <!-- doc: text -->                  not code and not an output (a list of pins)
    <!-- doc: output -->                what the run block just before it prints
    <!-- doc: output of=NAME [part] [gpu] -->  what PRODUCERS[NAME] prints (``part``: a run of its lines)

Outputs are compared after ``normalise`` (paths, times, sizes, versions, pids, column padding);
``FUSIONGUARD_DOCS_UPDATE=1`` rewrites them in place from the real ones.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
KINDS = {"run", "gpu", "fragment", "text", "output"}
MARK = re.compile(r"^\s*<!--\s*doc:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
UPDATE = os.environ.get("FUSIONGUARD_DOCS_UPDATE") == "1"
SHARED: dict[str, Path] = {}  # what the producers made that some glue reuses (the quickstart's log)
SHOWN_ROOT = "/home/me/fusionguard"  # what an updated output shows for the checkout and the run's directory


@dataclass
class Block:
    file: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str | None  # the comment's text, None when there is none
    kind: str = ""
    args: dict[str, str] = field(default_factory=dict)
    flags: set[str] = field(default_factory=set)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def python(self) -> bool:
        return self.lang in ("python", "py")

    @property
    def shell(self) -> bool:
        return self.lang in ("bash", "sh", "shell", "console")


def parse_mark(text: str) -> tuple[str, dict[str, str], set[str]]:
    words = text.split()
    kind = words[0] if words else ""
    args = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    flags = {w for w in words[1:] if "=" not in w}
    return kind, args, flags


def blocks(files: list[str] | None = None) -> list[Block]:
    """Every fenced block of the documentation, with the mark on the line right before it."""
    out = []
    for name in files or DOC_FILES:
        lines = (ROOT / name).read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            indent, fence, lang = m.groups()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            body = "\n".join(line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : j])
            mk = MARK.match(lines[i - 1]) if i else None
            b = Block(name, i + 1, lang, body + "\n", mk.group(1) if mk else None)
            if b.mark is not None:
                b.kind, b.args, b.flags = parse_mark(b.mark)
            out.append(b)
            i = j + 1
    return out


# --- normalising outputs -----------------------------------------------------------------------

_RULES: list[tuple[str, str]] = [
    (r"\x1b\[[0-9;]*m", ""),  # colours
    (r"(?m)^[IWEDC]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ", "<glog> "),  # PyTorch's log prefix
    (r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?( UTC)?", "<time>"),  # times
    (r"(?<![\w.])/(?:[\w.@+~-]+/)+", ""),  # absolute directories
    (r"(fusionguard/[\w/]+\.py):\d+", r"\1:<n>"),  # fusionguard's own lines
    (r"\d[\d,]*(\.\d+)? ?(B|KB|MB|GB|TB|KiB|MiB|GiB)\b", "<size>"),  # sizes
    (r"\bpid[ =]?\d+", "pid<n>"),  # pids
    (r"\d+(\.\d+)+[\w+.-]*", "<v>"),  # versions, floats, durations
    (r"\btriton -", "triton <v>"),  # CPU builds: triton installed or not
    (r"(devices:\s+)[^:\s]+:", r"\1<host>:"),  # the host's name
    (r"(fusionguard report: .*?)\b\d[\d,]* events\b", r"\1<n> events"),  # a slow run's periodic counter flush adds one
    (r"-{3,}", "---"),  # table rules
    (r"[ \t]+", " "),  # column padding
]


def normalise(text: str) -> list[str]:
    for pattern, repl in _RULES:
        text = re.sub(pattern, repl, text)
    lines = [line.strip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def documented(block: Block) -> str:
    """The output part of an output block: without its ``$ command`` lines."""
    return "\n".join(line for line in block.text.splitlines() if not line.startswith("$ "))


def shown(real: str, *dirs: Path | str) -> str:
    """The real output as the docs show it: the checkout's and the run's directories as SHOWN_ROOT."""
    for d in sorted({str(d) for d in dirs}, key=len, reverse=True):
        real = real.replace(d, SHOWN_ROOT)
    return real.rstrip("\n")


def matches(block: Block, real: str) -> tuple[bool, str]:
    """Whether the documented output is the real one (normalised); a diff-like text when not."""
    doc, got = normalise(documented(block)), normalise(real)
    if "part" in block.flags:
        ok = any(got[i : i + len(doc)] == doc for i in range(len(got) - len(doc) + 1))
    else:
        ok = doc == got
    why = "" if ok else "documented (normalised):\n  " + "\n  ".join(doc) + "\nreal (normalised):\n  " + "\n  ".join(got)
    return ok, why


def update(block: Block, real: str) -> bool:
    """Rewrite the block's output in its file from ``real`` (already ``shown``); False if a part
    cannot be located."""
    new = real.strip("\n").splitlines()
    if "part" in block.flags:  # the real lines from the one most like the part's first line
        doc, got = normalise(documented(block)), normalise(real)
        if not doc or not got:
            return False
        score = [difflib.SequenceMatcher(None, doc[0], line).ratio() for line in got]
        start = score.index(max(score))
        new = new[start : start + len(doc)]
    commands = [line for line in block.text.splitlines() if line.startswith("$ ")]
    body = "\n".join(commands + new) + "\n"
    path = ROOT / block.file
    lines = path.read_text().splitlines(keepends=True)
    start = block.line  # index of the first body line (block.line is 1-based: the fence)
    end = start
    fence = lines[block.line - 1].strip()[:3]
    while not lines[end].strip().startswith(fence):
        end += 1
    lines[start:end] = [body]
    path.write_text("".join(lines))
    return True


# --- running blocks ----------------------------------------------------------------------------


@contextlib.contextmanager
def captured():
    """stdout and stderr of in-process code (fusionguard's stderr handler writes to the current one)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        yield buf


@contextlib.contextmanager
def cleaned():
    """Leave fusionguard, its logger, PyTorch's log settings and Dynamo as a block found them."""
    import torch  # (imported here: collecting the blocks needs no torch)

    import fusionguard
    from fusionguard import _testing

    logger = logging.getLogger("fusionguard")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    # torch._logging's names: a block's set_logs(modules={"fusionguard": ...}) made *before* enable()
    # registers "fusionguard" itself (any importable module name), and for good: enable() then finds
    # it torch's and disable() rightly leaves it. The next test in this process would inherit it.
    registry = torch._logging._internal.log_registry
    names = (dict(registry.log_alias_to_log_qnames), set(registry.child_log_qnames))
    try:
        yield
    finally:
        fusionguard.disable()
        _testing.reset_for_tests()
        if logger.handlers != saved[1]:
            torch._logging.set_logs()
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]
        registry.log_alias_to_log_qnames.clear()
        registry.log_alias_to_log_qnames.update(names[0])
        registry.child_log_qnames.clear()
        registry.child_log_qnames.update(names[1])


def run_python(source: str, name: str, ns: dict[str, Any], cwd: Path) -> str:
    """Exec a Python block in-process in ``cwd`` with the glue ``ns``; what it printed."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with captured() as buf:
            exec(compile(source, name, "exec"), ns)  # noqa: S102 (the documentation's own code)
        return buf.getvalue()
    finally:
        os.chdir(here)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for name in ("FUSIONGUARD_LOG", "FUSIONGUARD", "TORCH_LOGS"):
        env.pop(name, None)
    return env


def shell_lines(text: str) -> list[str]:
    joined = text.replace("\\\n", " ")
    return [line for line in (shlex.join(shlex.split(x, comments=True)) for x in joined.splitlines()) if line]


def run_shell(text: str, cwd: Path, parallel: bool = False) -> str:
    """Run a shell block line by line: ``fusionguard ...`` and ``pytest ...`` in-process (no new
    interpreter), anything else in a subprocess; ``parallel``: those subprocesses all at once (the
    block's lines are independent). Every command must exit 0."""
    out, procs = [], []
    for line in shell_lines(text):
        argv = shlex.split(line)
        if argv[0] in ("fusionguard", "pytest"):
            rc, text_out = in_process(argv, cwd)
        else:
            proc = subprocess.Popen(line, shell=True, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append((line, proc))
            if parallel:
                continue
            rc, text_out = proc.wait(timeout=300), proc.stdout.read()
            procs.pop()
        assert rc == 0, f"`{line}` exited {rc}:\n{text_out[-3000:]}"
        out.append(text_out)
    for line, proc in procs:
        rc, text_out = proc.wait(timeout=300), proc.stdout.read()
        assert rc == 0, f"`{line}` exited {rc}:\n{text_out[-3000:]}"
        out.append(text_out)
    return "".join(out)


def in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``fusionguard ARGS`` through ``fusionguard.cli.main``, ``pytest ARGS`` through
    ``pytest.main`` (a nested session, as pytester's in-process runs), in ``cwd``."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with captured() as buf:
            if argv[0] == "fusionguard":
                from fusionguard import cli  # (imported here: collecting the blocks needs no torch)

                rc = cli.main(argv[1:])
            else:
                import pytest  # (imported here: only a pytest block needs it)

                rc = int(pytest.main([*argv[1:], "-p", "no:cacheprovider"]))
    finally:
        os.chdir(here)
    return rc, buf.getvalue()


def run_script(path: Path, cwd: Path, argv: list[str] | None = None) -> str:
    """A script run in-process as ``__main__`` in ``cwd`` (no new interpreter, no second torch
    import); its stdout (stderr is dropped)."""
    here, saved_argv = os.getcwd(), sys.argv
    os.chdir(cwd)
    sys.argv = [str(path), *(argv or [])]
    try:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(str(path), run_name="__main__")
        return buf.getvalue()
    finally:
        os.chdir(here)
        sys.argv = saved_argv


# --- the glue a reader would add ---------------------------------------------------------------

B, HQ, HKV, L, D = 1, 4, 2, 128, 16  # the quickstart's shapes: its compile is reused (Inductor's cache)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def tiny_model(device: str = "cpu") -> Any:
    """A two-layer model whose attention is compiled FlexAttention (the quickstart's call, so the
    compile is a cache hit); ``model(batch).loss`` / ``model(input_ids=..., labels=...)["loss"]``."""
    import torch  # (imported here: collecting the blocks needs no torch)
    from torch import nn
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=L, KV_LEN=L, device=device)

    class Out(dict):
        __getattr__ = dict.__getitem__

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(HQ * D, HQ * D)
            self.kv = nn.Linear(HQ * D, 2 * HKV * D)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, HQ, D).transpose(1, 2).contiguous()  # (the quickstart's strides too)
            k, v = (t.contiguous() for t in self.kv(x).view(b, s, 2, HKV, D).permute(2, 0, 3, 1, 4))
            return flex(q, k, v, block_mask=mask, enable_gqa=True).transpose(1, 2).reshape(b, s, HQ * D)

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(64, HQ * D)
            self.layers = nn.ModuleList([Attention(), Attention()])
            self.head = nn.Linear(HQ * D, 64)

        def forward(self, input_ids, labels=None):
            x = self.embed(input_ids)
            for layer in self.layers:
                x = x + layer(x)
            logits = self.head(x)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), (input_ids if labels is None else labels).flatten())
            return Out(loss=loss, logits=logits)

    return TinyLM().to(device)


def rows(n: int = 1, device: str = "cpu") -> list[dict[str, Any]]:
    import torch  # (imported here: collecting the blocks needs no torch)

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (L,), generator=g)
        out.append({"input_ids": ids.to(device), "labels": ids.clone().to(device)})
    return out


def setup_base(device: str) -> dict[str, Any]:
    import torch  # (imported here: collecting the blocks needs no torch)

    import fusionguard

    return {"__name__": "__main__", "torch": torch, "fusionguard": fusionguard}


def setup_model(device: str) -> dict[str, Any]:
    ns = setup_base(device)
    ns["model"] = tiny_model(device)
    ns["batch"] = rows(1, device)[0]["input_ids"][None]
    return ns


def setup_hf(device: str) -> dict[str, Any]:
    ns = setup_model(device)
    ns["train"], ns["val"] = rows(4, device="cpu"), rows(1, device="cpu")
    return ns


def setup_hf_trainer(device: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments  # (imported here: only this glue needs transformers)

    ns = setup_hf(device)
    ns["trainer"] = Trainer(model=ns["model"], args=TrainingArguments("out", report_to=[], disable_tqdm=True), eval_dataset=ns["val"])
    return ns


def setup_lightning(device: str) -> dict[str, Any]:
    import lightning.pytorch as pl  # (imported here: only this glue needs lightning)
    import torch

    ns = setup_base(device)
    model = tiny_model(device)
    data = rows(1)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, idx):
            return self.model(**batch).loss

        def validation_step(self, batch, idx):
            loss = self.model(**batch).loss
            self.log("val_loss", loss, batch_size=1)
            return loss

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=1)

        val_dataloader = train_dataloader

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    ns["module"] = Module()
    return ns


def setup_handler(device: str) -> dict[str, Any]:
    ns = setup_base(device)
    ns["my_handler"] = logging.StreamHandler(io.StringIO())
    return ns


def setup_fused_logs(device: str) -> dict[str, Any]:
    """``logs/``: the log of a run whose FlexAttention calls all ran fused."""
    import fusionguard

    ns = setup_model(device)
    fusionguard.enable(strict=True, log_path="logs/")
    with ns["torch"].no_grad(), fusionguard.watch(ns["model"]):
        ns["model"](ns["batch"])
    fusionguard.disable()
    return ns


TRAIN_PY = """\
import fusionguard

fusionguard.enable()
fusionguard.disable()
"""


def setup_quickstart_log(device: str) -> dict[str, Any]:
    """``fusionguard.jsonl``: the quickstart's log (a dense call blocked, one fused, one allowed)."""
    shutil.copy(SHARED["quickstart-log"], "fusionguard.jsonl")
    return setup_base(device)


def setup_train_py(device: str) -> dict[str, Any]:
    """``train.py``: a program that enables fusionguard (what TORCH_LOGS is about) and stops."""
    Path("train.py").write_text(TRAIN_PY)
    return setup_base(device)


def setup_pytest_project(device: str) -> dict[str, Any]:
    Path("test_attention.py").write_text(
        textwrap.dedent("""\
        import torch

        def test_shapes():
            assert torch.randn(1, 2, 16, 8).shape[-1] == 8
        """)
    )
    return setup_base(device)


SETUPS: dict[str, Callable[[str], dict[str, Any]]] = {
    "": setup_base,
    "model": setup_model,
    "hf": setup_hf,
    "hf-trainer": setup_hf_trainer,
    "lightning": setup_lightning,
    "handler": setup_handler,
    "fused-logs": setup_fused_logs,
    "train-py": setup_train_py,
    "quickstart-log": setup_quickstart_log,
    "pytest-project": setup_pytest_project,
}


def run_block(block: Block, cwd: Path, device: str = "cpu") -> str:
    """Run a ``run`` / ``gpu`` block in ``cwd`` after its glue; what it printed."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        ns = SETUPS[block.args.get("setup", "")](device)
    finally:
        os.chdir(here)
    if block.python:
        return run_python(block.text, block.id, ns, cwd)
    assert block.shell, f"{block.id}: a {block.lang or 'plain'} block cannot run (python or bash)"
    return run_shell(block.text, cwd, parallel="parallel" in block.flags)


# --- producers: the real outputs that output blocks show ---------------------------------------

STRICT_PY = """\
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard


@torch.compile
def attention(q, k, v, mask):
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


fusionguard.enable(strict=True)
with torch._dynamo.config.patch({LIMIT}=1):
    for length in (128, 96):  # the second length needs a recompile, and the limit is 1
        q, k, v = torch.randn(1, 4, length, 16), torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16)
        mask = create_block_mask(causal, None, None, length, length, device="cpu")
        try:
            attention(q, k, v, mask)
        except fusionguard.DenseFallbackError as err:
            print(err)
fusionguard.disable()
"""


class Producers:
    """Each producer runs once per session in a directory of its own; ``get(name)`` is
    (what it printed, the directories an updated doc shows as SHOWN_ROOT)."""

    def __init__(self, make_dir: Callable[[str], Path], device: str = "cpu") -> None:
        self.make_dir, self.device, self.done = make_dir, device, {}
        self.funcs: dict[str, Callable[[Path], str]] = {
            "quickstart-report": self.quickstart_report,
            "strict-recompile-limit": self.strict_recompile_limit,
            "early-warnings-report": self.early_warnings_report,
            "doctor": self.doctor,
        }

    def get(self, name: str) -> tuple[str, list[Path]]:
        if name not in self.done:
            cwd = self.make_dir(name)
            with cleaned():
                self.done[name] = (self.funcs[name](cwd), [cwd, ROOT])
        return self.done[name]

    def quickstart_log(self) -> Path:
        """The quickstart's log (its one Inductor compile is the one the glue model reuses)."""
        self.get("quickstart-report")
        SHARED["quickstart-log"] = self.done["quickstart-report"][1][0] / "fusionguard.jsonl"
        return SHARED["quickstart-log"]

    def quickstart_report(self, cwd: Path) -> str:
        run_script(ROOT / "examples" / "quickstart.py", cwd)
        return run_shell("fusionguard report fusionguard.jsonl", cwd)

    def strict_recompile_limit(self, cwd: Path) -> str:
        from fusionguard import torch_internals  # (imported here: collecting the blocks needs no torch)

        (cwd / "train.py").write_text(STRICT_PY.replace("{LIMIT}", torch_internals.recompile_limit_option()))
        import torch  # (imported here: collecting the blocks needs no torch)

        torch._dynamo.reset()
        return run_script(cwd / "train.py", cwd)

    def early_warnings_report(self, cwd: Path) -> str:
        import torch  # (imported here: collecting the blocks needs no torch)

        torch._dynamo.reset()
        run_script(ROOT / "examples" / "early_warnings.py", cwd, ["--backend", "aot_eager"])
        return run_shell("fusionguard report fusionguard.jsonl", cwd)

    def doctor(self, cwd: Path) -> str:
        """``fusionguard doctor``'s stdout (its progress lines go to stderr)."""
        from fusionguard import cli  # (imported here: collecting the blocks needs no torch)

        out, here = io.StringIO(), os.getcwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                rc = cli.main(["doctor"])
        finally:
            os.chdir(here)
        assert rc == 0, out.getvalue()
        return out.getvalue()
