"""Statistics from raw records: the one function that turns steps.jsonl into numbers.

Both backends' records go through :func:`summarize`, so throughput, step-time percentiles and
memory are computed identically for every framework::

    >>> m = summarize(load_records("runs/.../torch/steps.jsonl"))
    >>> m.ips, m.step_time_median_s, m.mem_alloc_peak_bytes

Throughput is global: each rank's samples in its measured window divided by that window's
time, summed over ranks (seed 003's "ips"); tokens/s counts trained tokens only, never padding.
Warm-up steps never enter a statistic of speed or memory; ``loss_first`` is the first recorded
loss, warm-up included (the loss a run started from).

What the run trained on comes from the step records' data keys (``xfw.contract.records``): the
padding fraction and the mean and longest sequence of the measured steps, and ``batch_digest``, one
digest over every micro-batch's hash (warm-up included) in (step, rank) order: two runs with the
same digest trained on bit-identical batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Measurement:
    num_ranks: int
    """Ranks that finished their measured window."""
    ips: float | None
    """Global samples per second over the measured window."""
    tokens_per_s: float | None
    step_time_median_s: float | None
    step_time_p10_s: float | None
    step_time_p90_s: float | None
    window_time_s: float | None
    """The slowest rank's measured window."""
    num_measured_steps: int
    num_warmup_steps: int
    mem_alloc_peak_bytes: int | None
    """Largest over ranks of each rank's peak; source in ``mem_source``."""
    mem_reserved_peak_bytes: int | None
    mem_source: str | None
    loss_first: float | None
    """Rank 0's first recorded loss (a warm-up step when there is one)."""
    loss_last: float | None
    per_rank: list[dict] = field(default_factory=list)
    padding_fraction: float | None = None
    """Share of the measured steps' sequence positions that were padding; None without a sequence."""
    seq_len_mean: float | None = None
    """Trained tokens per sample over the measured steps (image tokens included, padding not)."""
    seq_len_max: int | None = None
    """The longest sample of the measured steps."""
    batch_digest: str | None = None
    """A digest of every micro-batch's hash in (step, rank) order, warm-up included (module docstring)."""
    num_batches: int = 0
    """Micro-batch hashes the digest covers."""
    source: str = "xfw"
    """``xfw`` (measured by xfw: its adapter or its probe) or ``command_log`` (:data:`PARSED_NOTE`)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Measurement":
        return cls(**data)


PARSED_NOTE = "parsed from the command's log: not measured by xfw"
"""What every report says beside a number whose window record has ``"source": "command_log"``
(a command xfw could not hook; ``backends.<name>.log_pattern``, xfw.run.logparse)."""


def _max_or_none(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _finite_or_none(value) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def summarize(records: list[dict]) -> Measurement:
    """Compute every statistic from one run's records (all ranks)."""
    steps = [r for r in records if r.get("kind") == "step"]
    measured = [r for r in steps if r["phase"] == "measure"]
    windows = {r["rank"]: r for r in records if r.get("kind") == "window"}
    applied = [r for r in records if r.get("kind") == "applied"]
    ranks = sorted({r["rank"] for r in steps} | set(windows))

    per_rank = []
    for rank in ranks:
        mine = [r for r in measured if r["rank"] == rank]
        window = windows.get(rank)
        per_rank.append({
            "rank": rank,
            "window_time_s": window["window_time_s"] if window else None,
            "ips": window["samples"] / window["window_time_s"] if window else None,
            "tokens_per_s": window["tokens"] / window["window_time_s"] if window else None,
            "mem_alloc_peak_bytes": _max_or_none(r["mem_alloc_peak_bytes"] for r in steps if r["rank"] == rank),
            "mem_reserved_peak_bytes": _max_or_none(r["mem_reserved_peak_bytes"] for r in steps if r["rank"] == rank),
            "num_measured_steps": len(mine),
        })

    complete = [p for p in per_rank if p["ips"] is not None]
    padded = sum(r.get("padded_tokens", 0) for r in measured)
    trained = sum(r["tokens"] for r in measured)
    longest = [r["max_seq_len"] for r in measured if r.get("max_seq_len")]
    hashes = [h for r in sorted(steps, key=lambda r: (r["step"], r["rank"])) for h in r.get("batch_hashes", ())]
    digest = hashlib.blake2b("".join(hashes).encode(), digest_size=16).hexdigest() if hashes else None
    times = np.array([r["step_time_s"] for r in measured], dtype=float)
    losses = [r["loss"] for r in sorted(steps, key=lambda r: r["step"]) if r["rank"] == (ranks[0] if ranks else 0)]
    tokens_rate = sum(p["tokens_per_s"] for p in complete) if complete else None
    return Measurement(
        num_ranks=len(complete),
        ips=sum(p["ips"] for p in complete) if complete else None,
        tokens_per_s=tokens_rate or None,
        step_time_median_s=float(np.median(times)) if times.size else None,
        step_time_p10_s=float(np.percentile(times, 10)) if times.size else None,
        step_time_p90_s=float(np.percentile(times, 90)) if times.size else None,
        window_time_s=max(p["window_time_s"] for p in complete) if complete else None,
        num_measured_steps=len(measured),
        num_warmup_steps=len(steps) - len(measured),
        mem_alloc_peak_bytes=_max_or_none(p["mem_alloc_peak_bytes"] for p in per_rank),
        mem_reserved_peak_bytes=_max_or_none(p["mem_reserved_peak_bytes"] for p in per_rank),
        mem_source=applied[0]["mem_source"] if applied else None,
        loss_first=_finite_or_none(losses[0]) if losses else None,
        loss_last=_finite_or_none(losses[-1]) if losses else None,
        per_rank=per_rank,
        padding_fraction=1 - trained / padded if padded else None,
        seq_len_mean=trained / sum(r["samples"] for r in measured) if padded else None,
        seq_len_max=max(longest) if longest else None,
        batch_digest=digest, num_batches=len(hashes),
        source="command_log" if any(w.get("source") == "command_log" for w in windows.values()) else "xfw",
    )


def spread(values: list[float]) -> float | None:
    """Relative spread (max - min) / median of repeated measurements; None with fewer than 2."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / float(np.median(values))
