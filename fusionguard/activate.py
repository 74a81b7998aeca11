"""Zero-code activation: ``FUSIONGUARD=strict|warn|oom|off`` in the environment.

How it reaches every Python process (the way ``ddtrace-run`` and ``coverage`` do it): the
launcher ``fusionguard run -- CMD ...`` puts ``fusionguard/_startup`` first on ``PYTHONPATH``;
its ``sitecustomize`` runs at the start of every Python process that inherits the environment
(spawn and forkserver children, torchrun's workers, a launcher's workers you cannot edit), calls
``startup()``, then runs the ``sitecustomize`` it hides, if any. ``startup()`` never imports
torch: it waits until the program imports torch, then calls ``fusionguard.enable()`` (log path:
``FUSIONGUARD_LOG`` as usual). A process that never imports torch pays for reading one variable.

``FUSIONGUARD=off`` is a kill switch: ``enable()`` does nothing (said once on stderr), also when
the program calls it. Unset (the default): nothing happens at start-up; ``enable()`` in code works
as always. Any other value is reported once on stderr and ignored: never a crash.

Importing this module imports nothing of fusionguard or torch.
"""

from __future__ import annotations

import os
import sys
from typing import Any, List, Optional, Sequence

ENV = "FUSIONGUARD"
MODES = ("strict", "warn", "oom", "off")
#: The directory the launcher puts first on PYTHONPATH (holds our ``sitecustomize.py``).
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup")

_told: set = set()


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
        _say_once("bad", f"fusionguard: ignoring {ENV}={raw!r} (expected one of {', '.join(MODES)}); fusionguard stays as the code sets it\n")
        return None
    return mode


def switched_off() -> bool:
    """True under ``FUSIONGUARD=off`` (then said once on stderr)."""
    if env_mode() != "off":
        return False
    _say_once("off", f"fusionguard: {ENV}=off: fusionguard.enable() does nothing in this process (kill switch)\n")
    return True


def startup() -> None:
    """Called by our ``sitecustomize`` in every process: arrange ``enable()`` for when torch is
    imported (at once if it already is). Never raises."""
    try:
        mode = env_mode()
        if mode not in ("strict", "warn", "oom"):
            return
        if "torch" in sys.modules:
            _enable(mode)
        elif not any(isinstance(f, _TorchWatcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _TorchWatcher(mode))
    except Exception as exc:  # pragma: no cover - defensive
        _say_once("startup", f"fusionguard: start-up hook failed ({type(exc).__name__}: {exc}); fusionguard is off in this process\n")


#: Launcher processes that import torch but never run attention (torchrun's elastic agent;
#: Inductor's compile-worker pool, which torch 2.7 starts in every compiling worker): their
#: workers are enabled, they are not (no log of their own next to the ranks' logs).
_LAUNCHERS = ("torchrun", "torch/distributed/run.py", "torch/distributed/launch.py", "torch/_inductor/compile_worker/__main__.py")


_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def is_launcher(argv0: str, orig_argv: Sequence[str] = ()) -> bool:
    """``argv0``: ``sys.argv[0]``; ``orig_argv``: ``sys.orig_argv`` (for ``python -m X``, whose
    ``sys.argv[0]`` is ``-m`` while the module is being found, when torch gets imported)."""
    if argv0 == "-m":
        args = list(orig_argv)
        return "-m" in args[:-1] and args[args.index("-m") + 1] in _LAUNCHER_MODULES
    name = argv0.replace(os.sep, "/")
    return any(name == x or name.endswith("/" + x) for x in _LAUNCHERS)


def _enable(mode: str) -> None:
    if sys.argv and is_launcher(sys.argv[0], getattr(sys, "orig_argv", ())):
        return
    try:
        import fusionguard

        if not fusionguard.is_enabled():  # the program enabled it itself: its settings stand
            fusionguard.enable(mode=mode)
    except Exception as exc:
        _say_once("enable", f"fusionguard: {ENV}={mode}: enable() failed ({type(exc).__name__}: {exc}); the program runs without fusionguard\n")


class _TorchWatcher:
    """Finds nothing itself; when ``torch`` is about to be imported, wraps the real loader so
    that ``enable()`` runs right after torch's own import finished. Removes itself then."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.busy = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch" or self.busy:
            return None
        self.busy = True
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
            spec.loader = _AfterTorch(spec.loader, self.mode)
            return spec
        except Exception:
            return None  # let the normal machinery find torch
        finally:
            self.busy = False
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass


class _AfterTorch:
    def __init__(self, loader: Any, mode: str) -> None:
        self.loader = loader
        self.mode = mode

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        try:  # from now on torch sees its own loader, as if we had never been there
            module.__loader__ = self.loader
            module.__spec__.loader = self.loader
        except Exception:
            pass
        _enable(self.mode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


# -- the launcher: `fusionguard run -- CMD ...` -------------------------------------------------------


def launch_env(mode: Optional[str] = None, log: Optional[str] = None, environ: Optional[dict] = None) -> dict:
    """The environment ``fusionguard run`` gives its command."""
    env = dict(os.environ if environ is None else environ)
    env[ENV] = mode or env.get(ENV) or "warn"
    if log:
        path = os.path.abspath(os.path.expanduser(log))
        env["FUSIONGUARD_LOG"] = path + os.sep if log.endswith(("/", os.sep)) else path
    parts: List[str] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != HOOK_DIR]
    env["PYTHONPATH"] = os.pathsep.join([HOOK_DIR] + parts)
    return env


def run(cmd: Sequence[str], mode: Optional[str] = None, log: Optional[str] = None) -> int:
    """Replace this process with ``cmd`` under the start-up hook (returns only on failure)."""
    if not cmd:
        sys.stderr.write("fusionguard run: no command given (fusionguard run [--strict|--warn|--oom] [--log PATH] -- CMD ...)\n")
        return 2
    env = launch_env(mode, log)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvpe(cmd[0], list(cmd), env)
    except OSError as exc:
        sys.stderr.write(f"fusionguard run: cannot run {cmd[0]!r}: {exc.strerror or exc}\n")
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # pragma: no cover - execvpe does not return
