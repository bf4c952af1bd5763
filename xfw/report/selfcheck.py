"""Selfcheck verdicts: does each settings path a seed row uses work on this machine, on every backend?

A *path* is a way of training the seed rows use (bf16 O2 with master weights, fp16 with a loss scaler,
sharding stage 2, recompute, attention without the fused kernel, ...). ``xfw selfcheck``
(:mod:`xfw.run.commands.selfcheck`) trains each tiny family through each path on every backend, all from one
exported start, and this module judges the runs::

    verdict = judge(path, runs_of_this_backend, fp32_runs_of_this_backend, other_backends_runs)
    # Verdict(backend="paddle", path="bf16-o2", verdict="not checked",
    #         detail="applied fp32 O0, not bf16 O2: requested bf16 O2, ran fp32 O0: Paddle's CPU build ignores AMP")

A path passes when, for every family: the run ended ok; every loss is finite; the adapter applied what
was asked; step times and the window are positive; peak memory is positive, never decreases, and
allocated ≤ reserved; the step-0 loss is within the path's tolerance of the same backend's fp32 run and
of the other backends' runs of the path (all start from the same weights on the same batch). The
tolerance is the dtype's (:data:`DTYPE_TOLERANCE`) or 10x the fp32 runs' own cross-backend difference,
whichever is larger. "not checked" says why a path could not run here (a GPU-only feature on a CPU).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from xfw.contract import records as rec
from xfw.report.results import RunResult

DTYPE_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
"""Relative step-0 loss difference allowed from the same start on the same batch: fp32 rounding only
(the parity bound); bf16 keeps 8 significand bits (2^-8 ≈ 4e-3 per operation, compounded through a
network's depth); fp16 keeps 11 (2^-11 ≈ 5e-4)."""
VERDICTS = ("pass", "fail", "not checked")
VERDICTS_FILE = "selfcheck.json"
"""Where a selfcheck's verdicts and the machine's environment are written, in its output directory."""
NIGHT_DIR = "selfcheck"
"""A night's selfcheck (a suite's ``selfcheck``), under the night's directory."""


@dataclass(frozen=True, kw_only=True)
class SettingsPath:
    name: str
    """Short and stable: the key compare looks verdicts up by (``bf16-o2``, ``stage2``, ...)."""
    title: str
    overrides: tuple[str, ...]
    """Recipe overrides; ``{backend}`` is replaced by each backend's name (for backend knobs)."""
    dtype: str = "fp32"
    processes: int = 1


PATHS = (
    SettingsPath(name="fp32", title="fp32 (the reference)", overrides=()),
    SettingsPath(name="bf16-o1", title="bf16 O1 (autocast over fp32 weights)", dtype="bf16",
          overrides=("precision.dtype=bf16", "precision.amp_level=O1")),
    SettingsPath(name="bf16-o2", title="bf16 O2 (bf16 weights, fp32 master weights)", dtype="bf16",
          overrides=("precision.dtype=bf16", "precision.amp_level=O2")),
    SettingsPath(name="fp16-o2", title="fp16 O2 with a loss scaler", dtype="fp16",
          overrides=("precision.dtype=fp16", "precision.amp_level=O2")),
    SettingsPath(name="recompute", title="recompute (activation checkpointing)", overrides=("recompute=true",)),
    SettingsPath(name="attention-eager", title="attention without the fused kernel (flash off)",
          overrides=("backends.{backend}.attn_implementation=eager",)),
    SettingsPath(name="stage2", title="sharding stage 2 over 2 processes", processes=2,
          overrides=("parallel.nproc_per_node=2", "parallel.sharding=stage2")),
    SettingsPath(name="stage3", title="sharding stage 3 over 2 processes", processes=2,
          overrides=("parallel.nproc_per_node=2", "parallel.sharding=stage3")),
)
BY_NAME = {p.name: p for p in PATHS}


@dataclass(frozen=True, kw_only=True)
class Verdict:
    backend: str
    path: str
    verdict: str
    """pass | fail | not checked"""
    detail: str = ""
    families: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {**asdict(self), "families": list(self.families)}


def _step0_loss(run: RunResult) -> float | None:
    """The first step's loss over the whole global batch: the mean of every rank's (each rank reports
    the loss of its own share of the batch)."""
    steps = [r for r in rec.load_records(Path(run.run_dir) / "steps.jsonl") if r.get("kind") == "step"]
    first = min((r["step"] for r in steps), default=None)
    losses = [r["loss"] for r in steps if r["step"] == first and r.get("loss") is not None]
    return sum(losses) / len(losses) if losses else None


def _rel(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _sane(run: RunResult) -> str:
    """"" when the run's records are sane, else what is not."""
    records = rec.load_records(Path(run.run_dir) / "steps.jsonl")
    steps = sorted((r for r in records if r.get("kind") == "step"), key=lambda r: (r["rank"], r["step"]))
    if any(not math.isfinite(r["loss"]) for r in steps if r.get("loss") is not None):
        return "a loss is not finite"
    if any(r["step_time_s"] <= 0 for r in steps if r["phase"] == "measure") or not run.measurement.window_time_s:
        return "a step time or the measured window is not positive"
    for rank in {r["rank"] for r in steps}:
        peaks = [r["mem_alloc_peak_bytes"] for r in steps if r["rank"] == rank and r["mem_alloc_peak_bytes"] is not None]
        if not peaks or peaks[0] <= 0:
            return f"rank {rank}: no positive peak memory"
        if any(b < a for a, b in zip(peaks, peaks[1:])):
            return f"rank {rank}: the peak memory went down"
    m = run.measurement
    if m.mem_reserved_peak_bytes is not None and m.mem_alloc_peak_bytes is not None \
            and m.mem_alloc_peak_bytes > m.mem_reserved_peak_bytes:
        return "peak allocated is above peak reserved"
    return ""


def _applied_as_asked(path: SettingsPath, run: RunResult) -> tuple[str, str]:
    """(verdict, detail) for what the adapter says it applied: "" when as asked."""
    applied, setup = run.applied, run.setup
    asked_level = setup.get("amp_level")
    if applied.get("amp_level") != asked_level:
        return "not checked", (f"applied {applied.get('compute_dtype')} {applied.get('amp_level')}, not "
                               f"{setup.get('dtype')} {asked_level}: {applied.get('notes', '')}".rstrip(": "))
    if bool(applied.get("recompute")) != bool(setup.get("recompute")):
        return "fail", f"recompute applied {applied.get('recompute')}, asked {setup.get('recompute')}"
    if path.processes > 1 and (applied.get("num_processes") != path.processes or applied.get("sharding_impl") == "none"):
        n = applied.get("num_processes")
        return "fail", (f"applied {n} process{'' if n == 1 else 'es'} (asked {path.processes}), "
                        f"sharding {applied.get('sharding_impl')}")
    return "", ""


TEST_DEVICE_WORDS = "CPU test device"
"""What an adapter's ``applied["device"]`` says when it ran on a CPU test device (Paddle's ``testcpu``)."""


def judge_family(path: SettingsPath, run: RunResult, reference: RunResult | None, others: list[RunResult],
                 fp32_spread: float) -> tuple[str, str]:
    """(verdict, detail) of one backend's run of one path for one family; a run on a CPU test device
    says so in its detail (its code paths are checked, not a GPU's kernels or speed)."""
    verdict, detail = _judge(path, run, reference, others, fp32_spread)
    if TEST_DEVICE_WORDS in str(run.applied.get("device", "")):
        detail += (f"; on the {TEST_DEVICE_WORDS} ({str(run.applied['device']).split(' ')[0]}): the GPU-only "
                   "code path ran for real, its kernels and speed are a CPU's")
    return verdict, detail


def _judge(path: SettingsPath, run: RunResult, reference: RunResult | None, others: list[RunResult],
           fp32_spread: float) -> tuple[str, str]:
    if run.status in ("unsupported", "invalid"):
        return "not checked", f"{run.status}: {run.reason}"
    if not run.ok:
        return "fail", f"{run.status}: {run.reason}"
    verdict, detail = _applied_as_asked(path, run)
    if verdict:
        return verdict, detail
    problem = _sane(run)
    if problem:
        return "fail", problem
    tolerance = max(DTYPE_TOLERANCE[path.dtype], 10 * fp32_spread)
    loss = _step0_loss(run)
    if reference is not None and reference is not run and reference.ok:
        diff = _rel(loss, _step0_loss(reference))
        if not diff <= tolerance:
            return "fail", f"step-0 loss {diff:.1e} from this backend's fp32 run (tolerance {tolerance:.0e})"
    for other in others:
        if other.ok and _applied_as_asked(path, other)[0] == "":
            diff = _rel(loss, _step0_loss(other))
            if not diff <= tolerance:
                return "fail", f"step-0 loss {diff:.1e} from {other.backend}'s (tolerance {tolerance:.0e})"
    return "pass", f"step-0 loss within {tolerance:.0e} of fp32 and of the other backends"


def fp32_spread(fp32_runs: list[RunResult]) -> float:
    """The largest relative step-0 loss difference between backends in fp32 (parity's rounding)."""
    losses = [_step0_loss(r) for r in fp32_runs if r.ok]
    losses = [x for x in losses if x is not None]
    return max((_rel(a, b) for a in losses for b in losses), default=0.0)


def combine(backend: str, path: str, per_family: dict[str, tuple[str, str]]) -> Verdict:
    """One verdict over the families: fail if any failed; not checked if none could run; else pass
    (saying for which families it could not be checked)."""
    def first(wanted: str) -> tuple[str, str] | None:
        return next(((f, d) for f, (v, d) in per_family.items() if v == wanted), None)

    families = tuple(per_family)
    failed, skipped = first("fail"), [f for f, (v, _) in per_family.items() if v == "not checked"]
    if failed:
        return Verdict(backend=backend, path=path, verdict="fail", detail=f"{failed[0]}: {failed[1]}", families=families)
    if len(skipped) == len(per_family):
        family, detail = first("not checked")
        return Verdict(backend=backend, path=path, verdict="not checked", detail=f"{family}: {detail}",
                       families=families)
    detail = first("pass")[1] + (f"; not checked for {', '.join(skipped)}" if skipped else "")
    return Verdict(backend=backend, path=path, verdict="pass", detail=detail, families=families)


def paths_of(setup: dict, knobs: dict) -> list[str]:
    """The selfcheck paths a run with these settings goes through (beyond plain fp32)."""
    found = []
    if setup.get("dtype") not in (None, "fp32"):
        found.append(f"{setup['dtype']}-{str(setup.get('amp_level')).lower()}")
    if setup.get("recompute"):
        found.append("recompute")
    if setup.get("sharding") in ("stage2", "stage3"):
        found.append(setup["sharding"])
    if knobs.get("attn_implementation") == "eager":
        found.append("attention-eager")
    return found


def verdict_blocks(verdicts: list[Verdict]) -> list:
    """The verdicts as a table, then what could not be checked here and why (``xfw selfcheck``'s page,
    and the night's when its suite starts with a selfcheck)."""
    from xfw.report import table

    cells = [[v.backend, BY_NAME[v.path].title, table.Strong(v.verdict) if v.verdict != "pass" else "pass",
              v.detail] for v in verdicts]
    blocks = [table.Table(header=["Backend", "Path", "Verdict", "Detail"], cells=cells, name="selfcheck",
                          records=[v.to_dict() for v in verdicts])]
    skipped = [f"{v.backend}, {BY_NAME[v.path].title}: {v.detail}" for v in verdicts if v.verdict == "not checked"]
    if skipped:
        blocks += [table.Heading("Could not be checked on this machine", 3), table.Bullets(skipped)]
    return blocks


def load_verdicts(directory) -> list[Verdict]:
    """The verdicts :data:`VERDICTS_FILE` in ``directory`` holds ([] where there is none)."""
    from xfw.contract.atomic import UnreadableFile, read_json_object

    try:
        data = read_json_object(Path(directory) / VERDICTS_FILE)
    except UnreadableFile:
        return []
    verdicts = data.get("verdicts", [])
    fields = ("backend", "path", "verdict", "detail")
    return [Verdict(**{k: v[k] for k in fields if k in v}, families=tuple(v.get("families", ())))
            for v in (verdicts if isinstance(verdicts, list) else [])
            if isinstance(v, dict) and all(isinstance(v.get(k, ""), str) for k in fields)
            and all(k in v for k in fields[:3]) and isinstance(v.get("families", []), list)
            and all(isinstance(f, str) for f in v.get("families", []))]
