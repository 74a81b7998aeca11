"""``fusionguard report``: read fusionguard JSON-lines logs and say what ran dense, where, why, how
much memory it took and how the run ended.

One module per job (no cycle; nothing here imports torch):

- ``read``: find the log files and read them one line at a time, hostile lines counted, never fatal;
- ``reservoir``: a fixed-size sample of memory figures (median) and their exact max;
- ``aggregate``: fold the events into bounded per-process and per-(layer, phase) counts;
- ``build``: the report dict (``build(paths)``, also ``--format json``);
- ``render``: text, CSV and JSON writers, every string from a log escaped;
- ``chart``: the per-layer chart's numbers, once, for ``--plot`` and ``--html``;
- ``plot``: the ``--plot`` chart (matplotlib, imported only then);
- ``html_style``: that page's stylesheet (fixed text);
- ``html``: the ``--html`` page (self-contained, no script; every log string escaped);
- ``crashfile``: a faulthandler file (native crash) read into a crash record; files named by
  logs opened safely (``read`` uses it too).

This package file imports nothing: each caller imports the module it needs
(``fusionguard.report.build.build``, ``fusionguard.report.render.render_text``, ...).

Reading is streaming and bounded: one line at a time (a line longer than ``MAX_LINE`` is skipped
without being held), per (layer, phase) a fixed-size reservoir of memory figures (exact median
up to ``RESERVOIR`` samples, exact max always), per process the last ``last`` events in a deque,
and a cap on distinct (layer, phase) keys. A 1 GB log therefore needs tens of MB, whatever its
length.

Input rules: a file or a directory (every ``*.jsonl`` inside, recursively, with its rotated
parts ``*.jsonl.N`` read oldest first); a torn last line, corrupt lines and lines that are not
event objects are counted and reported, never fatal; unknown event kinds are counted and
otherwise ignored; every header's ``schema`` is reported (newer than ``SUPPORTED_SCHEMA``: a
warning, known fields are still read).

Events are grouped by *process*: (hostname from the header, pid, rank). A process whose log
contains a ``"crash"`` event crashed; one whose last event is not a ``"shutdown"`` stopped without
one (SIGKILL, the OOM killer, a node failure, or still running).
"""
