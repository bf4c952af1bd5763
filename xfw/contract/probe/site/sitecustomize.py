"""xfw's probe at interpreter start-up, for a command xfw runs (xfw.contract.probe).

The launcher puts this directory first on the command's PYTHONPATH, so ``site`` imports this file
as ``sitecustomize``; it loads the ``sitecustomize`` it shadows (a distribution's, a site's), then
starts the probe if xfw's variables are set, and does nothing else without them. It never stops
the interpreter: a probe that cannot start says so in one line on stderr and the command runs
unmeasured.
"""

import os
import sys


def _chain() -> None:
    """Run the ``sitecustomize`` further down sys.path, as ``site`` would have without this one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as err:  # what site itself does with a failing sitecustomize
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(err).__name__}: {err}",
              file=sys.stderr)


def _start() -> None:
    if not os.environ.get("XFW_PROBE_SPEC"):
        return
    try:
        from xfw.contract.probe import activate

        activate()
    except Exception as err:  # the command still runs; the run will say nothing was measured
        print(f"xfw probe: not active ({type(err).__name__}: {err})", file=sys.stderr)


_chain()
_start()
