"""The record format: the one thing adapters write and the core reads (``steps.jsonl``).

One flat, versioned JSON object per line, appended and flushed as it happens, units in the
keys. Each rank writes, in order: ``start``, ``step`` x (warm-up + measured), ``window``,
``applied``, ``end`` (or ``error`` instead of the rest when it cannot go on). A run with
``measure.eval_every`` (xfw converge) also writes an ``eval`` record before its first step, after
every K-th and after its last (rank 0 only)::

    {"schema": 1, "kind": "step", "rank": 0, "step": 12, "phase": "measure", "step_time_s": 0.412,
     "samples": 16, "tokens": 65536, "loss": 3.218, "mem_alloc_peak_bytes": 1048576,
     "mem_reserved_peak_bytes": null}

Optional fields (:data:`OPTIONAL`; runs written before them lack them and still load): a step's
``grad_norm_l2``, only when the run asked for it; what the step's data was: ``padded_tokens``
(sequence positions with padding; ``tokens`` counts only the trained ones), ``max_seq_len`` (its
longest sample) and ``batch_hashes`` (one hash per micro-batch, ``xfw.contract.batches.batch_hash``),
and the window record's ``padded_tokens``; ``rss_peak_bytes`` on every step and
``rss_after_build_bytes`` / ``rss_peak_since_build`` on ``start``, the process's resident memory
(``xfw.contract.rss``), the one memory measure both backends share on a CPU; the step breakdown,
``data_wait_s``, ``fwd_bwd_s`` and ``optimizer_s`` (``xfw.contract.harness.BREAKDOWN``; the last two
only from a session that offers the split; a probed command's steps carry ``optimizer_s`` alone). A run xfw attached to
(``xfw.contract.probe``) adds a few ``applied`` fields, and a window parsed from a command's log
says so (``"source": "command_log"``).

The core tails the file for live progress and computes every statistic from it
(``xfw.report.measure``); stdout is never parsed.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable

RECORD_SCHEMA = 1

_INT, _NUM, _STR, _BOOL, _LIST = (int,), (int, float), (str,), (bool,), (list,)
_NONE = (type(None),)
_DICT = (dict,)

# kind -> {key: accepted types}. Keys beginning with "version_" are allowed in "applied".
FIELDS: dict[str, dict[str, tuple]] = {
    "start": {"num_ranks": _INT, "warmup_steps": _INT, "steps": _INT, "t_unix_s": _NUM},
    "step": {
        "step": _INT, "phase": _STR, "step_time_s": _NUM, "samples": _INT, "tokens": _INT,
        "loss": _NUM + _NONE, "mem_alloc_peak_bytes": _INT + _NONE, "mem_reserved_peak_bytes": _INT + _NONE,
    },
    "window": {"window_time_s": _NUM, "num_steps": _INT, "samples": _INT, "tokens": _INT},
    "applied": {
        "framework": _STR, "framework_version": _STR, "device": _STR, "device_name": _STR,
        "weight_dtype": _STR, "compute_dtype": _STR, "amp_level": _STR, "master_weights": _BOOL,
        "sharding_impl": _STR, "attention_impl": _STR, "tf32": _BOOL, "fused_optimizer": _BOOL,
        "recompute": _BOOL, "num_params_total": _INT, "num_params_trainable": _INT,
        "num_processes": _INT, "grad_accum_steps": _INT, "mem_source": _STR, "notes": _STR,
    },
    # An evaluation of the held-out split (xfw converge; the harness with ``measure.eval_every``): after
    # ``step`` optimizer steps (0: before any), the loss over every held-out sample without gradients,
    # weighted by trained tokens (by samples for a family without them), and how long it took.
    "eval": {"step": _INT, "samples_seen": _INT, "eval_loss": _NUM + _NONE, "eval_samples": _INT,
             "eval_tokens": _INT, "eval_time_s": _NUM},
    "error": {"status": _STR, "message": _STR},
    "end": {},
}
# kind -> {key: accepted types} that a record may carry. ``grad_norm_l2``: the global L2 norm of
# the trainable parameters' gradients before the optimizer step (parity asks for it; reading it is a
# host sync every step, so measured runs never carry it). The data keys describe what the step
# trained on (module docstring); ``batch_hashes`` is a list of strings. ``rss_*``: the harness's
# resident-memory readings (xfw.contract.rss): the peak so far on each step; on ``start`` the
# resident set right after the model is built, and whether the peak counts from there (else from
# the process's start).
OPTIONAL: dict[str, dict[str, tuple]] = {
    "step": {"grad_norm_l2": _NUM + _NONE, "padded_tokens": _INT, "max_seq_len": _INT, "batch_hashes": _LIST,
             "rss_peak_bytes": _INT + _NONE,
             # The step breakdown (xfw.contract.harness.BREAKDOWN): its parts, summing to step_time_s.
             "data_wait_s": _NUM, "fwd_bwd_s": _NUM, "optimizer_s": _NUM},
    "start": {"rss_after_build_bytes": _INT + _NONE, "rss_peak_since_build": _BOOL},
    # What a run xfw attached to (xfw.contract.probe) can see beyond the adapters' fields: the
    # micro-batch per process, Paddle's fp32 master gradients, and where its steps end.
    "applied": {"micro_batch": _INT, "master_grad": _BOOL, "step_boundary": _STR,
                # How each setting was carried out, under neutral keys both adapters share (docs/design.md
                # §11: attention_kernel, optimizer_impl, grad_reduce_dtype, master_grads, tf32, checkpointing,
                # ...); the variables the recipe set, as the process saw them; and each knob asked for but
                # not carried out on this machine, with what ran instead and why.
                "mechanisms": _DICT, "env": _DICT, "not_honoured": _DICT,
                # An attached run's parameters per module that took part: {"UNet2DConditionModel":
                # {"total": n, "trainable": n}, ...} (xfw.contract.probe.applied.count_params).
                "params_by_module": _DICT,
                # Seconds the adapter spent compiling its step programs ahead of the steps (JAX's jit),
                # measured apart from every step and the window (docs/jax.md).
                "compile_time_s": _NUM},
    # "command_log": the window was parsed from a command's log (xfw.run.launch.logparse), not measured by xfw.
    "window": {"source": _STR, "padded_tokens": _INT},
}
PHASES = ("warmup", "measure")
_MAY_DIVERGE = ("loss", "grad_norm_l2", "eval_loss")
ERROR_STATUSES = ("unsupported", "invalid", "oom", "crashed")
MEM_SOURCES = ("cuda_allocator", "host_allocator", "peak_rss")
WINDOW_SOURCES = ("xfw", "command_log")


def validate_record(record: Any) -> list[str]:
    """Problems with one record against the schema; an empty list means it is valid."""
    if not isinstance(record, dict):
        return [f"record is not an object: {record!r}"]
    problems = []
    if record.get("schema") != RECORD_SCHEMA:
        problems.append(f"schema must be {RECORD_SCHEMA}, got {record.get('schema')!r}")
    kind = record.get("kind")
    if kind not in FIELDS:
        return problems + [f"unknown kind {kind!r}"]
    if not isinstance(record.get("rank"), int) or record["rank"] < 0:
        problems.append(f"rank must be a non-negative integer, got {record.get('rank')!r}")
    expected = FIELDS[kind]
    for key, types in expected.items():
        if key not in record:
            problems.append(f"{kind}: missing {key!r}")
        elif not isinstance(record[key], types) or (types is not _BOOL and isinstance(record[key], bool)):
            problems.append(f"{kind}: {key!r} has type {type(record[key]).__name__}, expected {types}")
    optional = OPTIONAL.get(kind, {})
    for key in record:
        if key in ("schema", "kind", "rank") or key in expected:
            continue
        if key in optional:
            if not isinstance(record[key], optional[key]) or (optional[key] is not _BOOL and isinstance(record[key], bool)):
                problems.append(f"{kind}: {key!r} has type {type(record[key]).__name__}, expected {optional[key]}")
            elif optional[key] is _LIST and not all(isinstance(v, str) for v in record[key]):
                problems.append(f"{kind}: {key!r} must be a list of strings")
            continue
        if kind == "applied" and key.startswith("version_") and isinstance(record[key], str):
            continue
        problems.append(f"{kind}: unexpected key {key!r}")
    if kind == "step" and record.get("phase") not in PHASES:
        problems.append(f"step: phase must be one of {PHASES}, got {record.get('phase')!r}")
    if kind == "error" and record.get("status") not in ERROR_STATUSES:
        problems.append(f"error: status must be one of {ERROR_STATUSES}, got {record.get('status')!r}")
    if kind == "window" and record.get("source", "xfw") not in WINDOW_SOURCES:
        problems.append(f"window: source must be one of {WINDOW_SOURCES}, got {record.get('source')!r}")
    if kind == "applied" and record.get("mem_source") not in MEM_SOURCES:
        problems.append(f"applied: mem_source must be one of {MEM_SOURCES}, got {record.get('mem_source')!r}")
    for key, value in record.items():  # a loss or gradient norm may diverge; a time or a count may not
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _MAY_DIVERGE:
            if not math.isfinite(value) or value < 0:
                problems.append(f"{kind}: {key!r} must be a finite number >= 0, got {value!r}")
    if kind == "window" and record.get("window_time_s") == 0:
        problems.append("window: 'window_time_s' must be positive, got 0")
    return problems


class RecordWriter:
    """Appends records for one rank, flushing each line so the core can tail the file."""

    def __init__(self, path: str | os.PathLike, rank: int):
        self.rank = rank
        self._file = open(path, "a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        record = {"schema": RECORD_SCHEMA, "kind": kind, "rank": self.rank, **fields}
        problems = validate_record(record)
        assert not problems, f"adapter wrote an invalid record: {problems}"
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def start(self, *, num_ranks: int, warmup_steps: int, steps: int, **optional: Any) -> None:
        self.write("start", num_ranks=num_ranks, warmup_steps=warmup_steps, steps=steps, t_unix_s=time.time(),
                   **optional)

    def close(self) -> None:
        self._file.close()


def applied_settings(records: list[dict]) -> dict:
    """The lowest rank's ``applied`` record without its envelope (rank 0's, or the first rank of a
    node's part of a multi-node run); {} when there is none."""
    applied = [r for r in records if r.get("kind") == "applied" and isinstance(r.get("rank"), int)]
    first = min(applied, key=lambda r: r["rank"], default={})
    return {k: v for k, v in first.items() if k not in ("schema", "kind", "rank")}


