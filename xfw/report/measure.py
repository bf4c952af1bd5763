"""Statistics from raw records: the one function that turns steps.jsonl into numbers.

Both backends' records go through :func:`summarize`, so throughput, step-time percentiles and
memory are computed identically for every framework::

    >>> m = summarize(load_records("runs/.../torch/steps.jsonl"))
    >>> m.ips, m.step_time_median_s, m.mem_alloc_peak_bytes

Throughput is global: each rank's samples in its measured window divided by that window's
time, summed over ranks (seed 003's "ips"); tokens/s counts trained tokens only, never padding.
Warm-up steps never enter a statistic of speed or memory; ``loss_first`` is the first recorded
loss, warm-up included (the loss a run started from).

Memory, per rank and then the largest rank: the framework's own figure (``mem_alloc_peak_bytes``,
``mem_reserved_peak_bytes``, source ``mem_source``) and the process's resident set
(``rss_peak_bytes`` since the model was built, ``rss_after_build_bytes``; ``xfw.contract.rss``).
``memory_bytes`` / ``memory_source`` is the one measure both backends share, what contrasts and
nightly trends compare: the CUDA allocator's peak on a GPU; on a CPU the training memory, each
rank's peak resident set since its model was built minus its resident set right after the build
(``rss_training_bytes``: framework start-up, libraries and weights are not training memory), or the
peak resident set where the peak could not be reset at the build (and a run recorded before the
harness read it keeps its framework's figure, its source named).

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
    rss_peak_bytes: int | None = None
    """Largest over ranks of the process's peak resident set (since its model was built, where the
    kernel allowed the reset: ``rss_peak_since_build``)."""
    rss_after_build_bytes: int | None = None
    """Largest over ranks of the resident set right after the model was built (framework start-up,
    libraries and weights: not training memory)."""
    rss_peak_since_build: bool | None = None
    source: str = "xfw"
    """``xfw`` (measured by xfw: its adapter or its probe) or ``command_log`` (:data:`PARSED_NOTE`)."""
    rank0_steps: list = field(default_factory=list)
    """Rank 0's steps in order, warm-up included: ``[samples, step_time_s]`` each (per rank), for the
    throughput definitions of other people's scripts (:func:`script_throughput`)."""
    rss_training_bytes: int | None = None
    """Largest over ranks of each rank's training memory: its peak resident set since the model was
    built minus its resident set right after the build (None where the kernel did not let the peak be
    reset at the build: then the peak may be start-up's)."""

    @property
    def memory_bytes(self) -> int | None:
        """The measure both backends share (module docstring): the CUDA allocator's peak on a GPU,
        the training memory (:attr:`rss_training_bytes`) on a CPU, else the peak resident set."""
        if self.mem_source == "cuda_allocator" or self.rss_peak_bytes is None:
            return self.mem_alloc_peak_bytes
        return self.rss_training_bytes if self.rss_training_bytes is not None else self.rss_peak_bytes

    @property
    def memory_source(self) -> str | None:
        """``cuda_allocator`` | ``rss_training`` (peak RSS since the build − RSS after it) | ``peak_rss``
        | (a run from before the harness read the RSS) its framework's ``mem_source``."""
        if self.memory_bytes is None:
            return None
        if self.mem_source == "cuda_allocator" or self.rss_peak_bytes is None:
            return self.mem_source
        return "rss_training" if self.rss_training_bytes is not None else "peak_rss"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Measurement":
        return cls(**data)


