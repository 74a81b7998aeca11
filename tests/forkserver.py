"""A fork server for the tests' child Pythons (#34): one process per pytest worker imports torch,
Dynamo and Inductor once and runs Inductor's CPU vector-ISA check (about 5 CPU s, no kernel
compiled, no fusionguard), then forks a fresh grandchild per request that runs a script, a
``python -c`` body or a ``python -m`` module with the request's argv, env and cwd, its stdio on
the caller's pipes. ``run()`` and ``popen()`` read like ``subprocess.run`` and ``subprocess.Popen``.

Use it where the child only needs to be a separate process (fusionguard's process-wide state, a
crash, a SIGKILL, several writers at once), never where the interpreter's start is the point: the
start-up hook, ``fusionguard run``, import-time behaviour, spawn children, torchrun.
A request it cannot serve exactly runs as a real subprocess instead: an argv that is not
``[sys.executable, "-c", code, ...]``, ``[sys.executable, "-m", module, ...]`` or
``[sys.executable, script, ...]``, or an environment that
differs from the server's in a variable that Python or torch read while the server started
(``TORCH_LOGS``, ``OMP_NUM_THREADS``, ``PYTHON*`` but PYTHONPATH, ...). Inductor's cache directory
and ``CUDA_VISIBLE_DEVICES`` are read later, in the grandchild.

Run as a script, this file is the server; it imports nothing of fusionguard or of the tests."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx")
# Read when Python or the preloaded modules start; a request that changes one gets a real subprocess.
_STARTUP_PREFIXES = (
    "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP", "CUDA", "NCCL", "LD_", "PYTHON", "TRITON", "MALLOC",
    "TMPDIR", "CXX", "CC", "COVERAGE_PROCESS_START",  # (tempfile, Inductor's config, coverage's start)
)  # fmt: skip
# Read later, in the grandchild. PYTORCH_NVML_BASED_CUDA_CHECK is read at each
# ``torch.cuda.is_available()``; Lightning sets it when imported, and the suite's collection imports
# Lightning: taken as read at start-up, it sent every child of the suite to a fresh interpreter.
_LATE = {"PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK"}


# --- The server (this file run as a script) --------------------------------------------------


def _cpu_self() -> float:
    """This process's CPU seconds and its waited-for children's (the vector-ISA check's)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _vec_isa() -> None:
    """Inductor's CPU vector-ISA check, once, before any fork: each process runs it at its first
    C++ compile (a probe library per ISA, built in the cache directory, then a ``python -c`` child
    per ISA that loads it; cached for the process). 1.4 CPU s in a grandchild, 11 in a grandchild
    with a cold private cache directory; now inherited. No kernel, graph or cache entry of a test
    is made (the probe libraries go to the session's cache directory)."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()


def _serve(sock_path: str) -> None:
    import importlib
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    _vec_isa()
    threads = len(os.listdir("/proc/self/task"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    base_path = sys.path[1:]  # (sys.path[0] is the -c launch's, the working directory)
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if entry in base_path:
            base_path.remove(entry)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")  # the client closes it: the server ends
    conns: set = set()
    print(json.dumps({"cpu": _cpu_self(), "threads": threads, "threading": threading.active_count()}), flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                req = json.loads(buf)
                sys.stdout.flush()
                sys.stderr.flush()
                if len(os.listdir("/proc/self/task")) != 1:  # never fork a process with threads
                    conn.sendall(b'{"error": "threads"}\n')
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    for other in (listener, *conns, conn):
                        other.close()
                    sel.close()
                    _child(req, fds, base_path)  # never returns
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                pidfd = os.pidfd_open(pid)
                conns.add(conn)
                sel.register(pidfd, selectors.EVENT_READ, (conn, pid))
            else:
                conn, pid = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status, ru = os.wait4(pid, 0)
                conns.discard(conn)
                try:
                    conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status), "cpu": ru.ru_utime + ru.ru_stime}).encode() + b"\n")
                except OSError:
                    pass  # (the caller went away)
                conn.close()


def _child(req: dict, fds: list, base_path: list) -> None:
    """In the grandchild: the caller's stdio, env, cwd, argv and sys.path, then the script, then
    what the interpreter does at exit (join threads, atexit, flush)."""
    import atexit
    import signal
    import threading
    import types

    code, interrupted = 1, False
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = req["argv"]
        if argv[0] == "-c":
            source, filename, sys.argv, path0 = argv[1], "<string>", ["-c", *argv[2:]], ""
        elif argv[0] == "-m":  # (as ``python -m``: the working directory first, runpy finds and runs the module)
            source, filename, sys.argv, path0 = "import runpy\nrunpy._run_module_as_main(MODULE)", "<-m>", ["-m", *argv[2:]], os.getcwd()
        else:
            filename = argv[0]
            # (bytes: compile() reads a coding cookie and a BOM, as Python does for a script)
            source, sys.argv, path0 = Path(filename).read_bytes(), list(argv), os.path.dirname(os.path.realpath(filename))
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [path0, *extra, *base_path]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        if argv[0] == "-m":
            main.__dict__["MODULE"] = argv[
                1
            ]  # (runpy runs the module in this namespace, as __main__, and sets its __file__ and sys.argv[0])
        elif argv[0] != "-c":
            main.__dict__.update(__file__=filename, __cached__=None)
        sys.modules["__main__"] = main
        try:
            exec(compile(source, filename, "exec"), main.__dict__)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            kind, value, tb = sys.exc_info()
            for _ in range(2 if argv[0] == "-m" else 1):  # (the traceback starts in the script, or in runpy, as Python's)
                tb = tb.tb_next if tb is not None else tb
            if value is not None:
                value.__traceback__ = tb
            sys.excepthook(kind, value, tb)
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # (as Py_FinalizeEx: non-daemon threads, then atexit)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    finally:
        if interrupted:  # (Python ends by SIGINT after an uncaught KeyboardInterrupt)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)  # (sys.exit(-1) is 255, as in Python)


# --- The client (imported by the tests) ------------------------------------------------------

CHILD_CPU = 0.0  # CPU seconds of the server's start and of the finished grandchildren (benchmarks/pytest_cpu.py reads it)
_server: dict = {}


_START_ENV = dict(os.environ)  # (conftest imports this module at its start: no test's monkeypatch in it)


def _base_env() -> dict:
    """The server's environment: the session's, as conftest.child_env makes it for a child."""
    env = dict(_START_ENV)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    for name in ("FUSIONGUARD_LOG", "FUSIONGUARD"):
        env.pop(name, None)
    return env


# The server runs compiled under a name in angle brackets, as ``python -c`` code is: fusionguard
# (and Python's warnings) take no such frame for the user's, so a grandchild's stack below its own
# code holds no frame that a fresh interpreter lacks (a ``-c`` child's call sites were this file's).
# linecache keeps the source for the traceback module (pytest, warnings); Python's own printer of
# an uncaught error in the server shows the file name and line, not the source line.
_LAUNCH = """import linecache, sys
path = sys.argv.pop(1)
name = f"<fork server {path}>"
source = open(path, encoding="utf-8").read()
linecache.cache[name] = (len(source), None, source.splitlines(True), name)
exec(compile(source, name, "exec"))
"""


def _start() -> dict | None:
    global CHILD_CPU
    if _server:
        return _server.get("ok")
    _server["ok"] = None
    tmp = tempfile.mkdtemp(prefix="fg-forkserver-")
    sock = os.path.join(tmp, "s")
    env = _base_env()
    # Its preloads import torch.utils.cpp_extension, which asks torch.cuda.is_available() where a
    # CUDA toolkit is found: through NVML, so that no CUDA driver call is made in the server and its
    # forks can use the GPU ("Cannot re-initialize CUDA in forked subprocess" otherwise).
    start_env = dict(env, PYTORCH_NVML_BASED_CUDA_CHECK="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, __file__, sock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=start_env, cwd=tmp
    )
    line = proc.stdout.readline() if proc.stdout else b""
    if not line:
        proc.wait()
        _server["why"] = f"it exited ({proc.returncode}) before it was ready"
        return None
    hello = json.loads(line)
    CHILD_CPU += hello["cpu"]
    if hello["threads"] != 1:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait()
        _server["why"] = f"its preloads left {hello['threads']} threads running and it never forks a process with threads"
        return None
    _server["ok"] = {"proc": proc, "sock": sock, "env": env}
    import atexit

    atexit.register(_stop)
    return _server["ok"]


def _stop() -> None:
    import shutil

    server = _server.get("ok")
    if server:
        server["proc"].stdin.close()
        server["proc"].wait(30)
        shutil.rmtree(os.path.dirname(server["sock"]), ignore_errors=True)
        _server["ok"] = None


def why_not(args, env: dict | None, cwd=None) -> str | None:
    """Why this request runs as a real subprocess (None: the server can fork it)."""
    args = list(map(str, args))
    if len(args) < 2 or args[0] != sys.executable:
        return "not this Python"
    if args[1].startswith("-") and args[1] not in ("-c", "-m"):
        return f"interpreter option {args[1]}"
    if args[1] in ("-c", "-m") and len(args) < 3:
        return f"{args[1]} without an argument"
    if not args[1].startswith("-") and not os.path.isfile(os.path.join(str(cwd or os.getcwd()), args[1])):
        return "the script is no file (Python runs a directory's __main__ or says it is missing)"
    server = _start()
    if server is None:
        return f"no fork server: {_server.get('why')}"
    theirs, ours = server["env"], env if env is not None else os.environ
    for name in set(theirs) | set(ours):
        if name.startswith(_STARTUP_PREFIXES) and name not in _LATE and theirs.get(name) != ours.get(name):
            return f"{name} read at start-up"
    added = set(filter(None, ours.get("PYTHONPATH", "").split(os.pathsep))) - set(theirs.get("PYTHONPATH", "").split(os.pathsep))
    for entry in sorted(added):  # (a sitecustomize runs when an interpreter starts: fusionguard's start-up hook)
        if any(os.path.exists(os.path.join(entry, f"{name}.py")) for name in ("sitecustomize", "usercustomize")):
            return f"PYTHONPATH adds {entry}, whose sitecustomize runs at start-up"
    return None


class Forked:
    """A grandchild of the fork server, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, args, env, cwd, stdin, stdout, stderr, text):
        server = _start()
        assert server is not None
        self.args, self.returncode = args, None
        ends, self.stdin, self.stdout, self.stderr = [], None, None, None
        mode = {"encoding": "utf-8", "errors": "strict"} if text else {}
        for i, want in enumerate((stdin, stdout, stderr)):
            if want == subprocess.PIPE:
                r, w = os.pipe()
                mine, theirs = (w, r) if i == 0 else (r, w)
                setattr(self, ("stdin", "stdout", "stderr")[i], open(mine, ("w" if i == 0 else "r") + ("" if text else "b"), **mode))
                ends.append((theirs, True))
            elif want == subprocess.STDOUT and i == 2:
                ends.append((ends[1][0], False))
            elif want == subprocess.DEVNULL or (want is None and i == 0):
                ends.append((os.open(os.devnull, os.O_RDWR), True))
            elif want is None:
                ends.append((i, False))  # (this process's stdout or stderr, as Popen inherits them)
            else:
                ends.append((want if isinstance(want, int) else want.fileno(), False))
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(server["sock"])
        socket.send_fds(self._conn, [b"x"], [fd for fd, _ in ends])
        argv = list(map(str, args))[1:]
        request = {"argv": argv, "env": dict(env if env is not None else os.environ), "cwd": str(cwd or os.getcwd())}
        self._conn.sendall(json.dumps(request).encode() + b"\n")
        for fd, own in ends:
            if own:
                os.close(fd)
        self._buf = b""
        reply = json.loads(self._line(None))
        if "pid" not in reply:
            raise OSError(f"fork server: {reply}")
        self.pid = reply["pid"]

    def _line(self, timeout) -> bytes:
        self._conn.settimeout(timeout)
        while b"\n" not in self._buf:
            try:
                chunk = self._conn.recv(4096)
            except (socket.timeout, TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise OSError("the fork server went away")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _read_rc(self, timeout):
        global CHILD_CPU
        reply = json.loads(self._line(timeout))
        CHILD_CPU += reply["cpu"]
        self.returncode = reply["rc"]
        self._conn.close()

    def poll(self):
        if self.returncode is None:
            try:
                self._read_rc(0.0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self._read_rc(timeout)
        return self.returncode

    def communicate(self, input=None, timeout=None):
        if self.stdin:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict = {}
        sel = selectors.DefaultSelector()
        for f in (self.stdout, self.stderr):
            if f is not None and not f.closed:
                sel.register(f.fileno(), selectors.EVENT_READ, f)
                chunks[f] = []
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.data].append(data)
                else:
                    sel.unregister(key.fd)
        sel.close()
        outs = []
        for f in (self.stdout, self.stderr):
            if f is None or f not in chunks:
                outs.append(None)
                continue
            data = b"".join(chunks[f])
            outs.append(data.decode("utf-8") if "b" not in f.mode else data)
            f.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple(outs)

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self):
        import signal

        self.send_signal(signal.SIGKILL)

    def terminate(self):
        import signal

        self.send_signal(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdout, self.stderr, self.stdin):
            if f is not None:
                f.close()
        self.wait()


def popen(args, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False):
    """``subprocess.Popen(args, ...)``, forked from the server where it can be."""
    if why_not(args, env, cwd):
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text)
    return Forked(args, env, cwd, stdin, stdout, stderr, text)


def run(args, *, env=None, cwd=None, capture_output=False, text=False, timeout=None, check=False, input=None):
    """``subprocess.run(args, ...)``, forked from the server where it can be."""
    if why_not(args, env, cwd):
        return subprocess.run(args, env=env, cwd=cwd, capture_output=capture_output, text=text, timeout=timeout, check=check, input=input)
    pipe = subprocess.PIPE if capture_output else None
    proc = Forked(args, env, cwd, subprocess.PIPE if input is not None else None, pipe, pipe, text)
    try:
        out, err = proc.communicate(input, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":  # (started by _start through _LAUNCH)
    _serve(sys.argv[1])
