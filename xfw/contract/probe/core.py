"""The probe's state in one process: what it has seen, when a step ends, and what it writes.

Framework hooks (``xfw_torch.probe``, ``xfw_paddle.probe``: the only framework-specific parts)
report events; this class turns them into exactly the records xfw's own adapters write
(``start``, ``step`` x (warm-up + measured), ``window``, ``applied``, ``end``, or ``error``)::

    probe.saw_batch(batch)                    # a DataLoader yielded a batch (shapes are counted)
    probe.saw_model(framework, module, amp)   # an outermost forward began (before the first step)
    probe.trainer_began(framework, settings, model)   # a Trainer's on_train_begin: its arguments
    probe.boundary(framework, "optimizer", optimizer) # an optimizer step ended ("trainer": a callback's on_step_end)

Step boundaries come from a Trainer's callback when a Trainer trains (its ``on_step_end`` also
counts an fp16 step the loss scaler skipped), otherwise from the optimizer's step. The process
whose first boundary comes from a framework owns the run on that rank; the first boundary also
checks the world size against the recipe. After warm-up + measured steps the probe writes the
window, the ``applied`` settings and ``end``, then ends the command with ``SystemExit(0)`` raised
from the hook (the script's ``finally`` blocks and ``atexit`` handlers run; code after its
training loop does not).

It never breaks the script: an exception inside the probe is recorded as the run's ``crashed``
error and the probe turns itself off; the script goes on. At exit, a process that trained but did
not finish the measurement records why: the uncaught exception that ended it (``oom`` or
``crashed``), or, when it ended quietly, ``invalid`` (the command runs fewer steps than the
recipe measures). Processes that never trained (a launcher, a data worker) write nothing.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time
import traceback
from typing import Any, Callable, Protocol

from xfw.contract.probe import observe
from xfw.contract.probe.window import Device, Window
from xfw.contract.records import RecordWriter

EXIT_INVALID = 2  # as xfw.contract.harness.EXIT_INVALID


class Framework(Device, Protocol):
    """What a framework hook provides (see ``adapters/torch/xfw_torch/probe.py``)."""

    name: str

    def start(self) -> None:
        """At the first step: decide what the timestamps and peaks read (GPU if one is in use)."""
    def rank(self) -> int: ...
    def world_size(self) -> int: ...
    def mem_source(self) -> str: ...
    def count_params(self, model: Any, optimizer: Any) -> tuple[int, int]:
        """(total, trainable) of the model, or of the optimizer's parameters when no model was seen."""
    def facts(self, model: Any, wrapper: Any, optimizer: Any) -> dict:
        """What the objects show: framework_version, device, device_name, weight_dtype,
        attention_impl, recompute, sharding_impl, fused_optimizer, master_weights, tf32,
        versions (library -> version)."""
    def stop_watching_forward(self) -> None: ...


def _safe(method: Callable) -> Callable:
    """An event handler that never raises into the script (SystemExit, our stop, passes)."""

    @functools.wraps(method)
    def call(self: "Probe", *args, **kwargs):
        if self.disabled or self.done:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - the script must go on; the run records why it is not measured
            self.fail(err)
            return None

    return call


