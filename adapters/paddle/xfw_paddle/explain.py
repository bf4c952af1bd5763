"""``python -m xfw_paddle --explain FILE --spec spec.json``: Paddle's hooks and profiler for
``xfw.contract.explain`` (which drives the steps and does the attribution, the same for PyTorch).

* layers: ``register_forward_pre_hook`` / ``register_forward_post_hook`` on every layer of the
  model that owns parameters (named as the parity probe names it: the canonical name of its first
  own parameter's module) or holds some (``scope_names``); ``Tensor.register_hook`` on each output
  that needs a gradient marks the call's backward start, on each input that needs one and on the
  layer's own trainable parameters its end;
* a tied LM head (the embedding layer called on hidden states) is timed as ``lm_head``, as on PyTorch;
* categories and the trace: ``paddle.profiler`` (host operators with their input shapes; GPU kernels
  on a GPU), exported as a Chrome trace, each operator's category written into it. Paddle computes
  ``F.mse_loss`` (the diffusion families' loss) as subtract, square and mean, where PyTorch has one
  ``aten::mse_loss``: while the profiler records, the call is marked (:func:`marked_mse_loss`: a user
  event around its forward, instant markers where its backward begins and ends), so that both sides'
  loss is the loss category. The markers add no operator; the call computes what it computed.
"""

from __future__ import annotations

import paddle

from xfw.contract.explain import LOSS, Timeline, refuse_many, run_explain, scope_names, trace_categories
from xfw.contract.explain_categories import LOSS_BACKWARD_BEGINS, LOSS_BACKWARD_ENDS, LOSS_MARK
from xfw_paddle import parallel
from xfw_paddle.families import family_module
from xfw_paddle.model import canonical_names


def _tensors(value) -> list:
    if isinstance(value, paddle.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _needs_grad(value) -> list:
    return [t for t in _tensors(value) if not t.stop_gradient and paddle.is_grad_enabled()]


TIED_HEAD = "lm_head"
"""A tied LM head: the embedding layer called on hidden states (``embed(hidden, logits=True)``, PaddleNLP's way)
is timed under the head's canonical name, as transformers' ``lm_head`` (the tied weight's other module) is."""


def _floating(inputs) -> bool:
    first = _tensors(inputs)[:1]
    return bool(first) and first[0].is_floating_point()


class PaddleHooks:
    def __init__(self, session, spec: dict):
        self.session, self.spec = session, spec

    def install(self, timeline: Timeline):
        model = self.session.model
        canon = canonical_names(family_module(self.spec["model"]["family"]), model)
        owns: dict[str, str | None] = {}
        for path, layer in [("", model), *model.named_sublayers()]:
            own = next(iter(layer.named_parameters(include_sublayers=False)), None)
            key = own and (f"{path}.{own[0]}" if path else own[0])
            owns[path] = canon[key][0].removesuffix(f".{own[0]}") if key in canon else None
        names = scope_names(owns)
        handles, last_call, lookup_call = [], {}, {}

        def add(layer, path, name, root):
            head = isinstance(layer, paddle.nn.Embedding)

            def pre(_layer, inputs):
                as_head = head and _floating(inputs)
                call = timeline.enter(TIED_HEAD if as_head else name, root=root)
                last_call[path] = call
                if not as_head:
                    lookup_call[path] = call
                for t in _needs_grad(inputs):
                    t.register_hook(lambda _g, c=call: timeline.grad_out(c))

            def post(_layer, _inputs, output):
                call = last_call[path]
                for t in [] if root else _needs_grad(output):  # the loss's own gradient starts backward
                    t.register_hook(lambda _g, c=call: timeline.grad_in(c))
                timeline.exit(call, root=root)

            handles.append(layer.register_forward_pre_hook(pre))
            handles.append(layer.register_forward_post_hook(post))
            for p in layer.parameters(include_sublayers=False):
                if not p.stop_gradient:  # a tied weight closes the lookup's call; the head's, its input's gradient
                    handles.append(p.register_hook(lambda _g: timeline.grad_out(lookup_call.get(path, last_call[path]))))

        for path, layer in [("", model), *model.named_sublayers()]:
            if path in names:
                add(layer, path, names[path], root=False)
        layers = [v for v in vars(self.session).values() if isinstance(v, paddle.nn.Layer)]
        wrapper = next(x for v in layers for x in [v, *v.sublayers()] if isinstance(x, parallel.LossLayer))
        add(wrapper, "(loss layer)", LOSS, root=True)
        return lambda: [h.remove() for h in handles]

    def profile(self, run, steps: int, trace_path: str) -> dict[str, float]:
        from paddle import profiler

        targets = [profiler.ProfilerTarget.CPU] + ([profiler.ProfilerTarget.GPU] if self.session.gpu else [])
        prof = profiler.Profiler(targets=targets, on_trace_ready=lambda _prof: None,
                                 record_shapes=True)  # shapes: attention's products
        functional, unmarked = paddle.nn.functional, paddle.nn.functional.mse_loss
        functional.mse_loss = marked_mse_loss(unmarked)
        try:
            prof.start()
            for _ in range(steps):
                run()
                prof.step()
            prof.stop()
        finally:
            functional.mse_loss = unmarked
        prof.export(trace_path, format="json")
        return trace_categories(trace_path, op_cats=("Operator", "OperatorInner", "DygraphKernelLaunch", "UserDefined"),
                                optimizer_marks=("Optimization Step",), kernel_cats=("Kernel",),
                                layer_cats=("Forward",))  # no shapes in Paddle's trace: attention by its layer


def _mark(name: str) -> None:
    from paddle import profiler

    with profiler.RecordEvent(name):
        pass


def marked_mse_loss(mse_loss):
    """``mse_loss`` with the profiler's loss markers (``xfw.contract.explain_categories.LOSS_MARK``): a user
    event around the call, an instant marker from a hook on its output's gradient (its backward begins) and
    one from a hook on its inputs' (done: the next operator's gradient is being taken). Paddle's profiler
    needs its events nested, so the backward is two instants, not one event across the gradient nodes."""
    from paddle import profiler

    def marked(input, label, *args, **kwargs):  # noqa: A002 - paddle's own argument name
        with profiler.RecordEvent(LOSS_MARK):
            out = mse_loss(input, label, *args, **kwargs)
        inputs = [t for t in (input, label) if isinstance(t, paddle.Tensor) and not t.stop_gradient]
        if isinstance(out, paddle.Tensor) and not out.stop_gradient and inputs:
            out.register_hook(lambda _g: _mark(LOSS_BACKWARD_BEGINS))
            done = []

            def ended(_g):
                if not done:
                    done.append(True)
                    _mark(LOSS_BACKWARD_ENDS)

            for t in inputs:
                t.register_hook(ended)
        return out

    return marked


def explain(spec: dict, path: str) -> None:
    from xfw_paddle.session import PaddleSession

    refuse_many(spec)  # before the session: a multi-process spec would fail building it, for another reason
    session = PaddleSession(spec)
    run_explain(spec, session, PaddleHooks(session, spec), path)
