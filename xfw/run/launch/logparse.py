"""The fallback for commands xfw cannot hook: step times or throughput parsed from their log.

Some commands hide their Python process from xfw's probe (another language, a launcher that
scrubs the environment). For those a recipe names a regular expression with one group that
captures a number, and which log it is in::

    backends:
      other: {command: [./train.sh], log_pattern: {ips: 'samples/s: ([0-9.]+)', stream: stdout}}
      tqdm:  {command: [python, train.py], log_pattern: {steps_per_s: 'Steps: +(?P<step>\\d+)/.*?([0-9.]+)it/s',
                                                        after: 'Running training', stream: stderr}}

``step_time_s`` captures seconds per optimizer step; ``ips`` samples per second, taken as the
whole job's (global) rate over one step; ``steps_per_s`` optimizer steps per second (a progress
bar's ``it/s``), which becomes a step time of 1 / rate, and samples/s with the recipe's global
batch. ``after``: lines count only after the first line it matches (the start of training: a
weight-loading bar before it is not a step). A group named ``step`` (optional) makes a line count
only when its step differs from the last counted line's (a progress bar redrawn for the same step).
A group named ``unit`` (``steps_per_s`` and ``step_time_s``) that captures tqdm's other unit inverts
the number: ``([0-9.]+)(?P<unit>it/s|s/it)`` reads a bar that switches to ``s/it`` once a step takes
longer than a second (:data:`INVERSE_UNIT`).

Lines end at ``\\n`` or ``\\r`` (a progress bar rewrites its line with ``\\r``), the same while the
command runs and at the end. Each counted line is one step: the first ``measure.warmup_steps`` are
warm-up, the next ``measure.steps`` are measured; then xfw stops the command. The core writes the
ordinary ``steps.jsonl`` records from them (rank 0, the recipe's global batch as each step's
samples), with ``"source": "command_log"`` on the window, so every report marks the numbers as
parsed from the command's log, not measured by xfw. There is no ``applied`` record.

Bounded in memory and time whatever the command prints: a line is kept to :data:`MAX_LINE`
characters (a command printing megabytes without a newline costs no more), the log is read
:data:`CHUNK` bytes at a time, and the user's regular expressions run in a separate small Python
process that must answer each piece within :data:`MATCH_DEADLINE_S` (a pattern that backtracks
without end is ended there, and the run is ``invalid`` with a line naming the key).
"""

from __future__ import annotations

import codecs
import json
import re
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from xfw.contract.records import RecordWriter

KINDS = ("step_time_s", "ips", "steps_per_s")
INVERSE_UNIT = {"steps_per_s": "s/it", "step_time_s": "it/s"}
"""A group named ``unit`` that captures this text means the number is the inverse of the kind's unit: tqdm
prints ``it/s``, and ``s/it`` once a step takes longer than a second (a bar can switch mid-run)."""
STREAMS = ("stdout", "stderr")
SOURCE = "command_log"
NOTE = "parsed from the command's log: not measured by xfw"
MAX_LINE = 4096
"""Characters of one line kept for matching; the rest of a longer line is dropped."""
MAX_PATTERN = 1000
CHUNK = 1 << 20
"""Bytes of log read and matched at a time."""
POLL_BYTES = 16 * CHUNK
"""At most this much log is read per poll of the running command (the rest at the next one)."""
MATCH_DEADLINE_S = 5.0
"""How long the matcher may take for one chunk of log."""
MAX_VALUES = 100_000
_SEPARATORS = re.compile(r"[\r\n]")

_WORKER = r"""
import json, math, re, sys
try:  # ended with xfw, even inside a match that never returns (Linux: PR_SET_PDEATHSIG = 1, SIGKILL)
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
except Exception:
    pass
cfg = json.loads(sys.stdin.readline())
rx, after = re.compile(cfg["regex"]), re.compile(cfg["after"]) if cfg["after"] else None
step, unit = rx.groupindex.get("step"), rx.groupindex.get("unit")
group = next(i for i in range(1, rx.groups + 1) if i not in (step, unit))
started, last = after is None, None
for request in sys.stdin:
    out = []
    for line in json.loads(request):
        if not started:
            started = after.search(line) is not None
            continue
        m = rx.search(line)
        if m is None:
            continue
        try:
            value = float(m.group(group))
        except (TypeError, ValueError):
            continue
        if not (math.isfinite(value) and value > 0):
            continue
        if unit is not None and m.group(unit) == cfg["inverse_unit"]:
            value = 1.0 / value
        if step is not None:
            if m.group(step) == last:
                continue
            last = m.group(step)
        out.append(value)
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
"""