PARSED_NOTE = "parsed from the command's log: not measured by xfw"
"""What every report says beside a number whose window record has ``"source": "command_log"``
(a command xfw could not hook; ``backends.<name>.log_pattern``, xfw.run.launch.logparse)."""


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
    starts = {r["rank"]: r for r in records if r.get("kind") == "start"}
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
            "rss_peak_bytes": _max_or_none(r.get("rss_peak_bytes") for r in steps if r["rank"] == rank),
            "rss_after_build_bytes": starts.get(rank, {}).get("rss_after_build_bytes"),
            "num_measured_steps": len(mine),
        })
        p = per_rank[-1]
        reset = starts.get(rank, {}).get("rss_peak_since_build") is True
        p["rss_training_bytes"] = max(p["rss_peak_bytes"] - p["rss_after_build_bytes"], 0) \
            if reset and p["rss_peak_bytes"] is not None and p["rss_after_build_bytes"] is not None else None

    complete = [p for p in per_rank if p["ips"] is not None]
    padded = sum(r.get("padded_tokens", 0) for r in measured)
    trained = sum(r["tokens"] for r in measured)
    longest = [r["max_seq_len"] for r in measured if r.get("max_seq_len")]
    hashes = [h for r in sorted(steps, key=lambda r: (r["step"], r["rank"])) for h in r.get("batch_hashes", ())]
    digest = hashlib.blake2b("".join(hashes).encode(), digest_size=16).hexdigest() if hashes else None
    times = np.array([r["step_time_s"] for r in measured], dtype=float)
    losses = [r["loss"] for r in sorted(steps, key=lambda r: r["step"]) if r["rank"] == (ranks[0] if ranks else 0)]
    tokens_rate = sum(p["tokens_per_s"] for p in complete) if complete else None
    mem_source = applied[0]["mem_source"] if applied else None
    alloc = _max_or_none(p["mem_alloc_peak_bytes"] for p in per_rank)
    since_build = [r.get("rss_peak_since_build") for r in starts.values() if "rss_peak_since_build" in r]
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
        mem_alloc_peak_bytes=alloc,
        mem_reserved_peak_bytes=_max_or_none(p["mem_reserved_peak_bytes"] for p in per_rank),
        mem_source=mem_source,
        loss_first=_finite_or_none(losses[0]) if losses else None,
        loss_last=_finite_or_none(losses[-1]) if losses else None,
        per_rank=per_rank,
        padding_fraction=1 - trained / padded if padded else None,
        seq_len_mean=trained / sum(r["samples"] for r in measured) if padded else None,
        seq_len_max=max(longest) if longest else None,
        batch_digest=digest, num_batches=len(hashes),
        rss_peak_bytes=_max_or_none(p["rss_peak_bytes"] for p in per_rank),
        rss_after_build_bytes=_max_or_none(p["rss_after_build_bytes"] for p in per_rank),
        rss_peak_since_build=all(since_build) if since_build else None,
        rss_training_bytes=_max_or_none(p["rss_training_bytes"] for p in per_rank)
        if per_rank and all(p["rss_training_bytes"] is not None for p in per_rank) else None,
        source="command_log" if any(w.get("source") == "command_log" for w in windows.values()) else "xfw",
        rank0_steps=[[r["samples"], r["step_time_s"]] for r in sorted(steps, key=lambda r: r["step"])
                     if r["rank"] == (ranks[0] if ranks else 0)],
    )


THROUGHPUT_NOTES = {
    "window": "xfw: samples in the measured window / its time, all ranks",
    "step_mean": "mean of per-step samples/s after the first {skip_steps} logged steps (PaddleMIX's log analysis)",
    "whole_run": "all samples / the whole run's step time, warm-up included (HF Trainer train_samples_per_second)",
    "rank0_times": "rank 0's samples/s after the first {skip_steps} logged steps x {n} (the script's parser)",
}


def script_throughput(m: Measurement, definition: dict) -> float | None:
    """Throughput as another benchmark script defined it, from the same records as xfw's window ips
    (``definition``: a published file's ``throughput.<side>``, :mod:`xfw.recipe.published`). Per-step
    rates are rank 0's steps scaled to all ranks (every rank steps together)."""
    kind, ranks = definition.get("definition"), max(m.num_ranks, 1)
    skip, n = definition.get("skip_steps", 0), definition.get("n", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (skip, n)) or skip < 0 or n < 1:
        return None  # not a definition (xfw.recipe.published refuses it; a hand-edited spec.json: unreadable)
    steps = [(s, t) for s, t in m.rank0_steps if t > 0]
    if kind == "window":
        return m.ips
    if kind == "step_mean":
        rates = [s * ranks / t for s, t in steps[int(definition.get("skip_steps") or 0):]]
        return sum(rates) / len(rates) if rates else None
    if kind == "whole_run":
        return sum(s for s, _ in steps) * ranks / sum(t for _, t in steps) if steps else None
    if kind == "rank0_times":  # rank 0's rate over its steps after the skipped ones (else its window) x n
        if "skip_steps" in definition:
            kept = steps[int(definition["skip_steps"] or 0):]
            rank0 = sum(s for s, _ in kept) / sum(t for _, t in kept) if kept else None
        else:
            rank0 = m.per_rank[0]["ips"] if m.per_rank else None
        return None if rank0 is None else rank0 * int(definition.get("n") or 1)
    return None


def spread(values: list[float]) -> float | None:
    """Relative spread (max - min) / median of repeated measurements; None with fewer than 2."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / float(np.median(values))