class Probe:
    def __init__(self, spec: dict, records_path: str):
        self.spec, self.records_path = spec, records_path
        self.warmup_steps, self.steps = spec["measure"]["warmup_steps"], spec["measure"]["steps"]
        self.expected_processes = spec["derived"]["num_processes"]
        self.frameworks: list[Framework] = []
        self.owner: Framework | None = None
        self.trainer: dict | None = None
        self.model: Any = None
        self.model_params = -1
        self.wrapper: Any = None
        self.amp: dict | None = None
        self.optimizer: Any = None
        self.boundary_source = ""
        self.done = self.disabled = self.armed = False
        self._t_first: float | None = None
        self._pending: dict[int, list[tuple[int, int]]] = {}  # data source -> (samples, tokens) per batch
        self.train_source: int | None = None
        self.last_step_batches: list[tuple[int, int]] = []
        self._writer: RecordWriter | None = None
        self.window: Window | None = None
        atexit.register(self._at_exit)

    # -- events from the framework hooks -------------------------------------------------------------
    def add_framework(self, framework: Framework) -> None:
        self.frameworks.append(framework)

    def _activity(self) -> None:
        self.armed = True
        if self._t_first is None:
            self._t_first = time.perf_counter()

    @_safe
    def saw_batch(self, batch: Any, source: Any = None) -> None:
        """A DataLoader yielded ``batch``; ``source`` tells training data from evaluation data
        (the dataset: the one that fed the first step is the training one)."""
        counts = observe.batch_counts(batch)
        if counts is None:
            return
        self._activity()
        key = id(source)
        if self.train_source is None or key == self.train_source:
            self._pending.setdefault(key, []).append(counts)

    @_safe
    def step_began(self) -> None:
        self._activity()

    @_safe
    def saw_model(self, framework: Framework, module: Any, amp: Callable[[], dict]) -> None:
        """An outermost forward began before the first step. The module with the most parameters is
        the model (the first one seen: a Trainer's unwrapped model); the last outermost module with
        as many is its wrapper (DDP, FSDP, a DeepSpeed engine); ``amp()`` reads the autocast state
        (``{"enabled": bool, "dtype": "bfloat16", "level": "O1" or absent}``)."""
        self._activity()
        if self.owner is not None:
            return
        if module is not self.model and module is not self.wrapper:
            total, _ = framework.count_params(module, None)
            if total < self.model_params:
                return
            if total > self.model_params:
                self.model, self.model_params = module, total
        self.wrapper, self.amp = module, amp()

    @_safe
    def trainer_began(self, framework: Framework, settings: dict, model: Any) -> None:
        """A Trainer starts training: its callback marks the steps; ``settings`` (applied-record
        fields) come from its arguments."""
        self._activity()
        self.trainer = dict(settings)
        if model is not None:
            total, _ = framework.count_params(model, None)
            if total >= self.model_params:
                self.model, self.model_params = model, total

    @_safe
    def boundary(self, framework: Framework, source: str, optimizer: Any = None) -> None:
        """One optimizer step ended. ``source``: "optimizer" (its step) or "trainer" (a callback)."""
        if optimizer is not None:
            self.optimizer = optimizer
        if source == "optimizer" and self.trainer is not None:
            return  # the Trainer's callback marks its steps
        if self.owner is None:
            self._begin(framework, source)
        elif framework is not self.owner:
            return
        samples, tokens = self._take_counts()
        if self.window.step(samples, tokens):
            self._finish()

    @_safe
    def call(self, function: Callable, *args) -> Any:
        """``function(*args)`` for a hook, under the same guard as the events."""
        return function(*args)

    # -- the run ---------------------------------------------------------------------------------------
    def _begin(self, framework: Framework, source: str) -> None:
        self.owner, self.boundary_source, self.armed = framework, source, True
        for fw in self.frameworks:
            fw.stop_watching_forward()  # the model is known; no per-module cost from here on
        framework.start()
        world = framework.world_size()
        self._writer = RecordWriter(self.records_path, framework.rank())
        if world != self.expected_processes:
            self._writer.write("error", status="invalid", message=(
                f"parallel: the recipe says {self.expected_processes} process(es) (parallel.nproc_per_node x "
                f"nnodes); the command runs {world}"))
            self.done = True
            raise SystemExit(EXIT_INVALID)
        self._writer.start(num_ranks=world, warmup_steps=self.warmup_steps, steps=self.steps)
        if self._pending:  # the data source that fed the first step is the training data
            self.train_source = max(self._pending, key=lambda k: sum(s for s, _ in self._pending[k]))
            self._pending = {self.train_source: self._pending[self.train_source]}
        self.window = Window(self._writer, framework, warmup_steps=self.warmup_steps, steps=self.steps,
                             start_s=self._t_first or time.perf_counter())

    def _take_counts(self) -> tuple[int, int]:
        """(samples, tokens) this rank trained on since the last step: counted from the training
        DataLoader's batches, or the recipe's batch per process when no DataLoader fed step 0."""
        if self.train_source is None:
            return self.spec["batch"]["global"] // self.expected_processes, 0
        batches = self._pending.pop(self.train_source, [])
        if batches:
            self.last_step_batches = batches
        return sum(s for s, _ in batches), sum(t for _, t in batches)

    def _finish(self) -> None:
        from xfw.contract.probe.applied import applied_record

        self._writer.write("applied", **applied_record(self))
        self._writer.write("end")
        self._writer.close()
        self.done = True
        sys.stdout.flush()
        print(f"xfw probe: {self.warmup_steps} warm-up + {self.steps} measured steps recorded; ending the command",
              file=sys.stderr, flush=True)
        raise SystemExit(0)  # stops the script at this step boundary; its finally blocks still run

    # -- failures --------------------------------------------------------------------------------------
    def _error(self, status: str, message: str) -> None:
        if self._writer is None:
            rank = self.frameworks[-1].rank() if self.frameworks else int(os.environ.get("RANK", "0"))
            self._writer = RecordWriter(self.records_path, rank)
        self._writer.write("error", status=status, message=message[:500])
        self._writer.close()
        self.done = True  # an error ends the record of this rank

    def fail(self, err: BaseException) -> None:
        """The probe itself failed: record it as the run's error, turn off, let the script go on."""
        self.disabled = True
        print("xfw probe: failed, the command runs on unmeasured:", file=sys.stderr)
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        try:
            self._error("crashed", f"xfw probe failed: {type(err).__name__}: {err}")
        except Exception:  # noqa: BLE001 - nowhere left to record it; stderr has the trace
            pass

    def _at_exit(self) -> None:
        if self.done or self.disabled or not self.armed:
            return
        error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # an uncaught exception
        try:
            if self.window is not None:
                self.window.flush()  # the steps it finished are kept
            if error is not None and not isinstance(error, SystemExit):
                self._error("oom" if observe.looks_like_oom(error) else "crashed",
                            f"{type(error).__name__}: {error}")
            elif self.owner is not None:
                done = self.window.num_steps if self.window else 0
                total = self.warmup_steps + self.steps
                self._error("invalid", f"the command ended after {done} optimizer step(s); the recipe measures "
                            f"{self.warmup_steps} warm-up + {self.steps} steps: let it run at least {total} "
                            "(e.g. its max_steps) or lower measure.steps")
        except Exception:  # noqa: BLE001 - at exit there is no one left to tell but stderr
            traceback.print_exc(file=sys.stderr)
