"""Run directories and the RunResult loaded from them.

One backend's run of one recipe lives in a directory::

    runs/20261122-161500-compare/tiny-llava-sft/torch/
        spec.json      the resolved recipe the adapter read
        env.json       host, interpreter, framework/library versions, device, xfw git SHA
        steps.jsonl    raw records, appended by the adapter
        summary.json   status, reason, statistics, applied settings (a cache for people and programs)
        stderr.log     the adapter's stderr (kept: it explains crashes)

Every JSON file is written atomically (temp file + rename), so a run killed at any moment
leaves either the old file or the new one, never half of one. Statistics are recomputed
from ``steps.jsonl`` when a run is loaded; ``summary.json`` is never the source of truth.

Loading never raises for what is inside a run directory: a file that cannot be read or does not
follow its format makes the run ``unreadable``, and a run whose summary says ok but whose records
lack a measured window for every rank is ``incomplete``; the reason names the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xfw.contract import records as rec
from xfw.contract.atomic import UnreadableFile, read_json_object, write_json_atomic
from xfw.report.measure import Measurement, summarize
from xfw.report.mfu import utilisation

STATUSES = ("ok", "oom", "timeout", "crashed", "unsupported", "invalid", "unreadable", "incomplete")
"""What a run ended as. The last two are found when reading a run directory, never by the launcher."""
SUMMARY_SCHEMA = 1
# summary.json keys a loaded run takes, with the types they must have.
_SUMMARY_TYPES = {"backend": str, "recipe": str, "preset": str, "stage": str, "status": str, "reason": str,
                  "exit_code": (int, type(None)), "wall_time_s": (int, float, type(None)), "repeat_index": int,
                  "variant": dict}


def node_type(env: dict, applied: dict | None = None) -> str | None:
    """A node's kind, as a speed comparison must hold it equal: the accelerator model (the adapter's
    ``device_name``) and, when the device is not the host CPU itself, the host CPU model — two H800 nodes
    with different CPUs feed their GPUs differently. Not the hostname: two nodes of one type are one kind.
    None when the run recorded neither (a run directory without env.json)."""
    backend = env.get("backend") if isinstance(env.get("backend"), dict) else {}
    host = env.get("host") if isinstance(env.get("host"), dict) else {}
    device = (applied or {}).get("device_name") or backend.get("device_name")
    cpu = host.get("cpu")
    if not isinstance(device, str) or not device:
        return cpu if isinstance(cpu, str) and cpu else None
    return device if not isinstance(cpu, str) or not cpu or cpu == device else f"{device} (host {cpu})"


@dataclass(kw_only=True)
class RunResult:
    backend: str
    recipe: str
    """The recipe's name."""
    preset: str
    stage: str
    status: str
    """ok | oom | timeout | crashed | unsupported | invalid"""
    reason: str = ""
    """One line saying why, when status is not ok."""
    measurement: Measurement
    applied: dict = field(default_factory=dict)
    """The settings the adapter actually applied (rank 0's ``applied`` record)."""
    env: dict = field(default_factory=dict)
    mfu: float | None = None
    """Model FLOPs utilisation (xfw.report.mfu); None on CPUs and devices without a datasheet peak."""
    mfu_peak: str = ""
    """The peak ``mfu`` divides by, with its datasheet, or why there is no MFU (``Peak.label``)."""
    flops_per_sample: float | None = None
    """Model FLOPs of one sample: the family's ledger for this recipe, the same for every backend."""
    exit_code: int | None = None
    wall_time_s: float | None = None
    repeat_index: int = 0
    run_dir: str = ""
    variant: dict = field(default_factory=dict)
    """The sweep point this run measured: overridden dotted keys and their values, e.g.
    ``{"parallel.sharding": "stage2", "batch.micro": 8}``; {} for a plain run (and for run
    directories written before sweeps existed). Reports group by (recipe, variant)."""
    setup: dict = field(default_factory=dict)
    """The resolved spec's batch/parallel/precision settings (:func:`setup_from_spec`), for the
    layouts that group by GPU count or batch size; filled from spec.json when a run is loaded."""
    node: dict = field(default_factory=dict)
    """{} for a single-node run. One node's part of a multi-node run: ``{"rank": R, "count": N,
    "ranks": [first, last]}`` (the global ranks it ran). A run assembled from its parts
    (:mod:`xfw.report.nodes`): ``{"count": N, "parts": [part directories]}``."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def node_type(self) -> str | None:
        """What kind of node the run measured on (:func:`node_type`); None when env.json is missing."""
        return node_type(self.env, self.applied)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["schema"] = SUMMARY_SCHEMA
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "RunResult":
        data = {k: v for k, v in data.items() if k != "schema"}
        data["measurement"] = Measurement.from_dict(data["measurement"])
        return cls(**data)

    def save(self, run_dir: str | os.PathLike) -> None:
        write_json_atomic(Path(run_dir) / "summary.json", self.to_dict())

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> "RunResult":
        """Load a run directory, recomputing statistics from its raw records (module docstring)."""
        run_dir = Path(run_dir)
        problems = []

        def read(name: str) -> dict:
            try:
                return read_json_object(run_dir / name)
            except UnreadableFile as err:
                problems.append(str(err))
                return {}

        summary, spec, env = read("summary.json"), read("spec.json"), read("env.json")
        if not summary and not spec and not problems:
            raise FileNotFoundError(f"{run_dir}: not a run directory (no summary.json or spec.json)")
        bad = next((k for k, kind in _SUMMARY_TYPES.items() if k in summary and not isinstance(summary[k], kind)), None)
        node = summary.get("node") if isinstance(summary.get("node"), dict) else {}
        if bad:
            problems.append(f"{run_dir / 'summary.json'}: {bad!r} has type {type(summary[bad]).__name__}")
            summary = {}
        if "comparison" in spec:  # the one block a report renders as it stands: checked by type here
            from xfw.report.comparison import block_problem

            problem = block_problem(spec["comparison"])
            if problem:
                problems.append(f"{run_dir / 'spec.json'}: {problem}")
                spec = {k: v for k, v in spec.items() if k != "comparison"}  # never rendered as it stands
        records, problem = rec.read_records(run_dir / "steps.jsonl")
        if problem:
            problems.append(problem)
        applied = rec.applied_settings(records)
        measurement = summarize(records)
        status = summary.get("status", "crashed")
        reason = summary.get("reason", "no summary.json: the run did not finish")
        live = None if summary else _live_adapter(run_dir)
        if live is not None:  # not crashed: still going (the command that started it holds the process)
            status, reason = "incomplete", f"{run_dir}: still running (pid {live}); report it again when it ends"
        ranks = node.get("ranks")
        expected = ranks[1] - ranks[0] + 1 if isinstance(ranks, list) and len(ranks) == 2 and \
            all(isinstance(r, int) and not isinstance(r, bool) for r in ranks) else _num_processes(spec)
        expected = 1 if measurement.source == "command_log" else expected  # a log has no ranks
        if problems:
            status, reason = "unreadable", problems[0]
        elif status not in STATUSES:
            status, reason = "unreadable", f"{run_dir / 'summary.json'}: unknown status {status!r}"
        elif live is not None:
            pass
        elif status == "ok" and (measurement.ips is None or measurement.num_ranks < expected):
            status, reason = "incomplete", (f"{run_dir / 'steps.jsonl'}: a measured window for "
                                            f"{measurement.num_ranks} of {expected} ranks (truncated or removed?)")
        try:
            utilised = mfu_fields(spec, measurement, applied)
        except (KeyError, TypeError, ValueError):
            utilised = {}
        return cls(
            backend=summary.get("backend", spec.get("backend", run_dir.name)),
            recipe=summary.get("recipe", spec.get("name", "?")),
            preset=summary.get("preset", _get(spec, "model", "preset") or "?"),
            stage=summary.get("stage", spec.get("stage", "?")),
            status=status, reason=reason, measurement=measurement, applied=applied, **utilised, env=env,
            exit_code=summary.get("exit_code"), wall_time_s=summary.get("wall_time_s"),
            repeat_index=summary.get("repeat_index", 0), run_dir=str(run_dir), variant=summary.get("variant", {}),
            setup=setup_from_spec(spec), node=node,
        )


def _live_adapter(run_dir: Path) -> int | None:
    """The pid of the adapter still running in ``run_dir`` (its ``adapter.json``, written by the launcher
    while it runs, names a living process), else None."""
    from xfw.contract import lifeline
    from xfw.contract.atomic import read_bounded

    try:
        ident = json.loads(read_bounded(run_dir / "adapter.json", 1 << 20).decode("utf-8"))["process"]
        return int(ident.partition(":")[0]) if isinstance(ident, str) and lifeline.is_alive(ident) else None
    except (OSError, ValueError, KeyError, TypeError, UnreadableFile):
        return None


def _get(data: dict, *keys: str):
    """``data[k1][k2]...`` or None where a level is missing or not a mapping."""
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _num_processes(spec: dict) -> int:
    value = _get(spec, "derived", "num_processes")
    return value if isinstance(value, int) and value > 0 else 1


_PROVENANCE_DATA_KEYS = ("kind", "path", "image_root", "tokenizer", "fingerprint", "num_samples", "seed")


def setup_from_spec(spec: dict) -> dict:
    """What the layouts need from a resolved spec.json, flat; {} without a spec."""
    if not spec:
        return {}
    parallel, batch, precision = (spec.get(k) if isinstance(spec.get(k), dict) else {}
                                  for k in ("parallel", "batch", "precision"))
    return {"num_processes": _num_processes(spec),
            "global_batch": batch.get("global"), "micro_batch": batch.get("micro"),
            "grad_accum_steps": _get(spec, "derived", "grad_accum_steps"), "sharding": parallel.get("sharding", "none"),
            "dtype": precision.get("dtype"), "amp_level": precision.get("amp_level"),
            "recompute": spec.get("recompute"), "measure_steps": _get(spec, "measure", "steps"),
            "weights": _get(spec, "model", "weights"), "weights_fingerprint": _get(spec, "model", "weights_fingerprint"),
            "seed": _get(spec, "measure", "seed"),
            "warmup_steps": _get(spec, "measure", "warmup_steps"), "cpu_threads": _get(spec, "measure", "cpu_threads"),
            "optimizer": spec["optimizer"] if isinstance(spec.get("optimizer"), dict) else {},
            "data": {k: v for k, v in (spec.get("data") or {}).items() if k in _PROVENANCE_DATA_KEYS}
            if isinstance(spec.get("data"), dict) else {},
            "knobs": dict(spec.get("backend_knobs") or {}) if isinstance(spec.get("backend_knobs") or {}, dict) else {},
            # The variables this backend's processes got (backends.<name>.env): reports name those that can change
            # the result (xfw.contract.envvars).
            "env": {k: v for k, v in spec["backend_env"].items() if isinstance(k, str) and isinstance(v, str)}
            if isinstance(spec.get("backend_env"), dict) else {},
            # Which comparison the run belongs to (xfw.recipe.published); runs from before there were two: like-for-like.
            "comparison": spec["comparison"] if isinstance(spec.get("comparison"), dict) else {"kind": "like-for-like"},
            # This backend's deliberate difference (xfw.recipe.overrides) and the recipe's values it replaced; only with one.
            **({"overrides": dict(spec["overrides"]), "overridden": dict(spec.get("overridden") or {})}
               if isinstance(spec.get("overrides"), dict) and spec["overrides"] else {})}


def mfu_fields(spec: dict, measurement: Measurement, applied: dict) -> dict:
    """RunResult's ``mfu``, ``mfu_peak`` and ``flops_per_sample`` for a run ({} without a spec or an
    ``applied`` record): the recipe's model FLOPs, whichever backend ran it (``xfw.report.mfu``)."""
    if not spec or not applied:
        return {}
    u = utilisation(arch=spec["model"]["arch"], stage=spec["stage"], lora=spec.get("lora"), ips=measurement.ips,
                    device=applied.get("device", ""), device_name=applied.get("device_name", ""),
                    compute_dtype=applied.get("compute_dtype", ""), tf32=bool(applied.get("tf32")),
                    num_devices=applied.get("num_processes", 1), trainable=spec["model"].get("trainable"),
                    seq_len=measurement.seq_len_mean)
    return {"mfu": u.mfu, "mfu_peak": u.peak, "flops_per_sample": u.flops_per_sample}


