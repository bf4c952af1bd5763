"""Where each side's numbers come from, as every compare page shows it under the table: the
settings each side applied (differences flagged, deliberate ones named, knobs a side could not
carry out marked), the parity run's line, and the provenance table (start, data, code, machine,
build). Pure functions from :mod:`xfw.report.compare` rows to page blocks."""

from __future__ import annotations

import json

from xfw.report.comparison import one_framework
from xfw.report.compare import ComparisonRow, row_name
from xfw.report.table import Heading, Paragraph, Table


def parity_line(status: dict) -> str:
    """One line on a recipe's parity run: passed/failed, steps, worst relative differences, where."""
    if status["status"] == "none":
        return "Parity: no parity run" + (f" ({status['note']})" if status.get("note") else "") + "."
    worst = status.get("worst") or {}
    text = f"Parity: {'passed' if status['status'] == 'passed' else '**failed**'}, {status['num_steps']} steps"
    if status["status"] == "failed" and status.get("first_failing_step") is not None:
        text += f", first step outside tolerance {status['first_failing_step']}"
    if worst.get("loss_rel_diff") is not None:
        text += f"; worst relative loss difference {worst['loss_rel_diff']:.1e} (step {worst['loss_step']})"
    if worst.get("grad_norm_rel_diff") is not None:
        text += f", gradient norm {worst['grad_norm_rel_diff']:.1e} (step {worst['grad_norm_step']})"
    return f"{text} — `{status['path']}`."


