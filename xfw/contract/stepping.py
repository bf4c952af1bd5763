"""The step and window primitives the harness owns, shared by every loop that trains through it.

Given an adapter's :class:`Session` and a spec; returns what one optimizer step did and what it cost, without a host
sync of its own: :class:`Steps` hands out each step's micro-batches (synthetic or prepared), :func:`train_one_step`
runs one with the breakdown's split points, :func:`step_parts` turns those timestamps into the :data:`BREAKDOWN`
parts, and :func:`close_window` writes the ``window`` and ``applied`` records. The harness's measured loop
(:mod:`xfw.contract.harness`) and the learning-curve loop (:mod:`xfw.contract.curves`) both run on these; neither
reaches into the other. :class:`Unsupported` and :class:`InvalidSpec` are what an adapter raises (the harness
re-exports them, the name adapters import).
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from xfw.contract import batches, synthetic
from xfw.contract import records as rec


class Unsupported(Exception):
    """This backend cannot run this spec here (a GPU-only feature on CPU, a missing family)."""


class InvalidSpec(Exception):
    """A backend knob or setting this adapter rejects."""


class Session(Protocol):
    """What an adapter provides. Timestamps and loss tokens are opaque to the core."""

    rank: int
    num_ranks: int

    def to_device(self, batch: dict) -> Any: ...
    # Optional: ``batches(dataset)`` -> iterator of (device batch, description as numpy): the
    # adapter's own DataLoader over a MicroBatches data set (prepared data; ``loader_settings``).
    def train_step(self, micro_batches: list) -> Any:
        """One optimizer step over the micro-batches (gradient accumulation); returns the
        loss as a framework scalar, still on the device."""
    # Optional, the step's split points (the step breakdown, :data:`BREAKDOWN`): ``forward_backward
    # (micro_batches) -> loss`` (every micro-batch's forward and backward, gradients reduced) and
    # ``optimizer_step()`` (clipping, the update, zeroing): ``train_step`` is the two in turn.
    def loss_token(self, loss: Any) -> Any:
        """Start an asynchronous device-to-host copy of the loss; no host sync."""
    def loss_value(self, token: Any) -> float:
        """The loss as a float; called only once the step's end timestamp is done."""
    def timestamp(self) -> Any:
        """Record a point in the device's stream of work (a CUDA event; a clock on CPU)."""
    def is_done(self, stamp: Any) -> bool:
        """Whether the device has passed the timestamp; never blocks."""
    def elapsed_s(self, start: Any, end: Any) -> float: ...
    def synchronize(self) -> None: ...
    def memory_peaks(self) -> tuple[int | None, int | None]:
        """(max allocated, max reserved) in bytes so far; None where the source has none."""
    def is_oom(self, error: BaseException) -> bool: ...
    def applied(self) -> dict:
        """The settings actually applied (the ``applied`` record's fields)."""
    # Optional, for ``measure.eval_every`` (xfw converge): ``eval_loss(batch) -> float``, the loss of one
    # device micro-batch without gradients, computed as training computes it (same precision), a host sync.
    def grad_norm(self) -> float:
        """Only when :func:`wants_grad_norm`: the last ``train_step``'s global L2 norm over every
        trainable parameter's gradient (accumulated over its micro-batches, unscaled, before the
        optimizer step), summed in float64. A host sync."""


BREAKDOWN = ("data_wait_s", "fwd_bwd_s", "optimizer_s")
"""A step's parts, between the timestamps the harness places (no host sync added): waiting on the
data (its micro-batches fetched and on the device), forward + backward (communication that
overlaps backward included), the optimizer step (clipping included). They sum to ``step_time_s``."""


def train_one_step(session: Session, data: "Steps", step: int, described: list) -> tuple[Any, list]:
    """One step with the breakdown's split points: (loss, the timestamps after its data and, when the
    session has the split, after forward + backward); the caller's end timestamp closes the last part."""
    micro_batches, metas = data.next(step)
    described.append(metas)
    marks = [session.timestamp()]
    if not hasattr(session, "forward_backward"):
        return session.train_step(micro_batches), marks
    loss = session.forward_backward(micro_batches)
    marks.append(session.timestamp())
    session.optimizer_step()
    return loss, marks


def step_parts(session: Session, start: Any, marks: list, end: Any) -> dict:
    points = [start, *marks, end]
    return {key: session.elapsed_s(a, b) for key, a, b in zip(BREAKDOWN, points, points[1:])} if len(marks) == 2 \
        else {BREAKDOWN[0]: session.elapsed_s(start, marks[0])}


class Steps:
    """The micro-batches of each optimizer step, with their descriptions (``xfw.contract.batches``).

    Synthetic data: a pool made and converted before anything is timed, cycled. Prepared data: the
    adapter's own DataLoader over :class:`~xfw.contract.batches.MicroBatches` (``Session.batches``),
    consumed inside the timed loop as real training consumes it; an adapter without one converts
    each batch where it is read."""

    def __init__(self, spec: dict, session: Session):
        self.accum = spec["derived"]["grad_accum_steps"]
        if spec["data"]["kind"] == "synthetic":
            pool_np = synthetic.make_pool(spec, session.rank)
            metas = [batches.unpack(batches.describe(b)) for b in pool_np]
            pool = [session.to_device(b) for b in pool_np]  # converted before anything is timed
            # Each pool slot's micro-batches and descriptions, ready to hand out as they are.
            self.slots = [(pool[k:k + self.accum], metas[k:k + self.accum]) for k in range(0, len(pool), self.accum)]
            self.stream = None
        else:
            dataset = batches.MicroBatches(spec, session.rank)
            iterate = getattr(session, "batches", None)
            self.stream = iter(iterate(dataset) if iterate else ((session.to_device(b), m) for b, m in dataset))

    def next(self, step: int) -> tuple[list, list[tuple[int, int, int, str]]]:
        if self.stream is None:
            return self.slots[step % len(self.slots)]
        items = [next(self.stream) for _ in range(self.accum)]
        return [b for b, _ in items], [batches.unpack(m) for _, m in items]


def close_window(writer: rec.RecordWriter, session: Session, spec: dict, described: list, window_s: float) -> None:
    """The ``window`` record (the measured steps' samples, trained and padded tokens) and ``applied``."""
    warmup, steps = spec["measure"]["warmup_steps"], spec["measure"]["steps"]
    samples = spec["batch"]["micro"] * spec["derived"]["grad_accum_steps"] * steps
    measured = described[warmup:]
    writer.write("window", window_time_s=window_s, num_steps=steps, samples=samples,
                 tokens=sum(m[0] for metas in measured for m in metas),
                 padded_tokens=sum(m[1] for metas in measured for m in metas))
    writer.write("applied", **applied_record(session, spec))


def applied_record(session: Session, spec: dict) -> dict:
    """The session's ``applied`` fields, plus the variables the recipe set for this backend
    (``backends.NAME.env``) as this process saw them."""
    applied = session.applied()
    if spec.get("backend_env"):
        applied["env"] = {name: os.environ.get(name) for name in spec["backend_env"]}
    return applied
