"""fusionguard's start-up hook (put first on PYTHONPATH by ``fusionguard run``): honour
``FUSIONGUARD`` in this process, then run the ``sitecustomize`` this file hides, if any.

Every Python process under ``fusionguard run`` runs this, torch or not: it imports nothing that
a bare interpreter has not already imported but ``importlib.machinery`` (no ``importlib.util``,
no ``typing``: ~2.5 ms and ~2-4 ms of start-up; ``benchmarks/startup.py``, docs/internals.md).
"""


def _fusionguard_startup() -> None:
    import os  # lazy: runs in every Python process: it imports little
    import sys  # lazy: runs in every Python process: it imports little

    def _fusionguard_exec(loader, path, spec=None):  # (untyped: typing costs start-up time)
        """What ``importlib.util.module_from_spec`` + ``exec_module`` do, without importing
        ``importlib.util`` (it imports ``contextlib``, ``functools`` and ``collections``)."""
        from importlib.machinery import ModuleSpec  # lazy: runs in every Python process: it imports little

        if spec is None:
            spec = ModuleSpec(loader.name, loader, origin=path)
            spec.has_location = True
        module = loader.create_module(spec) if hasattr(loader, "create_module") else None
        if module is None:
            module = type(sys)(spec.name)
        module.__spec__ = spec
        module.__loader__ = loader
        if spec.has_location:
            module.__file__ = spec.origin
            if spec.cached:
                module.__cached__ = spec.cached
        sys.modules[spec.name] = module
        loader.exec_module(module)
        return module

    def _fusionguard_launch(mode):
        """The launcher's ``enable()``, run by ``activate.py`` once torch is imported."""
        import fusionguard  # lazy: only once torch is imported (the package costs ~0.1 s)
        from fusionguard import _lifecycle  # lazy: as above

        # the program enabled it itself, or is doing so right now (its enable() imported torch):
        # its settings stand
        if not fusionguard.is_enabled() and not _lifecycle.enabling:
            _lifecycle.enable_as("launcher", mode=mode)

    here = os.path.dirname(os.path.abspath(__file__))
    mode = os.environ.get("FUSIONGUARD", "").strip().lower()
    if mode and mode != "off":  # "off" acts in enable(); unset: nothing to do, nothing imported
        try:  # activate.py alone, by path: importing the fusionguard package costs ~0.1 s
            from importlib.machinery import SourceFileLoader  # lazy: only when FUSIONGUARD is set

            path = os.path.join(os.path.dirname(here), "activate.py")
            # (the name is activate.HOOK_COPY: the package's copy shares its notes said once)
            activate = _fusionguard_exec(SourceFileLoader("_fusionguard_activate", path), path)
            activate.startup(_fusionguard_launch)
        except Exception as exc:  # fusionguard not importable here: never break the program
            try:
                sys.stderr.write(f"fusionguard: start-up hook skipped ({type(exc).__name__}: {exc})\n")
            except Exception:
                pass
    # Chain: the sitecustomize that would have run without us (a distro's, a venv's, ddtrace's).
    from importlib.machinery import PathFinder

    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    _fusionguard_exec(spec.loader, spec.origin, spec)  # its errors surface as they would have (site.py reports them)


_fusionguard_startup()
del _fusionguard_startup
