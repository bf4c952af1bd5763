"""The multi-process launcher the JAX adapter describes (``describe()["launcher"]``): one process per
rank of this node, each ``python -m xfw_jax ARGS`` with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the
coordinator's address (``xfw_jax.parallel.COORDINATOR``, for ``jax.distributed.initialize``)::

    python -m xfw_jax.launch --nnodes 1 --node_rank 0 --master_addr 127.0.0.1 --master_port 29500 \\
        --nproc_per_node 2 -- --spec RUN/spec.json --records RUN/steps.jsonl

It waits for every rank; when one fails, the others get 30 s to finish and are then stopped (a rank
blocked in a collective would wait for ever). Its exit code is the first failing rank's, else 0. A
SIGTERM (xfw's timeout) is passed on to every rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from xfw_jax.parallel import COORDINATOR

GRACE_S = 30.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--nnodes", "--node_rank", "--master_port", "--nproc_per_node"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the adapter's arguments")
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    world = args.nnodes * args.nproc_per_node
    procs = []
    for local in range(args.nproc_per_node):
        env = {**os.environ, "RANK": str(args.node_rank * args.nproc_per_node + local), "LOCAL_RANK": str(local),
               "WORLD_SIZE": str(world), COORDINATOR: f"{args.master_addr}:{args.master_port}"}
        procs.append(subprocess.Popen([sys.executable, "-m", "xfw_jax", *rest], env=env))

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status, failed_at = 0, None
    while any(p.poll() is None for p in procs):
        codes = [p.poll() for p in procs]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    for p in procs:
        status = status or p.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
