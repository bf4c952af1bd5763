"""What one Slurm job runs (``python -m xfw.run.launch.slurm_job PAYLOAD``, written by :mod:`xfw.run.launch.slurm`):
one run of one backend, as :func:`xfw.run.launch.launcher.launch` runs it locally, into the ordinary run
directory. A path the job cannot reach (the checkout, the out directory, the backend's interpreter)
ends it at once with one line naming the path (exit 3), which xfw reports as the run's reason.
SIGTERM (scancel, the time limit) is Ctrl-C: the adapter is stopped and the run recorded as cut off."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _first_node_addr() -> str:
    """The address of the allocation's first node (its NodeAddr: node names need not resolve)."""
    import subprocess

    names = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True).stdout.split()
    fields = subprocess.run(["scontrol", "show", "node", "-o", names[0]], capture_output=True, text=True).stdout.split()
    return dict(f.split("=", 1) for f in fields if "=" in f).get("NodeAddr", names[0])


def main(argv: list[str]) -> int:
    """Each payload's run in turn (several: an A/B's alternated pairs, in their order on this node); a run
    cut off (scancel, the time limit) ends the job there."""
    signal.signal(signal.SIGTERM, _interrupt)
    code = 0
    for path in argv:
        code = _one(Path(path)) or code
        if code == 130:
            break
    return code


def _one(payload_path: Path) -> int:
    try:
        payload = json.loads(payload_path.read_text())
    except (OSError, ValueError, IndexError) as err:
        print(f"xfw slurm job: cannot read its payload {payload_path}: {err}", flush=True)
        return 3
    for what, path in (("checkout", payload["checkout"]), ("out directory", payload["run_dir"]),
                       ("interpreter", payload["python"])):
        if not os.path.exists(path):
            print(f"xfw slurm job on {os.uname().nodename}: cannot reach the {what} {path}", flush=True)
            return 3
    from xfw.recipe.load import recipe_from_dict
    from xfw.run.launch import launcher

    recipe = recipe_from_dict(payload["recipe"], str(payload_path))
    backend = launcher.Backend(payload["backend"], payload["python"])
    rendezvous, run_dir = launcher.Rendezvous(master_port=payload["rendezvous"].get("master_port")), Path(payload["run_dir"])
    if recipe.parallel.nnodes > 1:  # one task per node (srun): this node's part, rendezvous at the allocation's first node
        rank = int(os.environ.get("SLURM_NODEID", "0"))
        rendezvous = launcher.Rendezvous(node_rank=rank, master_addr=_first_node_addr(),
                                         master_port=rendezvous.master_port)
        run_dir = run_dir.parent / f"node-{rank}"
    try:
        result = launcher.launch(recipe, backend, run_dir, description=payload["description"],
                                 repeat_index=payload["repeat_index"], rendezvous=rendezvous,
                                 variant=payload["variant"])
    except launcher.Interrupted as stop:
        print(f"xfw slurm job: cut off ({stop.result.reason})", flush=True)
        return 130
    print(f"xfw slurm job: {result.status} {result.reason}".rstrip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