class PatternError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _compile(key: str, text) -> re.Pattern:
    if not isinstance(text, str) or not text:
        raise PatternError(key, f"must be a regular expression, got {text!r}")
    if len(text) > MAX_PATTERN:
        raise PatternError(key, f"is {len(text)} characters long; at most {MAX_PATTERN}")
    try:
        return re.compile(text)
    except (re.error, RecursionError, OverflowError) as err:
        raise PatternError(key, f"not a regular expression ({err})") from None


@dataclass(frozen=True)
class LogPattern:
    kind: str
    regex: re.Pattern
    stream: str = "stdout"
    after: re.Pattern | None = None

    @classmethod
    def parse(cls, data) -> "LogPattern":
        if not isinstance(data, dict):
            raise PatternError("", f"must be a mapping with one of {', '.join(KINDS)}, got {data!r}")
        unknown = sorted(set(data) - {*KINDS, "stream", "after"}, key=str)
        if unknown:
            raise PatternError(str(unknown[0]), f"unknown key (expected one of {', '.join(KINDS)}, stream and after)")
        kinds = [k for k in KINDS if k in data]
        if len(kinds) != 1:
            raise PatternError("", f"needs exactly one of {', '.join(KINDS)}, got {len(kinds)}")
        kind = kinds[0]
        regex = _compile(kind, data[kind])
        if "unit" in regex.groupindex and kind not in INVERSE_UNIT:
            raise PatternError(kind, "a group named unit (tqdm's it/s or s/it) is for steps_per_s and step_time_s")
        numbered = regex.groups - len({"step", "unit"} & set(regex.groupindex))
        if numbered != 1:
            raise PatternError(kind, f"needs exactly one group capturing the number (and optionally ones named "
                               f"step and unit), has {regex.groups}")
        after = _compile("after", data["after"]) if "after" in data else None
        stream = data.get("stream", "stdout")
        if stream not in STREAMS:
            raise PatternError("stream", f"must be one of {', '.join(STREAMS)}, got {stream!r}")
        return cls(kind, regex, stream, after)

    def step_time_s(self, value: float, global_batch: int) -> float:
        """One counted line's number as the step's time in seconds."""
        if self.kind == "step_time_s":
            return value
        return 1.0 / value if self.kind == "steps_per_s" else global_batch / value

    def values(self, text: str) -> list[float]:
        """Each counted line's number in ``text`` (bounded in time as the log is: :class:`Matcher`)."""
        matcher = Matcher(self)
        try:
            return matcher.match(Lines().feed(text, final=True))
        finally:
            matcher.close()


class Lines:
    """Text split into lines at ``\\n`` or ``\\r``, each kept to :data:`MAX_LINE` characters, the
    unfinished last one held (to the same bound) until more text or the end comes."""

    def __init__(self) -> None:
        self.partial = ""

    def feed(self, text: str, final: bool = False) -> list[str]:
        parts = _SEPARATORS.split(self.partial + text)
        self.partial = "" if final else parts.pop()[:MAX_LINE]
        return [p[:MAX_LINE] for p in parts if p]


class MatchTimeout(RuntimeError):
    pass


