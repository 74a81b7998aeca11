"""fusionguard's start-up hook (put first on PYTHONPATH by ``fusionguard run``): honour
``FUSIONGUARD`` in this process, then run the ``sitecustomize`` this file hides, if any."""


def _fusionguard_startup() -> None:
    import os  # lazy: runs in every Python process: it imports little
    import sys  # lazy: runs in every Python process: it imports little

    here = os.path.dirname(os.path.abspath(__file__))
    mode = os.environ.get("FUSIONGUARD", "").strip().lower()
    if mode and mode != "off":  # "off" acts in enable(); unset: nothing to do, nothing imported
        try:  # activate.py alone, by path: importing the fusionguard package costs ~0.1 s
            import importlib.util  # lazy: runs in every Python process: it imports little

            spec = importlib.util.spec_from_file_location("_fusionguard_activate", os.path.join(os.path.dirname(here), "activate.py"))
            if spec is None or spec.loader is None:
                raise ImportError("fusionguard/activate.py not found")
            activate = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = activate
            spec.loader.exec_module(activate)
            activate.startup()
        except Exception as exc:  # fusionguard not importable here: never break the program
            try:
                sys.stderr.write(f"fusionguard: start-up hook skipped ({type(exc).__name__}: {exc})\n")
            except Exception:
                pass
    # Chain: the sitecustomize that would have run without us (a distro's, a venv's, ddtrace's).
    import importlib.machinery
    import importlib.util  # lazy: runs in every Python process: it imports little

    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)  # its errors surface as they would have (site.py reports them)


_fusionguard_startup()
del _fusionguard_startup
