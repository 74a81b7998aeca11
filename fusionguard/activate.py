"""Zero-code activation: ``FUSIONGUARD=strict|warn|oom|off`` in the environment.

How it reaches every Python process (the way ``ddtrace-run`` and ``coverage`` do it): the
launcher ``fusionguard run -- CMD ...`` puts ``fusionguard/_startup`` first on ``PYTHONPATH``;
its ``sitecustomize`` runs at the start of every Python process that inherits the environment
(spawn and forkserver children, torchrun's workers, a launcher's workers you cannot edit), calls
``startup()``, then runs the ``sitecustomize`` it hides, if any. ``startup()`` never imports
torch: it waits until the program imports torch, then calls ``fusionguard.enable()`` (log path:
``FUSIONGUARD_LOG`` as usual). A process that never imports torch pays for reading one variable
and loading this file: under 1 ms (``benchmarks/startup.py``; the bound is 10 ms). Hence no
``typing`` at run time here, and no wrapt post-import hook (``import wrapt`` costs 70-90 ms:
docs/internals.md).

``FUSIONGUARD=off`` is a kill switch: ``enable()`` does nothing (said once on stderr), also when
the program calls it. Unset (the default): nothing happens at start-up; ``enable()`` in code works
as always. Any other value is reported once on stderr and ignored: never a crash (the launcher
refuses it before starting anything, exit status 2).

Importing this module imports nothing of fusionguard or torch.
"""

from __future__ import annotations

import _thread
import os
import sys

TYPE_CHECKING = False  # (typing costs the start-up hook ~2-4 ms: docs/internals.md, benchmarks/startup.py)
if TYPE_CHECKING:
    from typing import Any, Callable, List, Optional, Sequence

ENV = "FUSIONGUARD"
#: The words of ``FUSIONGUARD=``, ``fusionguard run``, ``enable(mode=...)`` (all but ``off``: ``core.config``)
#: and the pytest option (``pytest_plugin.MODES``, checked equal: the plugin imports nothing of fusionguard
#: until a session starts).
MODES = ("strict", "warn", "oom", "off")
#: The directory the launcher puts first on PYTHONPATH (holds our ``sitecustomize.py``).
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup")

#: The name our start-up hook loads this file under, by path (``_startup/sitecustomize.py``: the
#: package costs ~0.1 s); the package imports it again as ``fusionguard.activate``.
HOOK_COPY = "_fusionguard_activate"
#: The notes said once per process: one set for both copies (the one loaded second takes the first's).
_first = None if __name__ == HOOK_COPY else sys.modules.get(HOOK_COPY)  # (None: this is the first copy)
_told: set = set() if _first is None else _first._told


def _say_once(key: str, text: str) -> None:
    if key in _told:
        return
    _told.add(key)
    try:
        if sys.stderr is not None:
            sys.stderr.write(text)
    except Exception:
        pass


def env_mode() -> Optional[str]:
    """``strict`` / ``warn`` / ``oom`` / ``off`` from ``FUSIONGUARD``; None when unset, empty or invalid
    (an invalid value is reported once on stderr)."""
    raw = os.environ.get(ENV)
    if raw is None or not raw.strip():
        return None
    mode = raw.strip().lower()
    if mode not in MODES:
        _say_once(
            "bad", f"fusionguard: ignoring {ENV}={raw!r} (expected one of {', '.join(MODES)}); fusionguard stays as the code sets it\n"
        )
        return None
    return mode


def switched_off() -> bool:
    """True under ``FUSIONGUARD=off`` (then said once on stderr)."""
    if env_mode() != "off":
        return False
    _say_once("off", f"fusionguard: {ENV}=off: fusionguard.enable() does nothing in this process (kill switch)\n")
    return True


