"""``python -m xfw_torch --explain FILE --spec spec.json``: PyTorch's hooks and profiler for
``xfw.contract.explain`` (which drives the steps and does the attribution, the same for Paddle).

* modules: ``register_forward_pre_hook`` / ``register_forward_hook`` on every module of the model
  that owns parameters or holds some (its row under the canonical name, ``scope_names``); a tensor
  hook on each output that needs a gradient marks the call's backward start, one on each input
  that needs a gradient and on the module's own trainable parameters its end;
* the loss: a transformers model's own ``loss_function`` call (inside its forward) is timed as the
  ``loss`` row, as Paddle computes it in its loss layer (:func:`_time_inner_loss`);
* recompute: checkpointing's early stop is off while the hooks time (every recomputed module is
  entered and left; the rest of a block that early stop would skip is recomputed too);
* categories and the trace: ``torch.profiler`` (CPU operators with their input shapes; CUDA kernels
  on a GPU), ``export_chrome_trace``, each operator's category written into the trace.
"""

from __future__ import annotations

import torch

from xfw.contract import hf_names
from xfw.contract.explain import LOSS, Timeline, refuse_many, run_explain, scope_names, trace_categories
from xfw_torch import parallel


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _needs_grad(value) -> list:
    return [t for t in _tensors(value) if t.requires_grad and torch.is_grad_enabled()]


def _time_inner_loss(model, timeline: Timeline):
    """A transformers model that computes its loss inside its own forward (``self.loss_function(logits,
    labels, ...)``: the causal-LM shift, the fp32 cast and the cross-entropy) gets that call timed as the
    ``loss`` row, as Paddle's loss layer computes the same outside its model: the same function runs on the
    same tensors (the instance's ``loss_function``, transformers' own setter, wraps it with the clock reads
    and gradient hooks every module gets), only while the hooks time. Returns the undo."""
    import inspect

    from transformers import PreTrainedModel

    owner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if owner is None or "labels" not in inspect.signature(owner.forward).parameters:
        return lambda: None  # no transformers model computing a loss (a diffusion family's text encoder)
    had, before = "_loss_function" in vars(owner), vars(owner).get("_loss_function")
    original = owner.loss_function

    def timed(*args, **kwargs):
        call = timeline.enter(LOSS)
        for t in _needs_grad((args, kwargs)):  # the logits' gradient: the loss's backward is done
            t.register_hook(lambda _g, c=call: timeline.grad_out(c))
        try:
            out = original(*args, **kwargs)
        finally:
            timeline.exit(call)
        for t in _needs_grad(out):
            t.register_hook(lambda _g, c=call: timeline.grad_in(c))
        return out

    owner.loss_function = timed

    def restore() -> None:
        if had:
            owner._loss_function = before
        else:
            del owner._loss_function
    return restore


class TorchHooks:
    def __init__(self, session):
        self.session = session

    def install(self, timeline: Timeline):
        model = self.session.model
        owns = {name: (hf_names.peft_to_canonical(f"{name}.").removesuffix(".")
                       if next(m.parameters(recurse=False), None) is not None else None)
                for name, m in model.named_modules()}
        names = scope_names(owns)
        handles, last_call, hooked = [], {}, set()

        def add(module, path, name, root):
            def pre(_module, args, kwargs):
                call = timeline.enter(name, root=root)
                last_call[path] = call
                for t in _needs_grad((args, kwargs)):
                    t.register_hook(lambda _g, c=call: timeline.grad_out(c))

            def post(_module, _args, _kwargs, output):
                call = last_call[path]
                for t in [] if root else _needs_grad(output):  # the loss's own gradient starts backward
                    t.register_hook(lambda _g, c=call: timeline.grad_in(c))
                timeline.exit(call, root=root)

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
            for p in module.parameters(recurse=False):
                # A tied weight (the LM head's, the embedding's) is done only after its last use's backward, the
                # embedding lookup's at the end of backward: it closes the module that has it first (the
                # embedding, as Paddle's one layer), the head's interval its input's gradient.
                if p.requires_grad and id(p) not in hooked:
                    hooked.add(id(p))
                    handles.append(p.register_hook(lambda _g: timeline.grad_out(last_call[path])))

        for path, module in model.named_modules():
            if path in names:
                add(module, path, names[path], root=False)
        wrapper = next(m for m in self.session.module.modules() if isinstance(m, parallel.LossModule))
        add(wrapper, "(loss module)", LOSS, root=True)
        restore_loss = _time_inner_loss(model, timeline)
        # Checkpointing stops a recomputation once it has what backward needs, skipping the rest of the
        # block and its exit hooks; here it runs whole, so each recomputed module's time is closed.
        whole = torch.utils.checkpoint.set_checkpoint_early_stop(False)
        whole.__enter__()

        def remove() -> None:
            restore_loss()
            whole.__exit__(None, None, None)
            for h in handles:
                h.remove()
        return remove

    def profile(self, run, steps: int, trace_path: str) -> dict[str, float]:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.session.cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:  # shapes: attention's products
            for _ in range(steps):
                run()
        prof.export_chrome_trace(trace_path)
        return trace_categories(trace_path, op_cats=("cpu_op",), optimizer_marks=("Optimizer.step",),
                                kernel_cats=("kernel",))


def explain(spec: dict, path: str) -> None:
    from xfw_torch.session import TorchSession

    refuse_many(spec)  # before the session: a multi-process spec would fail building it, for another reason
    session = TorchSession(spec)
    run_explain(spec, session, TorchHooks(session), path)