def parse_lines(lines: Iterable[str]) -> list[dict]:
    """Records from JSON lines; a torn last line (a process killed mid-write) is dropped."""
    out = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load_records(path: str | os.PathLike) -> list[dict]:
    """Every record that parses (lenient: for live progress and for classifying a run that just ended)."""
    from xfw.contract.atomic import UnreadableFile, read_bounded

    try:
        text = read_bounded(path, MAX_RECORDS_BYTES).decode("utf-8", "replace")
    except (OSError, UnreadableFile):  # missing, or not a file xfw reads (a FIFO, a device): no records
        return []
    return parse_lines(text.split("\n"))


MAX_RECORDS_BYTES = 1 << 30
"""Largest steps.jsonl read (a million steps on eight ranks is about 2.5 GB: far past any recipe's bounds)."""


def read_records(path: str | os.PathLike) -> tuple[list[dict], str]:
    """Every record of a finished run, checked against the schema: (records, problem). ``problem``
    names the file and the first bad line ("" when all are good); only a torn last line (a process
    killed mid-write) is forgiven."""
    from xfw.contract.atomic import UnreadableFile, read_bounded

    path = Path(path)
    try:
        lines = read_bounded(path, MAX_RECORDS_BYTES).decode("utf-8").split("\n")
    except FileNotFoundError:
        lines = []
    except UnreadableFile as err:
        return [], str(err)
    except (OSError, UnicodeDecodeError) as err:
        return [], f"{path}: cannot read ({getattr(err, 'strerror', None) or err})"
    records, last = [], max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if i == last:
                continue
            return records, f"{path}: line {i + 1} is not JSON"
        problems = validate_record(record)
        if problems:
            return records, f"{path}: line {i + 1}: {problems[0]}"
        records.append(record)
    return records, ""


class RecordTail:
    """Reads records appended since the last call (for live progress while a backend runs)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._offset = 0
        self._partial = ""

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self._offset)
            chunk = f.read(1 << 24)  # bounded: a command may write anything into its records file
            self._offset = f.tell()
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()[:1 << 20]  # incomplete until its newline arrives (no record is this long)
        return parse_lines(lines)
