"""The nightly history store: one JSON line per (night, entry, backend, repeat), in ``DIR/history.jsonl``.

Why JSON lines and not Parquet: pandas reads it directly (``pd.read_json(path, lines=True)``)
with nothing beyond pandas (Parquet needs pyarrow, ~100 MB, in the CLI's environment); a person
can grep it; a column added next month does not invalidate last year's lines; and at 24 lines
a night it stays a few MB a year, small enough to rewrite whole::

    >>> import pandas as pd
    >>> df = pd.read_json("nightly/history.jsonl", lines=True)
    >>> df.pivot_table(index="night", columns=["entry", "backend"], values="ips")

Writes are atomic: :meth:`History.upsert` rewrites the file to a temporary name, fsyncs and
renames it over the old one, so a job killed at any moment leaves the previous file or the new
one, never half a line. A row is keyed by (night, entry, backend, repeat_index); writing the same
key again replaces it, so a resumed night never counts a run twice.

A converge entry's rows (its speed runs) carry its learning curves' outcome beside the usual fields
(:func:`converge_fields`): ``final_eval_loss`` (mean over seeds) with ``final_eval_loss_std`` and
``final_eval_loss_n``, ``time_to_target_s`` and ``samples_to_target``, the night's own verdict between
the sides, and ``converge`` (its settings). Rows without them (every older row) load as before.
"""

from __future__ import annotations

import copy
import datetime as dt
import errno
import hashlib
import json
import math
import os
from pathlib import Path

from xfw.report.results import RunResult
from xfw.contract.atomic import UnreadableFile, read_bounded, write_text_atomic

HISTORY_SCHEMA = 1
HISTORY_MAX_BYTES = 1 << 30
"""history.jsonl is read whole; a larger one (or a FIFO or device in its place) is refused in one line."""
HISTORY_FILE = "history.jsonl"
NIGHTS_DIR = "nights"
"""Under the history directory: one directory per night (``nights/<night>/``), its runs inside."""
KEY = ("night", "entry", "backend", "repeat_index")


def _without_backend_override(spec: dict) -> dict:
    """``spec`` with a backend's own override (``backends.<name>.override``, recorded as ``overrides`` and
    ``overridden``) put back to the recipe's values, where each overridden key is found at its dotted
    place; else ``spec`` unchanged (the override then stays part of the workload)."""
    overridden = spec.get("overridden")
    if not isinstance(overridden, dict) or not overridden:
        return spec
    out = copy.deepcopy({k: v for k, v in spec.items() if k not in ("overrides", "overridden")})
    for key, value in overridden.items():
        node, parts = out, str(key).split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or parts[-1] not in node:
            return spec
        node[parts[-1]] = value
    return out


def workload_fingerprint(spec: dict) -> str:
    """What must be equal for two nights' numbers to be comparable: the model, stage, data, batch,
    precision, parallel layout and measured steps. Backend knobs are left out on purpose (a knob
    turned on is exactly the kind of change a nightly should flag, and it is reported as such), and
    so is a backend's own override of a recipe key (``backends.paddle.override.optimizer.lr``): one side
    changed on purpose is compared with its earlier nights and named in the verdict (``knobs``)."""
    spec = _without_backend_override(spec)
    keep = {k: v for k, v in spec.items()
            if k not in ("run_id", "backend", "backends", "backend_knobs", "backend_env", "measure", "published")}
    comparison = keep.pop("comparison", None)  # like-for-like: what every night before the two comparisons ran
    if isinstance(comparison, dict) and comparison.get("kind") == "published":  # what it applied, not where the file lies
        keep["comparison"] = {k: comparison.get(k) for k in ("kind", "row", "set")}
    keep["measure"] = {k: v for k, v in spec.get("measure", {}).items() if k not in ("timeout_s", "repeat")}
    for dotted, default in ADDED_LATER.items():  # at its default a key added later is the workload it always was
        section, key = dotted.split(".")
        if isinstance(keep.get(section), dict) and keep[section].get(key, default) == default:
            keep[section] = {k: v for k, v in keep[section].items() if k != key}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


