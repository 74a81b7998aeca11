"""``enable()``'s options: one dataclass whose fields are the options, validated on creation,
and where the log goes. Torch-free (``import fusionguard`` must not import torch)."""

from __future__ import annotations

import builtins
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Tuple, Union

from fusionguard import activate
from fusionguard.eventlog.header import rank_info
from fusionguard.eventlog.sink import DEFAULT_LOG_MODE

#: ``enable(mode=...)``: the words of ``FUSIONGUARD=`` (``activate.MODES``, the one list), but the kill switch.
MODES = tuple(m for m in activate.MODES if m != "off")

#: The log file when neither ``enable(log_path=...)`` nor ``FUSIONGUARD_LOG`` says (one process).
DEFAULT_LOG_NAME = "fusionguard.jsonl"


@dataclass
class Config:
    strict: Optional[bool] = None  # None: not named (mode decides); a bool once built
    log_path: Optional[str] = None  # resolved absolute path, or None for memory only
    # True: the first dense event of each (call site, layer, phase, action) and every error are
    # fsync-ed before the dense kernel runs; "always": every dense event; False: none.
    fsync: Union[bool, str] = True
    max_events: int = 10_000  # events kept in memory for fusionguard.events()
    rescue: bool = False  # compile eager FlexAttention calls with Inductor instead of running dense
    fused_first: int = 10  # fused per-call events kept per (layer, phase) before sampling
    fused_every: int = 1000  # then one fused_calls counter event every N calls
    dense_first: int = 10  # dense events kept per (call site, layer, phase, cause, action) before sampling
    dense_every: int = 1000  # then one dense_calls counter event every N calls
    keep_all: bool = False  # keep every per-call event, fused and dense
    log_max_bytes: Optional[int] = None  # size-based rotation of the log file
    log_backups: int = 3
    log_mode: int = DEFAULT_LOG_MODE  # permissions of new log / crash files (existing keep theirs)
    # pending dense_calls / fused_calls counters are written this often (seconds; 0: only every
    # N calls and at exit): a killed process loses at most the counts of its last interval
    flush_interval: float = 0.5
    # recompile pressure: warn when a frame holding FlexAttention reaches this many compiles
    # (None: half of Dynamo's recompile limit, rounded up; always below the limit; 0: never)
    recompile_warn_at: Optional[int] = None
    # eager create_block_mask / create_mask builds estimated above this many bytes warn (strict:
    # raise); None: 10% of the building device's memory, read at the first build (not at enable())
    mask_limit: Optional[int] = None
    # "warn", "strict" or "oom" (dense calls run, but one predicted not to fit on its CUDA device
    # raises); never truthy where code tests ``strict``: "oom" leaves ``strict`` False
    mode: Optional[str] = None

    def __post_init__(self) -> None:
        if self.fsync != "always" and not isinstance(self.fsync, bool):
            raise TypeError(f"fusionguard.enable(): fsync must be True, False or 'always', not {self.fsync!r}")
        if isinstance(self.strict, str) and self.strict.strip().lower() in MODES:
            raise TypeError(
                f"fusionguard.enable(): strict must be True or False, not {self.strict!r}; "
                f"a mode by name is mode={self.strict.strip().lower()!r}"
            )
        for name in ("strict", "rescue", "keep_all"):
            if not isinstance(getattr(self, name), bool) and not (name == "strict" and self.strict is None):
                raise TypeError(f"fusionguard.enable(): {name} must be True or False, not {getattr(self, name)!r}")
        for name, low in (
            ("max_events", 1),
            ("fused_first", 0),
            ("fused_every", 0),
            ("dense_first", 1),
            ("dense_every", 0),
            ("log_backups", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"fusionguard.enable(): {name} must be an integer >= {low}, not {value!r}")
        if self.log_max_bytes is not None and (not isinstance(self.log_max_bytes, int) or self.log_max_bytes < 1024):
            raise ValueError(f"fusionguard.enable(): log_max_bytes must be None or an integer >= 1024, not {self.log_max_bytes!r}")
        if (
            isinstance(self.log_mode, bool)
            or not isinstance(self.log_mode, int)
            or not 0o400 <= self.log_mode <= 0o777
            or not self.log_mode & 0o200
        ):
            raise ValueError(
                f"fusionguard.enable(): log_mode must be a file mode the owner can read and write (0o600 ... 0o777), not {self.log_mode!r}"
            )
        if (
            isinstance(self.flush_interval, bool)
            or not isinstance(self.flush_interval, (int, float))
            or not 0 <= self.flush_interval <= 3600
        ):
            raise ValueError(
                f"fusionguard.enable(): flush_interval must be a number of seconds between 0 and 3600, not {self.flush_interval!r}"
            )

        warn_at = self.recompile_warn_at
        if warn_at is not None and (isinstance(warn_at, bool) or not isinstance(warn_at, int) or warn_at < 0 or warn_at == 1):
            raise ValueError(
                f"fusionguard.enable(): recompile_warn_at must be None (half the recompile limit), 0 (off) "
                f"or a number of compiles >= 2, not {warn_at!r}"
            )
        if self.mask_limit is not None and (
            isinstance(self.mask_limit, bool) or not isinstance(self.mask_limit, int) or self.mask_limit < 0
        ):
            raise ValueError(f"fusionguard.enable(): mask_limit must be None or a number of bytes >= 0, not {self.mask_limit!r}")
        if isinstance(self.mode, str):  # case-insensitive, as FUSIONGUARD=, --fusionguard= and the ini option
            self.mode = self.mode.strip().lower()
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"fusionguard.enable(): mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        # One rule for both (#32): strict and mode named together must agree, either way round.
        if self.strict is not None and self.mode is not None and self.strict != (self.mode == "strict"):
            raise ValueError(
                f"fusionguard.enable(): strict={self.strict!r} contradicts mode={self.mode!r}; "
                "name one of them (mode='strict' is strict=True)"
            )
        self.strict = bool(self.strict) or self.mode == "strict"
        self.mode = "strict" if self.strict else (self.mode or "warn")

    def public(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Runtime:
    """What the installed wrappers read on a call, fixed for one ``enable()``: built from the
    checked ``Config``, never changed, replaced whole by the next ``enable()``. A wrapper reads
    it once per call and hands it down, so one call decides by one option set (a second
    ``enable()`` from another thread cannot give it the old ``strict`` and the new ``mode``).
    ``enabled`` is in it too (#33): the wrappers' first test and the settings are one read."""

    enabled: bool = False
    strict: bool = False
    mode: str = "warn"
    fsync: Union[bool, str] = True
    rescue: bool = False
    mask_limit: Optional[int] = None
    recompile_warn_at: Optional[int] = None

    @classmethod
    def of(cls, config: Config, enabled: bool) -> "Runtime":
        return cls(enabled=enabled, **{f.name: getattr(config, f.name) for f in fields(cls) if f.name != "enabled"})


class RuntimeRef:
    """The one holder the wrappers close over (``STATE.runtime``, one per process): ``now`` is
    swapped by a single assignment (``enable()``: the new settings; ``disable()``, ``reset()``:
    the defaults, ``enabled`` False), atomic under the GIL: a reader gets the old object or the new one."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = Runtime()


#: ``enable()``'s keyword options: every field but the two it takes by name.
OPTIONS = tuple(f.name for f in fields(Config) if f.name not in ("strict", "log_path"))


class Unset:
    """The default of ``enable()``'s ``strict`` and ``log_path`` (and of a ``mode`` not given):
    "not said", so that a second ``enable()`` keeps what it does not name (#32)."""

    _one: Optional["Unset"] = None

    def __new__(cls) -> "Unset":
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self) -> str:
        return "UNSET"


UNSET: Any = Unset()


def merged(current: Config, named: Dict[str, Any]) -> Config:
    """A second ``enable()`` while enabled: ``current``'s options, with what this call names
    (``named``: its options, ``strict`` when given) replacing them. ``strict`` and ``mode`` are
    one setting: naming either replaces both (``enable(strict=False)`` after ``mode="oom"`` is
    warn mode, ``enable(mode="oom")`` after ``strict=True`` is oom). ``log_path`` is handled by
    the caller (not named: the same file stays open)."""
    base = {k: v for k, v in current.public().items() if k != "log_path"}
    if "strict" in named or "mode" in named:
        base.pop("strict")
        base.pop("mode")
    return Config(**{**base, **named})


def check_options(options: Dict[str, Any]) -> None:
    """A misspelt option is a ``TypeError``, as for any keyword argument."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"fusionguard.enable() got unknown option(s) {sorted(unknown)}; known: {list(OPTIONS)}")


def check_log_path(log_path: Any) -> None:
    """``log_path`` is None or True (the default file), False (no file), or a non-empty path
    (``str`` or ``os.PathLike`` of ``str``) without NUL: checked before anything is installed, so a
    bad one never fails half-way through ``enable()``."""
    if log_path is None or isinstance(log_path, bool):
        return
    what = "fusionguard.enable(): log_path must be a path (str or os.PathLike), None for the default, or False for no file"
    if isinstance(log_path, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what}; got bytes {bytes(log_path)!r}: decode it first (os.fsdecode)")
    if not isinstance(log_path, (str, os.PathLike)):
        raise TypeError(f"{what}; got {type(log_path).__name__} {log_path!r}")
    try:
        path = os.fspath(log_path)
    except Exception as exc:
        raise TypeError(f"{what}; its __fspath__() failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(path, str):
        raise TypeError(f"{what}; got an os.PathLike whose __fspath__() returns {type(path).__name__}: decode it first (os.fsdecode)")
    if not path:
        raise ValueError(
            "fusionguard.enable(): log_path is empty; give a file or directory (\".\" for one file per process in the "
            "working directory), None for the default, or False for no file"
        )
    if "\0" in path:
        raise ValueError(f"fusionguard.enable(): log_path contains a NUL character, which no file name can hold: {path!r}")


def process_log_name() -> str:
    """This process's file in a log directory."""
    return f"fusionguard.rank{rank_info()['rank']}.pid{os.getpid()}.jsonl"


def default_log_file() -> str:
    info = rank_info()
    if info["world_size"] > 1:
        return f"fusionguard.rank{info['rank']}.jsonl"
    return DEFAULT_LOG_NAME


def resolve_log_path(log_path: Union[str, "os.PathLike[str]", None, bool]) -> Tuple[Optional[str], Optional[str]]:
    """(the log file, the directory when ``log_path`` names one: a file per process in it)."""
    if log_path is False:
        return None, None
    if log_path is None or log_path is True:
        log_path = os.environ.get("FUSIONGUARD_LOG") or default_log_file()
    path = os.path.abspath(os.path.expanduser(os.fspath(log_path)))
    if os.path.isdir(path) or str(log_path).endswith(os.sep):
        # A directory: each rank and process writes its own file in it.
        return os.path.join(path, process_log_name()), path
    return path, None


def check_session_arguments(name: Any, model: Any, **flags: Any) -> None:
    """A session's arguments (``fusionguard.track()``, the callbacks'): a wrong type is a clear
    ``TypeError`` naming the argument, before anything is installed."""
    if not isinstance(name, str):
        raise TypeError(f"fusionguard.Session(): name must be a str, not {type(name).__name__}")
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: {key} must be True or False, not {value!r}")
    if model is not None:
        import torch  # lazy: a model was given, so torch is loaded already

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{name}: model must be a torch.nn.Module (or None: counts only), not {type(model).__name__}")


_KINDS = {str: "a str", bool: "True or False", BaseException: "an exception", type(None): "None"}


def check_types(call: str, **args: Tuple[Any, Any]) -> None:
    """The arguments of a session's method (``name=(value, type or tuple of types)``): a wrong type is a
    ``TypeError`` naming the argument, before the method does anything (a bad call never passes silently)."""
    for key, (value, kind) in args.items():
        if not isinstance(value, kind):
            what = " or ".join(_KINDS.get(k, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise TypeError(f"{call}: {key} must be {what}, not {type_name(value)}")


def type_name(value: Any) -> str:
    """``type(value).__name__``, qualified by its module where the short name is a builtin's
    (``numpy.bool``): "must be True or False, not bool" would contradict itself."""
    kind = type(value)
    if kind.__module__ != "builtins" and hasattr(builtins, kind.__name__):
        return f"{kind.__module__}.{kind.__qualname__}"
    return kind.__name__


def check_truth(call: str, key: str, value: Any) -> bool:
    """A flag argument: whatever has one clear truth value (a bool, an int, a numpy bool, a one-element
    tensor) is ``bool(value)``; None, text, containers and a tensor or array of several elements are a
    ``TypeError`` naming the argument (their truth is a mistake, not an answer)."""
    if value is None or isinstance(value, (str, bytes, bytearray, list, tuple, dict, set, frozenset)):
        raise TypeError(f"{call}: {key} must be True or False, not {type_name(value)}")
    try:
        return bool(value)
    except Exception as exc:  # a tensor or array of several elements: ambiguous
        raise TypeError(f"{call}: {key} must be True or False, not {type_name(value)} ({exc})") from None