def settings_blocks(rows: list[ComparisonRow], backends: list[str]) -> list:
    """Per row: its parity line (when looked up) and the applied settings side by side; rows whose
    settings and parity are the same (the points of a sweep, often) share one table."""
    groups: list[tuple[str, list[ComparisonRow]]] = []
    for row in rows:
        if not row.settings and row.parity is None and not row.data_line:
            continue
        key = json.dumps([row.settings, row.differing, row.parity, row.data_line], sort_keys=True, default=str)
        same = next((g for k, g in groups if k == key), None)
        if same is None:
            groups.append((key, [row]))
        else:
            same.append(row)
    blocks: list = []
    for _, group in groups:
        row = group[0]
        names = [row_name(r) for r in group]
        heading = names[0] if len(names) == 1 else (
            f"All {len(names)} rows" if len(group) == len(rows) else
            ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
        blocks.append(Heading(heading, level=4))
        if row.parity is not None and not (one_framework(backends) and row.parity["status"] == "none"):
            blocks.append(Paragraph(parity_line(row.parity)))  # two builds: no cross-framework parity to miss
        if row.data_line:
            blocks.append(Paragraph(row.data_line))
        if row.settings:
            cells = [[key, *(str(values.get(b, "–")) for b in backends), knob_not_run(row, key) or (
                      "⚠ differs" if key in row.differing else
                      "deliberate (" + ", ".join(f"backends.{b}.override" for b in row.deliberate_by[key]) + ")"
                      if key in row.deliberate_by else
                      _SETTING_NOTES.get(key, "") if len({repr(v) for v in values.values()}) > 1 else "")]
                     for key, values in row.settings.items()]
            blocks.append(Table(header=["Setting", *backends, ""], cells=cells, name="settings", csv=False))
    return blocks


def knob_not_run(row: ComparisonRow, key: str) -> str:
    """For a ``knob.<name>`` row: ``⚠ not what ran on torch: asked true: a CPU has no TF32`` where a side's
    adapter could not carry the knob out here (``applied.not_honoured``); "" otherwise."""
    if not key.startswith("knob."):
        return ""
    knob = key.removeprefix("knob.").split(".")[0]
    notes = [f"{name}: {side.applied['not_honoured'][knob]}" for name, side in row.sides.items()
             if knob in ((side.applied or {}).get("not_honoured") or {})]
    return f"⚠ not what ran ({'; '.join(notes)})" if notes else ""


_SETTING_NOTES = {"mem_source": "differs: each framework's own memory figure (an extra in the CSV, extra_own_*), "
                                "not the memory compared above",
                  "adapter_notes": "each adapter's own record of what it ran (applied.notes in summary.json)"}


def _start(setup: dict) -> str:
    if setup.get("weights") in (None, "random"):
        return f"random init (seed {setup.get('seed', '?')})"
    return f"{setup['weights']} ({setup.get('weights_fingerprint') or 'no fingerprint'})"


def _seen(applied: dict) -> dict:
    """An attached side's framework as its probe saw it, with the libraries it saw imported."""
    framework = applied.get("framework")
    if not framework:
        return {"framework": "not seen"}
    libraries = ", ".join(f"{k.removeprefix('version_')} {v}" for k, v in applied.items()
                          if k.startswith("version_") and k.removeprefix("version_") not in (framework, "paddlepaddle"))
    return {"framework": framework, "framework_version": str(applied.get("framework_version", "?"))
            + (f" ({libraries})" if libraries else ""), "device_name": applied.get("device_name")}


def _attached_data(applied: dict) -> str:
    """An attached side's data: the command's own, and how its samples were counted."""
    notes = str(applied.get("notes", ""))
    counted = next((n.strip() for n in notes.split(";") if n.strip().startswith("samples ")), "")
    return "the command's own" + (f" ({counted})" if counted else "")


def _data(setup: dict) -> str:
    data = setup.get("data") or {}
    if data.get("kind", "synthetic") == "synthetic":
        return f"synthetic (seed {data.get('seed', '?')})"
    parts = [data.get("kind", "?"), str(data.get("path", "?"))]
    parts += [f"({data['fingerprint']})"] if data.get("fingerprint") else []
    parts += [f"{data['num_samples']:,} samples"] if isinstance(data.get("num_samples"), int) else []
    return " ".join(parts)


def provenance_table(rows: list[ComparisonRow], backends: list[str]) -> Table:
    """Where each side's numbers come from: the start (weights), the data, the code, the machine."""
    cells, records = [], []
    for row in rows:
        for name in backends:
            side = row.sides[name]
            if not side.setup and not side.env:
                continue
            env, described = side.env or {}, (side.env or {}).get("backend", {})
            sha = env.get("xfw_git_sha") or "–"
            if "command" in described:  # a command xfw attached to: what its probe saw, not the recipe's
                described = {**described, **_seen(side.applied or {})}
            record = {"row": row_name(row), "backend": name,
                      "weights": "the command's own" if "command" in described else _start(side.setup),
                      "data": _attached_data(side.applied or {}) if "command" in described else _data(side.setup),
                      "xfw_commit": sha[:12] + ("-dirty" if sha.endswith("-dirty") else ""),
                      "host": env.get("host", {}).get("hostname", "–"),
                      "device": described.get("device_name") or side.device or "–",
                      "framework": f"{described.get('framework', name)} {described.get('framework_version', '?')}",
                      "build": fmt_build(described.get("build")),
                      "started_utc": env.get("date_utc", "–")}
            cells.append(list(record.values()))
            records.append(record)
    return Table(header=["Row", "Backend", "Start (weights)", "Data", "xfw commit", "Host", "Device", "Framework",
                         "Build", "Started (UTC)"], cells=cells, records=records, name="provenance", csv=False)


def fmt_build(build: dict | None) -> str:
    """A backend's build as every report names it: its commit, the wheel's hash, where it came from
    (``xfw.workflow.base.build_facts``); "–" for runs recorded before builds were."""
    if not build:
        return "–"
    parts = [f"commit {build['commit'][:12]}" if build.get("commit") else "no commit recorded",
             *([f"wheel sha256 {build['wheel_sha256'][:12]}"] if build.get("wheel_sha256") else []),
             str(build.get("source") or "")]
    return ", ".join(p for p in parts if p)
