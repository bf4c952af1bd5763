"""The training-and-timing loop every adapter runs: one method, applied to both sides.

An adapter builds its model and optimizer and hands the core a :class:`Session` (how to move
a batch to the device, take one optimizer step, place a timestamp, read memory). The loop
below does the rest the same way for every framework: warm-up steps (recorded, excluded),
a measured window bracketed by device synchronisation, per-step times from device
timestamps, and losses read without adding host syncs inside the window::

    python -m xfw_torch --spec run/spec.json --records run/steps.jsonl
    # -> adapters call xfw.contract.harness.main(build_session), which ends in run_training(...)

With the ``grad_norm`` backend knob (parity only) each step record also carries the gradient
norm, read every step: a host sync inside the window, so such a run is not a measurement.

Exit codes, read by the launcher: 0 ok, 2 invalid spec, 3 unsupported, 4 out of memory;
anything else is a crash. The same status is written as an ``error`` record first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable

from xfw.contract import lifeline
from xfw.contract import records as rec
from xfw.contract import rss
from xfw.contract.stepping import (  # noqa: F401 - Unsupported, InvalidSpec: adapters import them here
    BREAKDOWN, InvalidSpec, Session, Steps, Unsupported, close_window, step_parts, train_one_step)

EXIT_OK, EXIT_INVALID, EXIT_UNSUPPORTED, EXIT_OOM = 0, 2, 3, 4
DRAIN_INTERVAL_S = 1.0
GRAD_NORM_KNOB = "grad_norm"
"""A backend knob every adapter accepts (``backends.<name>.grad_norm: true``): record each step's
global gradient norm (``grad_norm_l2``). Parity turns it on; reading the norm is a host sync
every step, so a measured run for throughput must never set it."""


def wants_grad_norm(spec: dict, *, across_ranks: bool = False) -> bool:
    """Whether this run records gradient norms; one process only (a sharded or not-yet-reduced
    gradient would give a local norm), unless the adapter sums the norm over the ranks itself
    (``across_ranks``: the Paddle adapter reads it where its optimizer applies the gradients)."""
    wanted = spec["backend_knobs"].get(GRAD_NORM_KNOB, False)
    if not isinstance(wanted, bool):
        raise InvalidSpec(f"backends.{spec.get('backend', '<backend>')}.{GRAD_NORM_KNOB}: must be true or false, "
                          f"got {wanted!r}")
    if wanted and spec["derived"]["num_processes"] != 1 and not across_ranks:
        raise InvalidSpec(f"backends.{spec.get('backend', '<backend>')}.{GRAD_NORM_KNOB}: only with one process "
                          f"(parity runs), not {spec['derived']['num_processes']}")
    return wanted


LOADER_KNOBS = ("loader_workers", "loader_prefetch")
"""Backend knobs every adapter accepts for prepared data: its DataLoader's worker processes
(default 0: batches are read in the training process, as PaddleMIX's scripts do) and batches
each worker prefetches (default 2)."""


def loader_settings(spec: dict) -> tuple[int, int]:
    """(workers, prefetch per worker) from the backend knobs, checked (InvalidSpec)."""
    knobs, out = spec["backend_knobs"], []
    for knob, default, low in zip(LOADER_KNOBS, (0, 2), (0, 1)):
        value = knobs.get(knob, default)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 256:
            raise InvalidSpec(f"backends.{spec.get('backend', '<backend>')}.{knob}: must be an integer in "
                              f"[{low}, 256], got {value!r}")
        out.append(value)
    return out[0], out[1]


def run_training(spec: dict, writer: rec.RecordWriter, session: Session) -> None:
    # The model is built: the process's resident memory counts from here, the same way for every
    # backend (xfw.contract.rss), beside the framework's own figure (memory_peaks).
    rss_after_build, rss_since_build = rss.reset_peak()
    warmup, steps = spec["measure"]["warmup_steps"], spec["measure"]["steps"]
    samples = spec["batch"]["micro"] * spec["derived"]["grad_accum_steps"]
    data = Steps(spec, session)
    with_grad_norm = wants_grad_norm(spec, across_ranks=getattr(session, "GRAD_NORM_ACROSS_RANKS", False))
    grad_norms: list[float] = []  # index: step; filled only when asked (parity)
    described: list[list[tuple[int, int, int, str]]] = []  # index: step; each micro-batch's description
    writer.start(num_ranks=session.num_ranks, warmup_steps=warmup, steps=steps,
                 rss_after_build_bytes=rss_after_build, rss_peak_since_build=rss_since_build)

    def write_step(step: int, phase: str, time_s: float, loss: float | None, parts: dict) -> None:
        alloc, reserved = session.memory_peaks()
        extra = {"grad_norm_l2": grad_norms[step], **parts} if with_grad_norm else parts
        tokens, padded, longest, hashes = zip(*described[step])
        writer.write("step", step=step, phase=phase, step_time_s=time_s, samples=samples, tokens=sum(tokens),
                     loss=loss, mem_alloc_peak_bytes=alloc, mem_reserved_peak_bytes=reserved,
                     padded_tokens=sum(padded), max_seq_len=max(longest), batch_hashes=list(hashes),
                     rss_peak_bytes=rss.peak_bytes(), **extra)

    if spec["measure"].get("eval_every"):  # a learning curve (xfw converge): xfw.contract.curves
        from xfw.contract import curves

        return curves.train_with_evals(spec, writer, session, data, write_step,
                                       grad_norms if with_grad_norm else None, described)

    # Warm-up: synchronised every step (it is excluded, so the syncs cost nothing we report).
    for step in range(warmup):
        t0, start = time.perf_counter(), session.timestamp()
        loss, marks = train_one_step(session, data, step, described)
        end = session.timestamp()
        session.synchronize()  # SYNC: warm-up only
        if with_grad_norm:
            grad_norms.append(session.grad_norm())
        write_step(step, "warmup", time.perf_counter() - t0, session.loss_value(session.loss_token(loss)),
                   step_parts(session, start, marks, end))

    # Measured window. Sync once before and once after; inside, only timestamps and
    # asynchronous loss copies, drained as the device passes them (for live progress).
    # Records are written at most once per DRAIN_INTERVAL_S inside the window, so the cost of
    # writing them (json, flush, allocator stats) stays out of short steps' times. Prepared data
    # is read inside the window (each step's time includes fetching its micro-batches).
    session.synchronize()  # SYNC: window start
    t_start = t_drain = time.perf_counter()
    stamps, tokens_pending, marks, written = [session.timestamp()], [], [], 0
    for i in range(steps):
        loss, step_marks = train_one_step(session, data, warmup + i, described)
        marks.append(step_marks)
        tokens_pending.append(session.loss_token(loss))
        stamps.append(session.timestamp())
        if with_grad_norm:  # SYNC: parity only (wants_grad_norm); its step times are not a measurement
            grad_norms.append(session.grad_norm())
        if time.perf_counter() - t_drain < DRAIN_INTERVAL_S:
            continue
        t_drain = time.perf_counter()
        while written <= i and session.is_done(stamps[written + 1]):
            write_step(warmup + written, "measure", session.elapsed_s(stamps[written], stamps[written + 1]),
                       session.loss_value(tokens_pending[written]),
                       step_parts(session, stamps[written], marks[written], stamps[written + 1]))
            written += 1
    session.synchronize()  # SYNC: window end
    window_s = time.perf_counter() - t_start
    for j in range(written, steps):
        write_step(warmup + j, "measure", session.elapsed_s(stamps[j], stamps[j + 1]),
                   session.loss_value(tokens_pending[j]), step_parts(session, stamps[j], marks[j], stamps[j + 1]))
    close_window(writer, session, spec, described, window_s)


def _export(export_weights: Callable[[dict, str], None] | None, spec: dict, directory: str) -> int:
    """``--export-weights DIR``: the adapter writes the model this spec starts from (seeded init,
    or ``model.weights``) to ``DIR/model.safetensors`` under the canonical names (xfw.contract.weights).
    ``--probe-modules FILE`` has the same shape (any tool the adapter offers beside training)."""
    if export_weights is None:
        print("this backend does not offer this", file=sys.stderr)
        return EXIT_UNSUPPORTED
    try:
        export_weights(spec, directory)
    except Unsupported as err:
        print(f"unsupported: {err}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    except InvalidSpec as err:
        print(f"invalid: {err}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def _export_all(export_weights: Callable[[dict, str], None] | None, pairs: list[tuple[str, str]]) -> int:
    """``--export-weights DIR --spec spec.json``, given once or several times: each spec's start written to
    its DIR in this one process (the framework imported once: converge exports every seed's start
    together). A failed export does not stop the next; each failure is named on stderr with its DIR.
    Exit code: 0, or the first failure's."""
    status = EXIT_OK
    for spec_path, directory in pairs:
        try:
            with open(spec_path, encoding="utf-8") as f:
                code = _export(export_weights, json.load(f), directory)
        except Exception:  # noqa: BLE001 - one start that crashes: its trace printed, the next one exported
            if len(pairs) == 1:
                raise
            traceback.print_exc(file=sys.stderr)
            code = 1
        if code != EXIT_OK and len(pairs) > 1:
            print(f"{directory}: not exported (exit {code})", file=sys.stderr)
        status = status or code
    return status


def _count(count_params: Callable[[dict], dict] | None, spec_paths: list[str], path: str) -> int:
    """``--count-params FILE`` (and ``--count-flops FILE``): every spec's model counted in this one
    process (the framework is imported once), the results written to FILE together; a spec that
    fails is recorded as failed and the others are still counted. Exit code: 0, or the first failure's."""
    from xfw.contract.atomic import write_json_atomic

    if count_params is None:
        print("this backend does not offer this", file=sys.stderr)
        return EXIT_UNSUPPORTED
    results, status = [], EXIT_OK
    for spec_path in spec_paths:
        with open(spec_path, encoding="utf-8") as f:
            spec = json.load(f)
        try:
            results.append({"spec": spec_path, **count_params(spec)})
            continue
        except Unsupported as err:
            code, failure = EXIT_UNSUPPORTED, {"status": "unsupported", "message": str(err)}
        except InvalidSpec as err:
            code, failure = EXIT_INVALID, {"status": "invalid", "message": str(err)}
        except Exception as err:  # noqa: BLE001 - record it, print the trace, count the other specs
            traceback.print_exc(file=sys.stderr)
            code, failure = 1, {"status": "crashed", "message": f"{type(err).__name__}: {err}"[:500]}
        print(f"{spec_path}: {failure['status']}: {failure['message']}", file=sys.stderr)
        results.append({"spec": spec_path, **failure})
        status = status or code
    write_json_atomic(path, {"counts": results})
    return status


def main(build_session: Callable[[dict], Session], describe: Callable[[], dict],
         argv: list[str] | None = None, *, export_weights: Callable[[dict, str], None] | None = None,
         probe_modules: Callable[[dict, str], None] | None = None,
         count_params: Callable[[dict], dict] | None = None,
         count_flops: Callable[[dict], dict] | None = None,
         explain: Callable[[dict, str], None] | None = None) -> int:
    """Entry point for ``python -m xfw_<backend>``: spec in, records out, status as exit code.

    ``--describe`` prints one JSON object (framework, versions, device, multi-process launcher)
    and exits; the core uses it for ``xfw env`` and to check an interpreter before launching.
    ``--export-weights DIR --spec spec.json`` calls the adapter's optional ``export_weights`` (the pair
    given several times: each in turn, :func:`_export_all`);
    ``--probe-modules FILE --spec spec.json`` its optional ``probe_modules``: one forward pass on
    the first synthetic batch, every parameter-owning module's output in call order, written to
    FILE and FILE's ``.safetensors`` sibling by ``xfw.contract.module_outputs.write_probe``.

    ``--count-params FILE --spec a.json [--spec b.json ...]`` calls the adapter's optional
    ``count_params(spec) -> dict`` once per spec: the model a run would start from (stage
    freezing and LoRA adapters applied), built without allocating its weights, counted by part
    (``xfw.contract.families.tally``). FILE, written atomically, holds one entry per spec in order::

        {"counts": [{"spec": "a.json", "total": N, "trainable": M, "parts": {part: n, ...},
                     "trainable_parts": {part: m, ...}},
                    {"spec": "b.json", "status": "unsupported", "message": "..."}]}

    ``--count-flops FILE --spec a.json ...`` likewise calls the optional ``count_flops(spec) -> dict``:
    one training step's forward and backward on the spec's first micro-batch, its FLOPs counted
    per ledger term (``xfw.contract.families.flops``) without allocating weights; the same file
    shape, each entry ``{"spec", "samples", "total", "terms": {term: n}, "recompute": {term: n}}``.
    """
    parser = argparse.ArgumentParser(description="Run one xfw spec and append records.")
    parser.add_argument("--describe", action="store_true", help="print this backend's description as JSON")
    parser.add_argument("--spec", action="append", help="resolved spec.json written by the core "
                                                        "(several only with --count-params/--count-flops)")
    parser.add_argument("--records", help="steps.jsonl to append records to")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (default: from the launcher)")
    parser.add_argument("--export-weights", metavar="DIR", action="append",
                        help="write the spec's initial model to DIR/model.safetensors and exit (no training); "
                             "given N times with N --spec, each spec's to its DIR in order, in this one process")
    parser.add_argument("--probe-modules", metavar="FILE",
                        help="write per-module output norms of one forward pass to FILE (JSON) and exit")
    parser.add_argument("--explain", metavar="FILE",
                        help="after the spec's warm-up, profile a few steps: per-module and per-category "
                             "times to FILE (JSON), the profiler's trace beside it (xfw.contract.explain)")
    parser.add_argument("--count-params", metavar="FILE",
                        help="write each --spec's parameter counts, built without weights, to FILE (JSON) and exit")
    parser.add_argument("--count-flops", metavar="FILE",
                        help="write each --spec's counted FLOPs of one training step, built without weights, "
                             "to FILE (JSON) and exit")
    args = parser.parse_args(argv)
    lifeline.watch_parent()  # every process of a run (each rank) ends if the xfw that started it dies
    if args.describe:
        print(json.dumps(describe()))
        return EXIT_OK
    for flag, target, hook in (("--count-params", args.count_params, count_params),
                               ("--count-flops", args.count_flops, count_flops)):
        if target:
            if not args.spec:
                parser.error(f"{flag} needs --spec")
            return _count(hook, args.spec, target)
    if args.export_weights:
        if len(args.spec or []) != len(args.export_weights):
            parser.error("--export-weights needs one --spec each")
        return _export_all(export_weights, list(zip(args.spec, args.export_weights)))
    if args.spec and len(args.spec) > 1:
        parser.error("one --spec only (several are for --count-params, --count-flops and --export-weights)")
    for flag, target, hook in (("--probe-modules", args.probe_modules, probe_modules),
                               ("--explain", args.explain, explain)):
        if target:
            if not args.spec:
                parser.error(f"{flag} needs --spec")
            with open(args.spec[0], encoding="utf-8") as f:
                return _export(hook, json.load(f), target)
    if not args.spec or not args.records:
        parser.error("--spec and --records are required")
    with open(args.spec[0], encoding="utf-8") as f:
        spec = json.load(f)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    writer = rec.RecordWriter(args.records, rank)
    session = None
    try:
        session = build_session(spec)
        writer.rank = session.rank  # the adapter knows its launcher's rank variables; the core does not
        run_training(spec, writer, session)
        writer.write("end")
        return EXIT_OK
    except Unsupported as err:
        writer.write("error", status="unsupported", message=str(err))
        return EXIT_UNSUPPORTED
    except InvalidSpec as err:
        writer.write("error", status="invalid", message=str(err))
        return EXIT_INVALID
    except Exception as err:  # noqa: BLE001 - classify, record, and re-raise the trace to stderr
        oom = session is not None and session.is_oom(err) or "out of memory" in str(err).lower()
        writer.write("error", status="oom" if oom else "crashed", message=f"{type(err).__name__}: {err}"[:500])
        traceback.print_exc(file=sys.stderr)
        return EXIT_OOM if oom else 1
    finally:
        writer.close()