ADDED_LATER = {"data.eval_samples": 0, "measure.eval_every": 0, "precision.master_weights": True}
"""Recipe keys added after nights were recorded, with the default that means what a spec without them
meant: left out of the fingerprint at that default, so an upgrade keeps every history comparable."""


def row_from_result(result: RunResult, spec: dict, *, night: str, night_started_utc: str, suite: str,
                    entry: str, run_dir: str) -> dict:
    """One flat history row (units in the key names; dicts only for versions and knobs)."""
    m = result.measurement
    applied, env = result.applied, result.env
    return {
        "schema": HISTORY_SCHEMA, "night": night, "night_started_utc": night_started_utc, "suite": suite,
        "entry": entry, "recipe": result.recipe, "preset": result.preset, "stage": result.stage,
        "backend": result.backend, "repeat_index": result.repeat_index,
        "status": result.status, "reason": result.reason,
        "ips": m.ips, "tokens_per_s": m.tokens_per_s, "step_time_median_s": m.step_time_median_s,
        "step_time_p10_s": m.step_time_p10_s, "step_time_p90_s": m.step_time_p90_s,
        "num_measured_steps": m.num_measured_steps, "num_ranks": m.num_ranks,
        "mem_alloc_peak_bytes": m.mem_alloc_peak_bytes, "mem_reserved_peak_bytes": m.mem_reserved_peak_bytes,
        "mem_source": m.mem_source, "memory_bytes": m.memory_bytes, "memory_source": m.memory_source,
        "rss_peak_bytes": m.rss_peak_bytes, "rss_after_build_bytes": m.rss_after_build_bytes, "mfu": result.mfu, "mfu_peak": result.mfu_peak,
        "flops_per_sample": result.flops_per_sample, "loss_last": m.loss_last,
        "num_processes": result.setup.get("num_processes"), "global_batch": result.setup.get("global_batch"),
        "micro_batch": result.setup.get("micro_batch"), "sharding": result.setup.get("sharding"),
        "dtype": result.setup.get("dtype"), "amp_level": result.setup.get("amp_level"),
        "workload": workload_fingerprint(spec),
        "knobs": {**spec.get("backend_knobs", {}), **{f"env.{k}": v for k, v in (spec.get("backend_env") or {}).items()},
                  **{f"override.{k}": v for k, v in (spec.get("overrides") or {}).items()}},
        "framework_version": applied.get("framework_version"), "device_name": applied.get("device_name"),
        "build": (env.get("backend") or {}).get("build"), "interpreter": env.get("interpreter"),
        "versions": {k.removeprefix("version_"): v for k, v in applied.items() if k.startswith("version_")},
        "host": env.get("host", {}).get("hostname"), "node_type": result.node_type, "python": env.get("python"),
        "xfw_git_sha": env.get("xfw_git_sha"), "wall_time_s": result.wall_time_s, "run_dir": run_dir,
    }


