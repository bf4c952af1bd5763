"""Timing from step boundaries the probe is told about: warm-up, then one measured window.

The harness (:mod:`xfw.contract.harness`) owns its loop and times each ``train_step`` call. In a
command xfw did not write, the script owns the loop, so the probe is told where each optimizer step
ends and this class times from boundary to boundary with the same method:

* warm-up steps are synchronised at their end and recorded as ``phase: warmup`` (excluded from
  every statistic); the last one's synchronisation opens the measured window;
* inside the window, each boundary records a device timestamp (a CUDA event on GPU, the clock on
  CPU) and nothing else: no host sync. Records are written as the device passes the timestamps,
  at most once per :data:`DRAIN_INTERVAL_S`;
* the last measured boundary synchronises once more and closes the window::

    window = Window(writer, device, warmup_steps=3, steps=20, start_s=time.perf_counter())
    done = window.step(samples=8, tokens=512)     # at each optimizer step's end; True after the last

A step's time is everything the script did between two boundaries: data loading, the forward and
backward passes, the optimizer, logging. The step records carry no loss (the probe does not read
the script's tensors).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from xfw.contract.records import RecordWriter

DRAIN_INTERVAL_S = 1.0
"""As :data:`xfw.contract.harness.DRAIN_INTERVAL_S` (that module needs numpy, which a user's
interpreter may lack, so it is not imported here; a unit test holds the two equal)."""


class Device(Protocol):
    """The timing half of :class:`xfw.contract.harness.Session`, as a framework hook provides it."""

    def timestamp(self) -> Any: ...
    def is_done(self, stamp: Any) -> bool: ...
    def elapsed_s(self, start: Any, end: Any) -> float: ...
    def synchronize(self) -> None: ...
    def memory_peaks(self) -> tuple[int | None, int | None]: ...


class Window:
    def __init__(self, writer: RecordWriter, device: Device, *, warmup_steps: int, steps: int, start_s: float):
        assert warmup_steps >= 1, "the window opens at a warm-up step's end"
        self.writer, self.device = writer, device
        self.warmup_steps, self.steps = warmup_steps, steps
        self.num_steps = 0
        self._t_prev = start_s
        self._t_start = self._t_drain = 0.0
        self._stamps: list[Any] = []
        self._counts: list[tuple[int, int]] = []
        self._written = 0
        self._opt_stamp: Any = None
        self._opt_stamps: list[Any] = []  # per measured step: its optimizer step's start, or None

    def _write_step(self, step: int, phase: str, time_s: float, samples: int, tokens: int, **parts: float) -> None:
        alloc, reserved = self.device.memory_peaks()
        self.writer.write("step", step=step, phase=phase, step_time_s=max(time_s, 0.0), samples=samples,
                          tokens=tokens, loss=None, mem_alloc_peak_bytes=alloc, mem_reserved_peak_bytes=reserved,
                          **parts)

    def optimizer_began(self) -> None:
        """The outermost optimizer step of the current step begins: a timestamp (no sync), so the
        measured step record carries ``optimizer_s`` (the step breakdown's part the probe can see:
        from there to the step's end)."""
        self._opt_stamp = self.device.timestamp()

    def _drain(self, upto: int) -> None:
        """Write every measured step whose end timestamp the device has passed (``upto``: all)."""
        while self._written < upto and self.device.is_done(self._stamps[self._written + 1]):
            samples, tokens = self._counts[self._written]
            opt = self._opt_stamps[self._written]
            parts = {} if opt is None else {"optimizer_s": self.device.elapsed_s(opt, self._stamps[self._written + 1])}
            self._write_step(self.warmup_steps + self._written, "measure",
                             self.device.elapsed_s(self._stamps[self._written], self._stamps[self._written + 1]),
                             samples, tokens, **parts)
            self._written += 1

    def flush(self) -> None:
        """Write the measured steps the device has finished (no sync): before an error record."""
        self._drain(len(self._counts))

    def step(self, samples: int, tokens: int) -> bool:
        """One optimizer step has ended; True when it was the last measured one (window written)."""
        index = self.num_steps
        self.num_steps += 1
        if index < self.warmup_steps:
            self.device.synchronize()  # SYNC: warm-up only
            now = time.perf_counter()
            self._write_step(index, "warmup", now - self._t_prev, samples, tokens)
            self._t_prev = now
            if index == self.warmup_steps - 1:  # the window opens here, synchronised just above
                self._t_start = self._t_drain = time.perf_counter()
                self._stamps = [self.device.timestamp()]
            return False
        self._stamps.append(self.device.timestamp())
        self._counts.append((samples, tokens))
        self._opt_stamps.append(self._opt_stamp)
        self._opt_stamp = None
        if index < self.warmup_steps + self.steps - 1:
            if time.perf_counter() - self._t_drain >= DRAIN_INTERVAL_S:
                self._t_drain = time.perf_counter()
                self._drain(len(self._counts))
            return False
        self.device.synchronize()  # SYNC: window end
        window_s = time.perf_counter() - self._t_start
        self._drain(len(self._counts))  # every timestamp is done now
        self.writer.write("window", window_time_s=window_s, num_steps=self.steps,
                          samples=sum(s for s, _ in self._counts), tokens=sum(t for _, t in self._counts))
        return True