class Matcher:
    """The user's regular expressions in a small Python process of their own (``re`` holds the
    interpreter: a pattern that backtracks without end would hold xfw). It keeps the ``after`` and
    ``step`` state across pieces of a log; each piece must be answered within the deadline."""

    def __init__(self, pattern: LogPattern, deadline_s: float | None = None):
        self.pattern, self.failed = pattern, ""
        self.deadline_s = MATCH_DEADLINE_S if deadline_s is None else deadline_s
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        config = {"regex": pattern.regex.pattern, "after": pattern.after.pattern if pattern.after else None,
                  "inverse_unit": INVERSE_UNIT.get(pattern.kind)}
        self.proc.stdin.write((json.dumps(config) + "\n").encode())
        self.proc.stdin.flush()

    def match(self, lines: list[str]) -> list[float]:
        """The counted lines' numbers; MatchTimeout when the deadline passed (the worker is ended)."""
        if not lines:
            return []
        if self.failed:
            raise MatchTimeout(self.failed)
        try:
            self.proc.stdin.write((json.dumps(lines) + "\n").encode())
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], self.deadline_s)
            reply = self.proc.stdout.readline() if ready else b""
            return [float(v) for v in json.loads(reply)]
        except (OSError, ValueError):
            self.close()
            self.failed = (f"log_pattern: matching {len(lines)} line(s) of the command's {self.pattern.stream} took "
                           f"longer than {self.deadline_s:g} s (a pattern that backtracks without end?); "
                           "simplify the pattern")
            raise MatchTimeout(self.failed) from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class LogCounter:
    """Counts the lines that count as the command writes its log (the launcher polls it to stop the
    command); keeps their numbers for the records. A matcher that failed makes ``poll`` report
    enough lines, so the launcher stops the command, and ``failed`` says why."""

    def __init__(self, pattern: LogPattern, path: Path):
        self.pattern, self.path = pattern, path
        self._offset, self._lines = 0, Lines()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._matcher: Matcher | None = None
        self.values: list[float] = []
        self.count = 0
        self.failed = ""

    def _match(self, lines: list[str]) -> None:
        if self._matcher is None:
            self._matcher = Matcher(self.pattern)
        try:
            found = self._matcher.match(lines)
        except MatchTimeout as err:
            self.failed = str(err)
            return
        self.count += len(found)
        self.values.extend(found[:max(MAX_VALUES - len(self.values), 0)])

    def poll(self, final: bool = False) -> int:
        """Read what the log gained (all of it when ``final``) and count; a very large number once failed."""
        limit = None if final else POLL_BYTES
        read = 0
        while not self.failed and (limit is None or read < limit):
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    chunk = f.read(CHUNK)
                    self._offset = f.tell()
            except OSError:
                break
            read += len(chunk)
            last = final and len(chunk) < CHUNK
            self._match(self._lines.feed(self._decoder.decode(chunk, final=last), final=last))
            if len(chunk) < CHUNK:
                break
        return sys.maxsize if self.failed else self.count

    def close(self) -> None:
        if self._matcher is not None:
            self._matcher.close()
            self._matcher = None


def write_records(pattern: LogPattern, log_path: Path, records_path: Path, spec: dict, *,
                  exit_code: int | None, stopped: bool, counter: LogCounter | None = None) -> None:
    """``steps.jsonl`` from the command's log: every step found; the window and ``end`` when
    enough were found, else an ``invalid`` error when the command ended cleanly with too few or
    the pattern could not be matched in time (a command that failed is classified by its exit
    code and stderr, as any other). ``counter``: the one that watched the run (it reads the rest)."""
    warmup, steps, samples = spec["measure"]["warmup_steps"], spec["measure"]["steps"], spec["batch"]["global"]
    counter = counter or LogCounter(pattern, log_path)
    try:
        counter.poll(final=True)
    finally:
        counter.close()
    values = counter.values[:warmup + steps]
    times = [pattern.step_time_s(v, samples) for v in values]
    writer = RecordWriter(records_path, 0)
    try:
        writer.start(num_ranks=1, warmup_steps=warmup, steps=steps)
        for i, time_s in enumerate(times):
            writer.write("step", step=i, phase="warmup" if i < warmup else "measure", step_time_s=time_s,
                         samples=samples, tokens=0, loss=None, mem_alloc_peak_bytes=None, mem_reserved_peak_bytes=None)
        measured = times[warmup:]
        if counter.failed:
            writer.write("error", status="invalid", message=counter.failed)
        elif len(measured) == steps:
            writer.write("window", window_time_s=sum(measured), num_steps=steps, samples=samples * steps, tokens=0,
                         source=SOURCE)
            writer.write("end")
        elif exit_code == 0 and not stopped:
            writer.write("error", status="invalid", message=(
                f"the command's {pattern.stream} had {counter.count} line(s) matching log_pattern.{pattern.kind}"
                f"{' after the after: line' if pattern.after else ''}; the recipe measures {warmup} warm-up + "
                f"{steps} steps: let it run longer or lower measure.steps"))
    finally:
        writer.close()