def startup(launch: Callable[[str], None]) -> None:
    """Called by our ``sitecustomize`` in every process: arrange ``launch(mode)`` (its
    ``enable()``: this module sits below the package and imports none of it) for when torch is
    imported (at once if it already is). Never raises."""
    try:
        mode = env_mode()
        if mode not in ("strict", "warn", "oom"):
            return
        if "torch" in sys.modules:
            _enable(mode, launch)
        elif not any(isinstance(f, _TorchWatcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _TorchWatcher(mode, launch))
    except Exception as exc:  # pragma: no cover - defensive
        _say_once("startup", f"fusionguard: start-up hook failed ({type(exc).__name__}: {exc}); fusionguard is off in this process\n")


#: Launcher processes that import torch but never run attention (torchrun's elastic agent): their
#: workers are enabled, they are not (no log of their own next to the ranks' logs).
_LAUNCHERS = ("torchrun", "torch/distributed/run.py", "torch/distributed/launch.py")
#: Helper processes torch starts itself, which import torch but never run the user's attention:
#: Inductor's compile-worker pool (``python .../compile_worker/__main__.py``; its workers are its
#: forks), and the dlopen probe of Inductor's CPU vector-ISA check below.
_HELPER_SCRIPTS = ("torch/_inductor/compile_worker/__main__.py",)
#: The probe (``cpu_vec_isa.VecISA._avx_py_load``): ``python -c CODE``, CODE made of these lines and
#: ``cdll.LoadLibrary(<a kernel .so>)``, nothing else (it imports torch on 2.7 everywhere; 2.13 off
#: Linux; 2.15 off Linux, and on Linux where the plain load failed).
_PROBE_LINES = ("import torch", "import sys", 'if sys.platform != "linux":', "from ctypes import cdll", "try:", "except OSError:", "raise")


_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def is_launcher(argv0: str, orig_argv: Sequence[str] = ()) -> bool:
    """``argv0``: ``sys.argv[0]``; ``orig_argv``: ``sys.orig_argv`` (for ``python -m X``, whose
    ``sys.argv[0]`` is ``-m`` while the module is being found, when torch gets imported)."""
    if argv0 == "-m":
        args = list(orig_argv)
        return "-m" in args[:-1] and args[args.index("-m") + 1] in _LAUNCHER_MODULES
    name = argv0.replace(os.sep, "/")
    return any(name == x or name.endswith("/" + x) for x in _LAUNCHERS)


def is_torch_helper(argv0: str, orig_argv: Sequence[str] = ()) -> bool:
    """A Python process torch started for itself (``_HELPER_SCRIPTS``, the vector-ISA probe), not
    the user's: ``argv0`` is ``sys.argv[0]``, ``orig_argv`` ``sys.orig_argv`` (``-c``'s code)."""
    name = argv0.replace(os.sep, "/")
    if any(name.endswith("/" + x) for x in _HELPER_SCRIPTS):
        return True
    args = list(orig_argv)
    if argv0 != "-c" or "-c" not in args[:-1]:
        return False
    lines = [line.split("#")[0].strip() for line in args[args.index("-c") + 1].splitlines()]
    lines = [line for line in lines if line]
    loads = [line for line in lines if line.startswith("cdll.LoadLibrary(")]
    return bool(loads) and all(line in _PROBE_LINES for line in lines if line not in loads)


def _enable(mode: str, launch: Callable[[str], None]) -> None:
    argv = getattr(sys, "orig_argv", ())
    if sys.argv and (is_launcher(sys.argv[0], argv) or is_torch_helper(sys.argv[0], argv)):
        return
    try:
        launch(mode)
    except Exception as exc:
        _say_once(
            "enable", f"fusionguard: {ENV}={mode}: enable() failed ({type(exc).__name__}: {exc}); the program runs without fusionguard\n"
        )


def _ours(name: str) -> bool:
    return name == "fusionguard" or name.startswith("fusionguard.")


def _half_imported(executed: set) -> bool:
    """A fusionguard module is still being executed (``executed``: those whose code already ran
    through our loaders, while the import machinery finishes them)."""
    for name, module in list(sys.modules.items()):
        if _ours(name) and name not in executed and getattr(getattr(module, "__spec__", None), "_initializing", False):
            return True
    return False


class _TorchWatcher:
    """Finds nothing itself; wraps the loader of ``torch`` so that ``enable()`` runs right after
    torch's own import finished, and the loaders of fusionguard's own modules: when one of them is
    what imports torch (``from fusionguard import watch`` before ``import torch``, ``import
    fusionguard.dense.guard``, the program's own ``enable()``), ``enable()`` waits until that import
    finished (in the middle of it, it would find half-initialised modules: a circular import).
    Removes itself once ``enable()`` ran."""

    def __init__(self, mode: str, launch: Callable[[str], None]) -> None:
        self.mode = mode
        self.launch = launch
        self.busy: set = set()  # threads in our find_spec (asking the other finders)
        self.depth = 0  # fusionguard modules being imported through our loaders
        self.executed: set = set()  # fusionguard modules whose code ran through our loaders
        self.torch_imported = False
        self.done = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        meta = sys.meta_path
        if meta and meta[0] is not self and not self.done:
            # A finder put in front of us later (pytest's assertion rewriter, which loads the
            # modules of plugins such as fusionguard) would load our modules past us: go first
            # again. Harmless: we find nothing ourselves and ask the others in their order.
            # One slice assignment: another thread iterating sys.meta_path never sees it
            # without a finder (remove-then-insert did, for a moment).
            meta[:] = [self] + [f for f in meta if f is not self]
        tid = _thread.get_ident()
        if tid in self.busy or not (name == "torch" or _ours(name)):
            if self.torch_imported and tid not in self.busy:  # waiting on a module loaded by another finder
                self.maybe_enable()
            return None
        self.busy.add(tid)
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return None
            spec.loader = _Watched(spec.loader, self, name == "torch")
            return spec
        except Exception:
            return None  # let the normal machinery find it
        finally:
            self.busy.discard(tid)

    def maybe_enable(self) -> None:
        """``enable()`` once torch is imported and no fusionguard module is half-imported."""
        if self.done or not self.torch_imported or self.depth or _half_imported(self.executed):
            return
        self.done = True
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        _enable(self.mode, self.launch)


class _Watched:
    """The real loader, then a word to the watcher. Once the module is executed it sees its own
    loader again, as if we had never been there."""

    def __init__(self, loader: Any, watcher: _TorchWatcher, is_torch: bool) -> None:
        self.loader = loader
        self.watcher = watcher
        self.is_torch = is_torch

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        w = self.watcher
        step = 0 if self.is_torch else 1
        w.depth += step
        try:
            self.loader.exec_module(module)
        finally:
            w.depth -= step
            try:
                module.__loader__ = self.loader
                module.__spec__.loader = self.loader
            except Exception:
                pass
        if self.is_torch:
            w.torch_imported = True
        else:
            w.executed.add(module.__name__)
        if w.depth == 0:
            w.maybe_enable()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


# -- the launcher: `fusionguard run -- CMD ...` -------------------------------------------------------


def launch_env(mode: Optional[str] = None, log: Optional[str] = None, environ: Optional[dict] = None) -> dict:
    """The environment ``fusionguard run`` gives its command: the user's ``PYTHONPATH`` entries
    kept exactly, empty ones included (an empty entry puts the working directory on
    ``sys.path``), after the hook directory."""
    env = dict(os.environ if environ is None else environ)
    # (whitespace is unset, as check_mode and the hook read it: warn, never a value the hook ignores)
    env[ENV] = mode or (env.get(ENV) or "").strip().lower() or "warn"
    if log:
        path = os.path.abspath(os.path.expanduser(log))
        env["FUSIONGUARD_LOG"] = path + os.sep if log.endswith(("/", os.sep)) else path
    old = env.get("PYTHONPATH", "")  # (empty: no entry at all, as Python reads it)
    parts: List[str] = [p for p in old.split(os.pathsep) if p != HOOK_DIR] if old else []
    env["PYTHONPATH"] = os.pathsep.join([HOOK_DIR] + parts)
    return env


_PYTHON_NAME = r"(python|pypy)[0-9.]*[dmt]?(\.exe)?"  # (re, shutil: imported by the launcher only, not by the hook)
#: Python options that keep ``sitecustomize`` from running: -E / -I ignore ``PYTHONPATH``, -S skips ``site``.
_UNREACHABLE = {"E": "ignores PYTHONPATH", "I": "ignores PYTHONPATH (isolated mode)", "S": "skips the site module, and so sitecustomize"}


def python_flags_out_of_reach(argv: Sequence[str]) -> List[str]:
    """The options of a Python command line (``python -E x.py``) that keep the start-up hook from
    running in it, e.g. ``["-E"]``; [] for any other command. Reads short-option clusters (``-sE``)
    up to the script, ``-c`` or ``-m``."""
    found: List[str] = []
    args = list(argv)[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--check-hash-based-pycs":
            i += 1  # its value
            continue
        if arg.startswith("--") and arg != "--":
            continue  # --version, --help ...
        if arg in ("-", "--") or not arg.startswith("-"):
            break  # the script
        for j, ch in enumerate(arg[1:], start=2):
            if ch in "cm":  # the rest is the command / module
                return found
            if ch in "WX":  # the rest, or the next argument, is the option's value
                i += j == len(arg)
                break
            if ch in _UNREACHABLE and f"-{ch}" not in found:
                found.append(f"-{ch}")
    return found


def _is_python(path: str) -> bool:
    import re  # lazy: the start-up hook runs in every Python process: it imports little

    name = os.path.basename(path)
    if re.fullmatch(_PYTHON_NAME, name, re.IGNORECASE):
        return True
    try:
        return bool(sys.executable) and os.path.realpath(path) == os.path.realpath(sys.executable)
    except OSError:
        return False


def _shebang(path: str) -> List[str]:
    """The interpreter and options of a script's ``#!`` line ([] when it has none)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(256)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    words = head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").split()
    if words and os.path.basename(words[0]) == "env":  # #!/usr/bin/env [-S] python3 -E
        words = [w for w in words[1:] if not (w.startswith("-") and w.lstrip("-") in ("S", "split-string"))]
    return words


def unreachable_warning(cmd: Sequence[str], env: Optional[dict] = None) -> Optional[str]:
    """The launcher's warning when ``cmd`` is a Python that will not run the start-up hook
    (``python -E``/``-I``/``-S``, or a script whose ``#!`` line says so); None otherwise."""
    if not cmd:
        return None
    import shutil  # lazy: the start-up hook runs in every Python process: it imports little

    argv = list(cmd)
    if not _is_python(argv[0]):
        found = shutil.which(argv[0], path=(env or os.environ).get("PATH"))
        words = _shebang(found) if found else []
        if not words or not _is_python(words[0]):
            return None
        argv = words + argv[:1]
    flags = python_flags_out_of_reach(argv)
    if not flags:
        return None
    why = ", ".join(f"{f} {_UNREACHABLE[f[1]]}" for f in flags)
    return (
        f"fusionguard run: warning: {os.path.basename(argv[0])} {' '.join(flags)}: {why}: fusionguard's start-up hook "
        "cannot run in this process, nor in the Python processes it starts with the same options; they run "
        "without fusionguard (drop the option, or call fusionguard.enable() in the program; docs/guarantees.md)\n"
    )


def check_mode(value: Optional[str]) -> Optional[str]:
    """The launcher's error for a ``FUSIONGUARD`` value that is not a mode; None when it is one
    (or unset / empty: the default, warn)."""
    if value is None or not value.strip() or value.strip().lower() in MODES:
        return None
    return (
        f"fusionguard run: {ENV}={value!r} is not a mode: use one of {', '.join(MODES)} "
        "(or --strict / --warn / --oom); nothing was started\n"
    )


def _file_hint(cmd: Sequence[str]) -> str:
    """A file that exists but is no command (a script that is not executable, or not on PATH)."""
    if not os.path.isfile(cmd[0]):
        return ""
    import shlex  # lazy: this module loads at every start-up under the launcher; this only on a failed exec

    if cmd[0].endswith(".py"):
        return f" (a Python script: fusionguard run python {shlex.join(cmd)})"
    if os.sep not in cmd[0]:
        return f" (a file here is not looked up on PATH: fusionguard run ./{shlex.join(cmd)})"
    return " (the file is not executable: chmod +x it, or name its interpreter first)"


def run(cmd: Sequence[str], mode: Optional[str] = None, log: Optional[str] = None) -> int:
    """Replace this process with ``cmd`` under the start-up hook (returns only on failure)."""
    if not cmd:
        sys.stderr.write("fusionguard run: no command given (fusionguard run [--strict|--warn|--oom] [--log PATH] -- CMD ...)\n")
        return 2
    bad = None if mode else check_mode(os.environ.get(ENV))
    if bad:
        sys.stderr.write(bad)
        return 2
    env = launch_env(mode, log)
    if env[ENV] == "off":  # an exported kill switch, left over: say so, never run unguarded silently
        sys.stderr.write(
            f"fusionguard run: {ENV}=off in the environment: the command runs without fusionguard "
            "(unset it, or pass --strict / --warn / --oom)\n"
        )
    warning = unreachable_warning(cmd, env)
    if warning:
        sys.stderr.write(warning)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvpe(cmd[0], list(cmd), env)
    except OSError as exc:
        sys.stderr.write(f"fusionguard run: cannot run {cmd[0]!r}: {exc.strerror or exc}{_file_hint(cmd)}\n")
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # pragma: no cover - execvpe does not return
