"""Learning curves: training with a held-out split evaluated as it goes (``measure.eval_every``).

``xfw converge`` runs each seed's training through :func:`train_with_evals` (the harness hands over when
the spec asks for evaluations): every step synchronised, since such a run is a curve and not a speed
measurement, and the held-out samples (``data.eval_samples``, :class:`xfw.contract.batches.EvalBatches`)
evaluated before the first step, every K steps and after the last through the session's optional
``eval_loss(batch)``. Rank 0 writes one ``eval`` record each time (``xfw.contract.records``)::

    {"kind": "eval", "step": 25, "samples_seen": 100, "eval_loss": 2.318, "eval_samples": 24, ...}

A loss that is not finite, or above :data:`BLOWUP` times the first step's, ends the curve there as
diverged: the held-out split is evaluated once more at that step (its loss recorded as it is) and no
further step runs; the converge report counts that seed as diverged for that side.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from xfw.contract import batches
from xfw.contract import records as rec
from xfw.contract.stepping import InvalidSpec, Session, Unsupported, close_window, step_parts, train_one_step


BLOWUP = 10.0
"""A train loss above this many times the first step's has blown up: the curve ends as diverged."""


def diverged(loss: float | None, first: float | None) -> bool:
    """A non-finite loss, or one above :data:`BLOWUP` times the first (``xfw.report.converge`` agrees)."""
    if loss is None:
        return False
    return not math.isfinite(loss) or (first is not None and first > 0 and loss > BLOWUP * first)


def eval_every(spec: dict) -> int:
    """``measure.eval_every``: evaluate the held-out split every K optimizer steps (0: never)."""
    return int(spec["measure"].get("eval_every") or 0)


class Evaluator:
    """The held-out split's loss (``data.eval_samples``, :class:`~xfw.contract.batches.EvalBatches`):
    every micro-batch's forward without gradients (``Session.eval_loss``, a host sync), weighted by
    its trained tokens (by its samples for a family without them). Every rank evaluates the whole split."""

    def __init__(self, spec: dict, session: Session):
        if spec["data"]["kind"] == "synthetic":
            raise InvalidSpec("measure.eval_every: needs real data (a held-out split of data.kind llava_json or "
                              "image_captions); synthetic batches are a cycled pool with nothing to hold out")
        if not hasattr(session, "eval_loss"):
            raise Unsupported("this adapter cannot evaluate a held-out split (no Session.eval_loss)")
        self.session, self.dataset = session, batches.EvalBatches(spec)
        if not len(self.dataset):
            raise InvalidSpec("data.eval_samples: measure.eval_every needs held-out samples (data.eval_samples >= 1)")

    def __call__(self) -> tuple[float, int, int, float]:
        """(eval loss, samples, trained tokens, seconds)."""
        session, t0 = self.session, time.perf_counter()
        iterate = getattr(session, "batches", None)
        stream = iterate(self.dataset) if iterate else ((session.to_device(b), m) for b, m in self.dataset)
        total = weight = tokens = 0
        for size, (batch, meta) in zip(self.dataset.sizes, stream):
            trained = batches.unpack(meta)[0]
            w = trained or size
            total, weight, tokens = total + session.eval_loss(batch) * w, weight + w, tokens + trained
        return total / weight, sum(self.dataset.sizes), tokens, time.perf_counter() - t0


def train_with_evals(spec: dict, writer: rec.RecordWriter, session: Session, data, write_step: Callable,
                     grad_norms: list | None, described: list) -> None:
    """``measure.eval_every`` (xfw converge): every step synchronised (a learning curve, not a speed
    measurement: converge measures speed in a run of its own), the held-out split evaluated before the
    first step, after every ``every``-th and after the last; eval records from rank 0."""
    warmup, every = spec["measure"]["warmup_steps"], eval_every(spec)
    total, per_step = warmup + spec["measure"]["steps"], spec["batch"]["global"]
    evaluate = Evaluator(spec, session)

    def eval_at(step: int) -> None:
        session.synchronize()
        loss, samples, tokens, took = evaluate()
        if writer.rank == 0:
            writer.write("eval", step=step, samples_seen=step * per_step, eval_loss=loss, eval_samples=samples,
                         eval_tokens=tokens, eval_time_s=took)

    eval_at(0)
    window_s, first = 0.0, None
    for step in range(total):
        start = session.timestamp()
        loss, marks = train_one_step(session, data, step, described)
        end = session.timestamp()
        session.synchronize()  # SYNC: every step (a learning curve)
        if grad_norms is not None:
            grad_norms.append(session.grad_norm())
        time_s = session.elapsed_s(start, end)
        window_s += time_s if step >= warmup else 0.0
        value = session.loss_value(session.loss_token(loss))
        write_step(step, "warmup" if step < warmup else "measure", time_s, value,
                   step_parts(session, start, marks, end))
        first = value if first is None else first
        if diverged(value, first):  # ends the curve: the seed diverged on this side (module docstring)
            eval_at(step + 1)
            break
        if (step + 1) % every == 0 or step + 1 == total:
            eval_at(step + 1)
    close_window(writer, session, spec, described, max(window_s, 1e-9))