def converge_fields(report, backend: str, settings: dict, spec: dict, converge_dir: str) -> dict:
    """What a converge entry adds to each of ``backend``'s rows: from ``report`` (a
    :class:`xfw.report.converge.ConvergeReport`) its final eval loss (mean over the ok seeds, their
    sample standard deviation and number), time and samples to the target, the night's own verdict between
    the sides at the final eval point, whether every seed ran; ``settings`` (seeds, steps, eval_every,
    eval_samples, target as configured) and the speed run's ``spec`` make ``quality_workload``: the final
    eval losses of two nights are compared only when it is equal."""
    final, side = report.final, report.targets.get(backend)
    failed = [f"seed {seed} {run.status}" + (f": {run.reason}" if run.reason else "")
              for seed, run in sorted(report.curves.get(backend, {}).items()) if run.status != "ok"]
    return {
        "converge": dict(settings), "quality_workload": workload_fingerprint({**spec, "converge": dict(settings)}),
        "final_eval_loss": final.mean.get(backend) if final else None,
        "final_eval_loss_std": final.std.get(backend) if final else None,
        "final_eval_loss_n": final.n.get(backend, 0) if final else 0,
        "final_eval_step": final.step if final else None,
        "target_loss": report.target, "target_source": report.target_source,
        "time_to_target_s": side.time_s if side else None,
        "samples_to_target": side.mean_samples if side else None,
        "target_reached_seeds": side.reached if side else 0,
        "curve_time_to_target_s": side.curve_time_s if side else None,
        "curve_samples_to_target": side.curve_samples if side else None,
        "converge_verdict": final.verdict if final else "no eval point",
        "converge_worse": final.worse if final else None,
        "converge_p": final.p if final else None,
        "converge_reference": report.backends[0],
        "converge_status": "failed" if failed else "ok", "converge_reason": "; ".join(failed),
        "converge_dir": converge_dir,
    }


TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
FUTURE_SLACK_S = 86400.0
"""A night may start at most this far after the reader's clock (clocks of two hosts disagree a little;
a row dated 2099 was not written by a night)."""
TEXT_FIELDS = ("status", "reason", "suite", "recipe", "preset", "stage", "workload", "mem_source", "memory_source",
               "device_name", "framework_version", "host", "node_type", "python", "xfw_git_sha", "run_dir", "sharding", "dtype",
               "amp_level", "mfu_peak", "quality_workload", "target_source", "converge_verdict", "converge_worse",
               "converge_reference", "converge_status", "converge_reason", "converge_dir")
NUMBER_FIELDS = ("ips", "tokens_per_s", "step_time_median_s", "step_time_p10_s", "step_time_p90_s",
                 "num_measured_steps", "num_ranks", "mem_alloc_peak_bytes", "mem_reserved_peak_bytes", "memory_bytes",
                 "rss_peak_bytes", "rss_after_build_bytes", "mfu", "flops_per_sample", "loss_last",
                 "num_processes", "global_batch", "micro_batch", "wall_time_s",
                 "final_eval_loss", "final_eval_loss_std", "final_eval_loss_n", "final_eval_step", "target_loss",
                 "time_to_target_s", "samples_to_target", "target_reached_seeds", "curve_time_to_target_s",
                 "curve_samples_to_target", "converge_p")
DICT_FIELDS = ("knobs", "versions", "converge")


def row_problem(row: dict, now: dt.datetime) -> str | None:
    """Why a history row cannot be used (the key named), or None: the night is one plain path
    component, ``night_started_utc`` a UTC time no later than a day from ``now``, ``status`` text,
    every number a finite number or null, every text field text or null."""
    night = row["night"]
    if night in ("", ".", "..") or "/" in night or "\x00" in night or "\\" in night:
        return f"night {night!r} is not a plain directory name"
    started = row.get("night_started_utc")
    if not isinstance(started, str):
        return f"night_started_utc must be a UTC time like 2026-11-22T02:00:00Z, got {started!r}"
    try:
        when = dt.datetime.strptime(started, TIME_FORMAT).replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return f"night_started_utc {started[:40]!r} is not a UTC time like 2026-11-22T02:00:00Z"
    if (when - now).total_seconds() > FUTURE_SLACK_S:
        return f"night_started_utc {started} is in the future (this host's clock says {now.strftime(TIME_FORMAT)})"
    if not isinstance(row.get("status"), str):
        return f"status must be text, got {row.get('status')!r}"
    for key in TEXT_FIELDS:
        if row.get(key) is not None and not isinstance(row[key], str):
            return f"{key} must be text or null, got {type(row[key]).__name__}"
    for key in NUMBER_FIELDS:
        value = row.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
            return f"{key} must be a finite number or null, got {value!r}"[:200]
    for key in DICT_FIELDS:
        if row.get(key) is not None and not isinstance(row[key], dict):
            return f"{key} must be an object or null, got {type(row[key]).__name__}"
    return None


