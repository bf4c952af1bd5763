"""The fallback for commands xfw cannot hook: step times or throughput parsed from their log.

Some commands hide their Python process from xfw's probe (another language, a launcher that
scrubs the environment). For those a recipe names a regular expression with one group that
captures a number, and which log it is in::

    backends:
      other: {command: [./train.sh], log_pattern: {ips: 'samples/s: ([0-9.]+)', stream: stdout}}

``step_time_s`` captures seconds per optimizer step; ``ips`` samples per second, taken as the
whole job's (global) rate over one step. Each matching line is one step: the first
``measure.warmup_steps`` are warm-up, the next ``measure.steps`` are measured; then xfw stops the
command. The core writes the ordinary ``steps.jsonl`` records from them (rank 0, the recipe's
global batch as each step's samples; an ``ips`` line becomes a step time of global batch / ips),
with ``"source": "command_log"`` on the window, so every report marks the numbers as parsed from
the command's log, not measured by xfw. There is no ``applied`` record: xfw saw no settings.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from xfw.contract.records import RecordWriter

KINDS = ("step_time_s", "ips")
STREAMS = ("stdout", "stderr")
SOURCE = "command_log"
NOTE = "parsed from the command's log: not measured by xfw"


class PatternError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class LogPattern:
    kind: str
    regex: re.Pattern
    stream: str = "stdout"

    @classmethod
    def parse(cls, data) -> "LogPattern":
        if not isinstance(data, dict):
            raise PatternError("", f"must be a mapping with one of {', '.join(KINDS)}, got {data!r}")
        unknown = sorted(set(data) - {*KINDS, "stream"})
        if unknown:
            raise PatternError(unknown[0], f"unknown key (expected one of {', '.join(KINDS)}, and stream)")
        kinds = [k for k in KINDS if k in data]
        if len(kinds) != 1:
            raise PatternError("", f"needs exactly one of {', '.join(KINDS)}, got {len(kinds)}")
        kind, text = kinds[0], data[kinds[0]]
        if not isinstance(text, str) or not text:
            raise PatternError(kind, f"must be a regular expression, got {text!r}")
        try:
            regex = re.compile(text)
        except re.error as err:
            raise PatternError(kind, f"not a regular expression ({err})") from None
        if regex.groups != 1:
            raise PatternError(kind, f"needs exactly one group capturing the number, has {regex.groups}")
        stream = data.get("stream", "stdout")
        if stream not in STREAMS:
            raise PatternError("stream", f"must be one of {', '.join(STREAMS)}, got {stream!r}")
        return cls(kind, regex, stream)

    def values(self, text: str) -> list[float]:
        """Each matching line's number (lines whose capture is not a positive finite number are skipped)."""
        out = []
        for line in text.splitlines():
            match = self.regex.search(line)
            if match is None:
                continue
            try:
                value = float(match.group(1))
            except (TypeError, ValueError):
                continue
            if math.isfinite(value) and value > 0:
                out.append(value)
        return out


class LogCounter:
    """Counts matching lines as the command writes its log (the launcher polls it to stop the command)."""

    def __init__(self, pattern: LogPattern, path: Path):
        self.pattern, self.path = pattern, path
        self._offset, self._partial, self.count = 0, "", 0

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except OSError:
            return self.count
        text = self._partial + chunk.decode("utf-8", "replace")
        complete, _, self._partial = text.rpartition("\n")
        self.count += len(self.pattern.values(complete))
        return self.count


def write_records(pattern: LogPattern, log_path: Path, records_path: Path, spec: dict, *,
                  exit_code: int | None, stopped: bool) -> None:
    """``steps.jsonl`` from the command's log: every step found; the window and ``end`` when
    enough were found, else an ``invalid`` error when the command ended cleanly with too few (a
    command that failed is classified by its exit code and stderr, as any other)."""
    warmup, steps, samples = spec["measure"]["warmup_steps"], spec["measure"]["steps"], spec["batch"]["global"]
    try:
        text = log_path.read_bytes().decode("utf-8", "replace")
    except OSError:
        text = ""
    values = pattern.values(text)[:warmup + steps]
    times = [v if pattern.kind == "step_time_s" else samples / v for v in values]
    writer = RecordWriter(records_path, 0)
    try:
        writer.start(num_ranks=1, warmup_steps=warmup, steps=steps)
        for i, time_s in enumerate(times):
            writer.write("step", step=i, phase="warmup" if i < warmup else "measure", step_time_s=time_s,
                         samples=samples, tokens=0, loss=None, mem_alloc_peak_bytes=None, mem_reserved_peak_bytes=None)
        measured = times[warmup:]
        if len(measured) == steps:
            writer.write("window", window_time_s=sum(measured), num_steps=steps, samples=samples * steps, tokens=0,
                         source=SOURCE)
            writer.write("end")
        elif exit_code == 0 and not stopped:
            writer.write("error", status="invalid", message=(
                f"the command's {pattern.stream} had {len(values)} line(s) matching log_pattern.{pattern.kind}; "
                f"the recipe measures {warmup} warm-up + {steps} steps: let it run longer or lower measure.steps"))
    finally:
        writer.close()
