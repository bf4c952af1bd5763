"""``python -m xfw_jax --explain FILE --spec spec.json``: where a JAX step goes, by step part.

``xfw.contract.explain`` drives the steps and attributes the hooks' clock readings, as for the two other
adapters; what differs is what JAX can hook. Inside ``jax.jit`` there are no module calls to hook: the
forward and backward over every micro-batch are one XLA program, the optimizer update another
(``xfw_jax.session``). So the rows are the step's parts, not modules:

* ``forward + backward (one XLA program)``: the gradient program, from its dispatch until its arrays are
  ready (its forward and backward are fused by XLA and cannot be timed apart: its ``fwd_s`` holds both);
* ``optimizer``: the update program (clipping, AdamW), as the core times it on every adapter.

The categories come from JAX's own profiler (``jax.profiler.trace`` with its Perfetto trace): every XLA
operation the CPU runtime executed (``hlo_op``), named as XLA names it (fusions mostly: ``category_of``
puts a fusion under ``other``), written as ``trace.json`` beside ``FILE``.
"""

from __future__ import annotations

import glob
import gzip
import json
import tempfile

from xfw.contract.atomic import write_json_atomic
from xfw.contract.explain import Timeline, refuse_many, run_explain, trace_categories

PROGRAM_ROW = "forward + backward (one XLA program)"
XLA_OP = "xla_op"


class JaxHooks:
    def __init__(self, session):
        self.session = session

    def install(self, timeline: Timeline):
        session, plain = self.session, self.session.forward_backward

        def timed(micro_batches):
            call = timeline.enter(PROGRAM_ROW, root=True)
            loss = plain(micro_batches)
            timeline.exit(call, root=True)  # the clock waits for the program's arrays (session.synchronize)
            return loss

        session.forward_backward = timed
        return lambda: setattr(session, "forward_backward", plain)

    def profile(self, run, steps: int, trace_path: str) -> dict[str, float]:
        import jax

        with tempfile.TemporaryDirectory() as directory:
            with jax.profiler.trace(directory, create_perfetto_trace=True):
                for _ in range(steps):
                    run()
            found = glob.glob(f"{directory}/**/perfetto_trace.json.gz", recursive=True)
            if not found:
                raise RuntimeError("jax.profiler.trace wrote no Perfetto trace")
            with gzip.open(found[0], "rt", encoding="utf-8") as f:
                data = json.load(f)
        events = data["traceEvents"] if isinstance(data, dict) else data
        for e in events:  # XLA's executed operations: the CPU runtime's thunks carry their HLO op
            args = e.get("args") or {}
            if e.get("ph") == "X" and "hlo_op" in args:
                e["cat"], e["name"] = XLA_OP, str(args["hlo_op"])
        write_json_atomic(trace_path, {"traceEvents": events}, compact=True)  # as trace_categories writes it back
        return trace_categories(trace_path, op_cats=(XLA_OP,), optimizer_marks=(), kernel_cats=(XLA_OP,))


def explain(spec: dict, path: str) -> None:
    from xfw_jax.session import JaxSession

    refuse_many(spec)
    session = JaxSession(spec)
    run_explain(spec, session, JaxHooks(session), path)
