"""A multi-node run, assembled from the parts its nodes wrote.

Each node of a multi-node run starts its own xfw (``xfw run RECIPE --node-rank R --master-addr
HOST --master-port P``), which runs that node's ranks and writes their records as one *part*::

    OUT/<recipe>/<backend>/node-0/{spec.json, steps.jsonl, summary.json, ...}    ranks 0..7
    OUT/<recipe>/<backend>/node-1/...                                           ranks 8..15

On a shared filesystem every part lands under one ``OUT``; otherwise each node has its own and
``xfw assemble DIR0 DIR1 --out DIR`` (or ``xfw report DIR0 DIR1``) brings them together. Parts are
matched by recipe, backend, repeat, variant and settings, wherever they are, and become one run:
every rank's records, the global throughput (the sum over ranks, as for one node), and a status
that is ok only when every node's part is ok and every rank measured its window::

    runs = assemble([RunResult.load(d) for d in part_dirs])    # single-node runs pass through
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from xfw.contract import records as rec
from xfw.contract.atomic import UnreadableFile, read_json_object
from xfw.report.measure import summarize
from xfw.report.results import RunResult, distinguish_configurations, find_run_dirs, mfu_fields


def _key(r: RunResult) -> str:
    return json.dumps([r.recipe, r.backend, r.repeat_index, r.variant, r.setup], sort_keys=True, default=str)


def assemble(results: list[RunResult]) -> list[RunResult]:
    """Runs in the order first seen, each multi-node run's parts replaced by the assembled run."""
    groups: dict[str, list[RunResult]] = {}
    order: list[tuple[str, RunResult | None]] = []
    for r in results:
        if "rank" not in r.node:
            order.append(("", r))
            continue
        key = _key(r)
        if key not in groups:
            order.append((key, None))
        groups.setdefault(key, []).append(r)
    return [r if r is not None else assemble_parts(groups[key]) for key, r in order]


def assemble_parts(parts: list[RunResult]) -> RunResult:
    """One run from its nodes' parts (some may be missing: then it is ``incomplete``, saying which)."""
    parts = sorted(parts, key=lambda p: p.node["rank"])
    count = parts[0].node["count"]
    records, problems, spec = [], [], {}
    for part in parts:
        found, problem = rec.read_records(Path(part.run_dir) / "steps.jsonl")
        records += found
        problems += [problem] if problem else []
        try:
            spec = spec or read_json_object(Path(part.run_dir) / "spec.json")
        except UnreadableFile as err:
            problems.append(str(err))
    measurement = summarize(records)
    have = sorted({p.node["rank"] for p in parts})
    failed = next((p for p in parts if not p.ok), None)
    if problems:
        status, reason = "unreadable", problems[0]
    elif failed is not None:
        status, reason = failed.status, f"node {failed.node['rank']}: {failed.reason}"
    elif len(have) < count:
        missing = [n for n in range(count) if n not in have]
        status, reason = "incomplete", (f"the parts of node {', '.join(map(str, missing))} of {count} are not "
                                        f"here; when every node has finished: xfw assemble <each node's --out> "
                                        f"--out DIR")
    elif measurement.num_ranks < parts[0].setup.get("num_processes", 1):
        status, reason = "incomplete", (f"a measured window for {measurement.num_ranks} of "
                                        f"{parts[0].setup.get('num_processes')} ranks")
    else:
        status, reason = "ok", ""
    first = parts[0]
    applied = rec.applied_settings(records)
    return RunResult(
        backend=first.backend, recipe=first.recipe, preset=first.preset, stage=first.stage, status=status,
        reason=reason, measurement=measurement, applied=applied, env=first.env,
        **mfu_fields(spec, measurement, applied), exit_code=first.exit_code,
        wall_time_s=max((p.wall_time_s or 0.0 for p in parts), default=None), repeat_index=first.repeat_index,
        run_dir=str(Path(first.run_dir).parent), variant=dict(first.variant), setup=dict(first.setup),
        node={"count": count, "parts": [p.run_dir for p in parts]},
    )


def load_runs(paths: list[str | os.PathLike]) -> list[RunResult]:
    """Every run at or below ``paths``; the parts of a multi-node run (wherever each node wrote its
    own) assembled into one run (:func:`assemble`)."""
    return distinguish_configurations(assemble([RunResult.load(d) for d in find_run_dirs(paths)]))
