"""Per-job overhead from the run directories measure.sh left. Under Slurm: submission (slurm.json) to the
job running xfw (env.json's date, 1 s resolution; the smallest is the scheduler's own latency, the others
include waiting for a free node) and job start to the adapter's first step. Locally: the run's start
(env.json's date) to its first step. A first step is the adapter's start record plus step 0's time."""

import datetime as dt
import json
import statistics
import sys
from pathlib import Path


def first_step(run: Path) -> float:
    start = step0 = None
    for line in (run / "steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "start" and start is None:
            start = rec["t_unix_s"]
        if rec.get("kind") == "step" and step0 is None:
            step0 = rec["step_time_s"]
    return start + step0


def began(run: Path) -> float:
    date = json.loads((run / "env.json").read_text())["date_utc"]
    return dt.datetime.strptime(date, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


def line(name: str, values: list[float]) -> str:
    return f"{name}: median {statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f})"


for root in sys.argv[1:]:
    runs = [p.parent for p in sorted(Path(root).rglob("steps.jsonl")) if (p.parent / "env.json").exists()]
    to_step = [first_step(r) - began(r) for r in runs]
    parts = [f"{root}: {len(runs)} runs", line("run start -> first step", to_step)]
    queued = [began(r) - json.loads((r / "slurm.json").read_text())["submitted_unix"]
              for r in runs if (r / "slurm.json").exists()]
    if queued:
        parts.append(line("submission -> job running xfw", queued))
    print("; ".join(parts))
