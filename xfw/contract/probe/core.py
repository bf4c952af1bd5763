"""The probe's state in one process: what it has seen, when a step ends, and what it writes.

Framework hooks (``xfw_torch.probe``, ``xfw_paddle.probe``: the only framework-specific parts)
report events; this class turns them into exactly the records xfw's own adapters write
(``start``, ``step`` x (warm-up + measured), ``window``, ``applied``, ``end``, or ``error``)::

    probe.saw_batch(batch)                    # a DataLoader yielded a batch (shapes are counted)
    probe.saw_model(framework, module)        # an outermost forward began (before the first step)
    probe.saw_amp(module, amp)                # the autocast state as a layer of that module ran
    probe.saw_forward(module, args, kwargs)   # a module watched for inputs ran with gradients on
    probe.trainer_began(framework, settings, model)   # a Trainer's on_train_begin: its arguments
    probe.boundary(framework, "optimizer", optimizer) # an optimizer step ended ("trainer": a callback's on_step_end)

The model is chosen at the first step's end among the modules whose outermost forward ran before
it (the UNet, the text encoder, the VAE of a diffusion script; a wrapper and what it wraps): the
one with the most trainable parameters, then the most parameters. From then on only its inputs
are watched: each forward it runs with gradients on is one micro-batch, and a step's samples and
tokens are the sum of what reached it (a prefetching loader's early batches are not counted in
the wrong step). Parameters are counted over every module seen, each parameter once.

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
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Protocol

from xfw.contract.probe import imports, observe
from xfw.contract.probe.variables import STAMP
from xfw.contract.probe.window import Device, Window
from xfw.contract.records import RECORD_SCHEMA, RecordWriter, validate_record

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
    def parameters(self, module: Any) -> list[tuple[int, int, bool]]:
        """(identity, size, trainable) of each parameter of ``module`` (ZeRO-3's by their full size)."""
    def watch_inputs(self, modules: list) -> None:
        """Report the forwards of exactly these modules (with gradients on) to ``probe.saw_forward``."""
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


class StampedWriter(RecordWriter):
    """Records as the adapters write them, each stamped with the run's token (``probe.STAMP``)."""

    def __init__(self, path: str, rank: int, token: str):
        super().__init__(path, rank)
        self.token = token

    def write(self, kind: str, **fields: Any) -> None:
        record = {"schema": RECORD_SCHEMA, "kind": kind, "rank": self.rank, **fields}
        problems = validate_record(record)
        assert not problems, f"the probe wrote an invalid record: {problems}"
        stamp = {STAMP: self.token} if self.token else {}
        self._file.write(json.dumps({**record, **stamp}, separators=(",", ":")) + "\n")
        self._file.flush()


class Probe:
    def __init__(self, spec: dict, records_path: str, token: str = ""):
        self.spec, self.records_path, self.token = spec, records_path, token
        self.warmup_steps, self.steps = spec["measure"]["warmup_steps"], spec["measure"]["steps"]
        self.expected_processes = spec["derived"]["num_processes"]
        self.frameworks: list[Framework] = []
        self.owner: Framework | None = None
        self.trainer: dict | None = None
        self.trainer_model: Any = None
        self.model: Any = None
        self.modules: dict[int, Any] = {}  # every module whose outermost forward ran before the first step
        self.wrapper: Any = None
        self.amp: dict | None = None
        self._amps: dict[int, dict] = {}  # outermost module -> the autocast state its layers ran under
        self._forwards: list[tuple[int, tuple[int, int]]] = []  # (module, (samples, tokens)) this step
        self.count_source = "recipe"
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
    def saw_model(self, framework: Framework, module: Any) -> None:
        """An outermost forward began before the first step: ``module`` takes part in training."""
        self._activity()
        if self.owner is None and id(module) not in self.modules:
            self.modules[id(module)] = module
            framework.watch_inputs(list(self.modules.values()))

    def saw_amp(self, module: Any, amp: dict) -> None:
        """The autocast state (``{"enabled": bool, "dtype": "bfloat16", "level": "O1" or absent}``)
        as a layer of the outermost ``module`` ran: where it takes effect (accelerate enters autocast
        inside the model's own forward). Enabled once is enabled."""
        seen = self._amps.get(id(module))
        if seen is None or (amp.get("enabled") and not seen.get("enabled")):
            self._amps[id(module)] = amp

    def saw_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        """A watched module ran with gradients on: one micro-batch reached it."""
        if self.disabled or self.done or (self.owner is not None and module is not self.model):
            return
        try:
            counts = observe.forward_counts(args, kwargs)
        except Exception as err:  # noqa: BLE001 - the script must go on
            self.fail(err)
            return
        if counts is not None:
            self._forwards.append((id(module), counts))
            if len(self._forwards) > 4096:  # forwards with no step in between (an evaluation with gradients)
                del self._forwards[:2048]

    @_safe
    def trainer_began(self, framework: Framework, settings: dict, model: Any) -> None:
        """A Trainer starts training: its callback marks the steps; ``settings`` (applied-record
        fields) come from its arguments."""
        self._activity()
        self.trainer = dict(settings)
        self.trainer_model = model

    @_safe
    def optimizer_began(self, framework: Framework) -> None:
        """An outermost optimizer step begins (the step breakdown's split the probe can see)."""
        if self.window is not None and framework is self.owner and not self.done:
            self.window.optimizer_began()

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
        self._choose_model(framework)
        framework.start()
        world = framework.world_size()
        self._writer = StampedWriter(self.records_path, framework.rank(), self.token)
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

    def _choose_model(self, framework: Framework) -> None:
        """The model: among the modules seen, those that ran with gradients on if any did, the one
        with the most trainable parameters, then the most; it alone is watched from here on."""
        candidates = list(self.modules.values())
        if not candidates and self.trainer_model is not None:
            candidates = [self.trainer_model]
            self.modules[id(self.trainer_model)] = self.trainer_model
        fed = {m for m, _ in self._forwards}
        candidates = [m for m in candidates if id(m) in fed] or candidates
        if candidates:
            def size(module):
                params = framework.parameters(module)
                return sum(n for _, n, t in params if t), sum(n for _, n, _ in params)
            self.model = self.wrapper = max(candidates, key=size)
            self.amp = self._amps.get(id(self.model))
            framework.watch_inputs([self.model])

    def _take_counts(self) -> tuple[int, int]:
        """(samples, tokens) this rank trained on since the last step: what reached the model's
        forward with gradients on, else the training DataLoader's batches, else the recipe's batch
        per process."""
        forwards = [c for m, c in self._forwards if self.model is not None and m == id(self.model)]
        self._forwards = []
        batches = self._pending.pop(self.train_source, []) if self.train_source is not None else []
        if forwards:
            self.count_source, batches = "forward", forwards
        elif self.train_source is None:
            self.count_source = "recipe"
            return self.spec["batch"]["global"] // self.expected_processes, 0
        else:
            self.count_source = "loader"
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
            self._writer = StampedWriter(self.records_path, rank, self.token)
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
        if self.done or self.disabled:
            return
        if not self.armed:
            missed = imports.missed()  # a framework imported without the probe's hooks: say so
            if missed:
                self._error("crashed", f"xfw's probe could not install its hooks: {', '.join(missed)} was imported "
                            "without them (an import system the probe does not see into); the run is not measured")
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