def find_run_dirs(paths: list[str | os.PathLike]) -> list[Path]:
    """Run directories at or below the given paths (a run directory holds spec.json; an exported start,
    ``weights/`` of parity or converge, holds one beside its weights and is not a run)."""
    from xfw.contract.weights import WEIGHTS_FILE

    found: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        if (path / "spec.json").exists():
            found.append(path)
        else:
            found.extend(sorted(p.parent for p in path.rglob("spec.json") if not (p.parent / WEIGHTS_FILE).exists()))
    return found


# The settings that make two runs of one recipe different configurations (not repeats), and the
# names they are shown under (the recipe's own dotted keys where there is one).
_SETUP_LABELS = {"num_processes": "parallel.processes", "sharding": "parallel.sharding",
                 "global_batch": "batch.global", "micro_batch": "batch.micro", "dtype": "precision.dtype",
                 "amp_level": "precision.amp_level", "recompute": "recompute"}


def _group(results: list[RunResult], key) -> list[list[RunResult]]:
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        groups.setdefault(json.dumps(key(r), sort_keys=True, default=str), []).append(r)
    return list(groups.values())


def distinguish_configurations(results: list[RunResult]) -> list[RunResult]:
    """Runs gathered from separate commands (``xfw report runs/a runs/b``) carry no sweep point, so
    two configurations of one recipe would look like repeats and be averaged. Give each run the
    settings that differ within its (recipe, variant) as extra variant keys, e.g.
    ``{"parallel.sharding": "stage3", "backends.torch.sharding_impl": "deepspeed"}``; a backend knob
    only where it separates runs of the same backend, so the two sides of a contrast still pair."""
    for runs in _group(results, lambda r: (r.recipe, r.variant)):
        differing = [k for k in _SETUP_LABELS if len({json.dumps(_recipe_setup(r).get(k)) for r in runs if r.setup}) > 1]
        for r in runs:
            r.variant = {**r.variant, **{_SETUP_LABELS[k]: _recipe_setup(r).get(k) for k in differing if r.setup}}
    for runs in _group(results, lambda r: (r.recipe, r.variant, r.backend)):
        knobs = sorted({k for r in runs for k in r.setup.get("knobs", {})})
        differing = [k for k in knobs if len({json.dumps(r.setup.get("knobs", {}).get(k)) for r in runs}) > 1]
        overridden = sorted({k for r in runs for k in r.setup.get("overrides", {})})
        separating = [k for k in overridden if len({json.dumps(r.setup.get("overrides", {}).get(k)) for r in runs}) > 1]
        for r in runs:
            r.variant = {**r.variant, **{f"backends.{r.backend}.{k}": r.setup.get("knobs", {}).get(k, "default")
                                         for k in differing},
                         **{f"backends.{r.backend}.override.{k}": r.setup.get("overrides", {}).get(k, "none")
                            for k in separating}}
    return results


def _recipe_setup(r: RunResult) -> dict:
    """A run's setup as its recipe had it, before its backend's override (``overridden``): a side that
    deliberately ran another precision is still the same configuration as the other side."""
    replaced = r.setup.get("overridden") or {}
    if not replaced:
        return r.setup
    setup = {**r.setup, **{k: replaced[label] for k, label in _SETUP_LABELS.items() if label in replaced}}
    for key in ("parallel.nproc_per_node", "parallel.nnodes"):  # processes = nproc_per_node x nnodes
        new, old = r.setup.get("overrides", {}).get(key), replaced.get(key)
        if isinstance(new, int) and isinstance(old, int) and new > 0 and isinstance(setup.get("num_processes"), int):
            setup["num_processes"] = setup["num_processes"] // new * old
    return setup
