"""XLA's flags, set from the spec before JAX is imported (XLA reads ``XLA_FLAGS`` once, at start).

``measure.cpu_threads``: xfw sets ``OMP_NUM_THREADS`` for every backend; XLA's CPU backend ignores it
and runs an Eigen thread pool of its own, so one thread is asked for with XLA's flags as well
(``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``). A variable the recipe set
itself (``backends.jax.env.XLA_FLAGS``) is kept and these are added after it.
"""

from __future__ import annotations

import json
import os

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def configure(argv: list[str]) -> None:
    try:
        with open(argv[argv.index("--spec") + 1], encoding="utf-8") as f:
            spec = json.load(f)
    except (ValueError, IndexError, OSError):
        return  # --describe, or a spec the harness reports itself
    if not isinstance(spec, dict):
        return
    threads = (spec.get("measure") or {}).get("cpu_threads")
    if threads == 1:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {ONE_THREAD}".strip()