def _readable(row: dict) -> dict:
    """A row as :func:`row_problem` reads it back: a number that is not finite is null, a text field
    holding something else its text (a value xfw writes must never make the next night's history unreadable)."""
    row = dict(row)
    for key in NUMBER_FIELDS:
        value = row.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
            row[key] = None
    for key in TEXT_FIELDS:
        if row.get(key) is not None and not isinstance(row[key], str):
            row[key] = str(row[key])
    return row


class History:
    """``DIR/history.jsonl``: read, upsert atomically, query by key."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.path = self.dir / HISTORY_FILE

    def rows(self) -> list[dict]:
        """Every row, oldest night first. A line that does not parse, or a row whose fields have the
        wrong type (:func:`row_problem`), is an error naming the line and the key: the file is only
        ever replaced whole, so a bad line was written by something else."""
        try:
            os.stat(self.path)  # the directory's own problems first, named as such below
            text = read_bounded(self.path, HISTORY_MAX_BYTES, within=self.dir).decode("utf-8")
        except FileNotFoundError:
            return []
        except UnreadableFile:
            raise
        except (NotADirectoryError, IsADirectoryError) as err:
            where = self.dir if isinstance(err, NotADirectoryError) else self.path
            raise UnreadableFile(f"{where}: cannot be used as an output directory (a file, not a directory)" if
                                 isinstance(err, NotADirectoryError) else f"{where}: a directory, not a file") from None
        except (OSError, UnicodeDecodeError) as err:
            name_too_long = getattr(err, "errno", None) == errno.ENAMETOOLONG
            raise UnreadableFile(f"{self.dir}: cannot be used as an output directory (File name too long)"
                                 if name_too_long else
                                 f"{self.path}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
        rows, now = [], dt.datetime.now(dt.timezone.utc)
        for number, line in enumerate(text.split("\n"), 1):  # JSON lines end at \n only (not at U+2028)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UnreadableFile(f"{self.path}:{number}: not a JSON object ({err.msg})") from None
            except RecursionError:
                raise UnreadableFile(f"{self.path}:{number}: nested too deep to be a history row") from None
            if not isinstance(row, dict) or any(k not in row for k in KEY) or \
                    not all(isinstance(row[k], str) for k in KEY[:3]) or type(row[KEY[3]]) is not int:
                raise UnreadableFile(f"{self.path}:{number}: a history row needs {', '.join(KEY)} "
                                     "(three strings and an integer)")
            problem = row_problem(row, now)
            if problem:
                raise UnreadableFile(f"{self.path}:{number}: {problem}")
            rows.append(row)
        return rows

    def upsert(self, new_rows: list[dict]) -> None:
        """Add rows, replacing any with the same key; one atomic rewrite."""
        if not new_rows:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        keyed = {tuple(r[k] for k in KEY): r for r in self.rows()}
        for row in map(_readable, new_rows):
            keyed[tuple(row[k] for k in KEY)] = row
        ordered = sorted(keyed.values(), key=lambda r: (r.get("night_started_utc", ""), r["night"], r["entry"],
                                                         r["backend"], r["repeat_index"]))
        write_text_atomic(self.path, "".join(json.dumps(r, sort_keys=False) + "\n" for r in ordered))

    def nights(self) -> list[str]:
        """Night ids in the order they started."""
        return night_order(self.rows())


def night_order(rows: list[dict]) -> list[str]:
    """The nights of ``rows`` in the order they started."""
    seen: dict[str, str] = {}
    for row in rows:
        seen.setdefault(row["night"], row.get("night_started_utc", ""))
    return [n for n, _ in sorted(seen.items(), key=lambda item: (item[1], item[0]))]
