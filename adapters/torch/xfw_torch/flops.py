"""FLOPs counted, not computed: one real training step of a spec's model, built on the meta device,
under ``torch.utils.flop_counter.FlopCounterMode``, each product attributed to a ledger term::

    python -m xfw_torch --count-flops FILE --spec a.json [--spec b.json ...]

The counterpart of the families' analytic ledgers (``xfw.contract.families.flops``);
tests/contract/test_flop_counter.py holds every seed recipe's ledger to this count. Three pieces:

* :class:`HostData`: the weights live on the meta device (a 13B model costs shapes, not memory);
  the batch stays on the host, so the few steps whose control flow reads the data (where the
  image tokens sit, AnyRes tile counts, Qwen2-VL's grid) see real values. An operation meeting a
  meta tensor runs on meta (a host boolean mask used as an index becomes its positions first);
  moving a host integer tensor to meta keeps it on the host, and moving a meta tensor to the host
  keeps it on meta (it has no values).
* :class:`Attribution`: which module each product belongs to. Forward: the innermost module being
  called. Backward: the module whose forward created the autograd node now running (marked as
  nodes are created). A module called while backward runs is recomputation (checkpointing).
* :class:`TermCounter`: FlopCounterMode's own formulas and total, plus FLOPs per (term, phase),
  terms from ``xfw.contract.families.flop_term`` (parts, ``lora``, ``other``).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from xfw.contract import families
from xfw.contract.synthetic import make_pool

_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._index_put_impl_.default}


def _is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta


class HostData(TorchDispatchMode):
    """Meta weights, host data (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            source, device = args[0], kwargs.get("device")
            if device is not None and torch.device(device).type == "meta" and not source.is_meta \
                    and not source.is_floating_point():
                return source.to(kwargs.get("dtype") or source.dtype, copy=True)  # keep the values
            if device is not None and torch.device(device).type != "meta" and source.is_meta:
                kwargs = {**kwargs, "device": torch.device("meta")}  # nothing to copy
        if any(_is_meta(t) for t in tree_flatten((args, kwargs))[0]):
            if func in _INDEXING:
                args = (args[0], [j for i in args[1] for j in self._positions(i)], *args[2:])
            args, kwargs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t,
                                    (args, kwargs))
        return func(*args, **kwargs)

    @staticmethod
    def _positions(index):
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool and not index.is_meta:
            return list(index.nonzero().unbind(1))
        return [index]


class Attribution:
    """The module each product belongs to, forward and backward (module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.names = {id(m): name for name, m in model.named_modules()}
        self.calls: list[tuple[str, bool]] = []  # (module, called during backward?)
        self.nodes: dict = {}  # autograd node -> the module whose forward created it

    def current(self) -> tuple[str, bool]:
        return self.calls[-1] if self.calls else ("", False)

    def enter(self, module, _args) -> None:
        self.calls.append((self.names.get(id(module), "?"), torch._C._current_autograd_node() is not None))

    def leave(self, _module, _args, _output) -> None:
        self.calls.pop()

    def mark(self, node, module: str) -> None:
        """Every node not yet marked from ``node`` back (an op may create several)."""
        todo = [node]
        while todo:
            n = todo.pop()
            if n is not None and n not in self.nodes:
                self.nodes[n] = module
                todo.extend(f for f, _ in n.next_functions)

    @contextlib.contextmanager
    def hooks(self):
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self.enter)
        post = torch.nn.modules.module.register_module_forward_hook(self.leave, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


class _Marker(TorchFunctionMode):
    """Marks each new autograd node with the module being called."""

    def __init__(self, attribution: Attribution):
        super().__init__()
        self.attribution = attribution

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self.attribution.mark(t.grad_fn, self.attribution.current()[0])
        return out


class TermCounter(FlopCounterMode):
    """FlopCounterMode, and its FLOPs again per (term, phase): forward, backward, recompute."""

    def __init__(self, attribution: Attribution, term_of):
        super().__init__(display=False)
        self.attribution, self.term_of = attribution, term_of
        self.by_term: dict[tuple[str, str], int] = {}

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet in self.flop_registry:
            flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            module, in_backward = self.attribution.current()
            node = torch._C._current_autograd_node()
            if in_backward:
                key = (self.term_of(module), "recompute")
            elif node is not None:
                marked = self.attribution.nodes.get(node)
                key = (self.term_of(marked) if marked is not None else "unattributed", "backward")
            else:
                key = (self.term_of(module), "forward")
            self.by_term[key] = self.by_term.get(key, 0) + flops
        return super()._count_flops(func_packet, out, args, kwargs)


@contextlib.contextmanager
def _meta_autocast_off():
    """transformers asks ``torch.is_autocast_enabled(x.device.type)`` (its rotary embeddings), which
    has no answer for "meta": it is off there."""
    real = torch.is_autocast_enabled

    def is_autocast_enabled(*args):
        return False if args and args[0] == "meta" else real(*args)

    torch.is_autocast_enabled = is_autocast_enabled
    try:
        yield
    finally:
        torch.is_autocast_enabled = real


def count_step(spec: dict, model: torch.nn.Module, loss_fn) -> dict:
    """One forward and backward of ``model`` (built on meta, training mode) on the spec's first
    micro-batch: ``{"samples", "seq_len", "total", "terms": {term: model FLOPs}, "recompute": {term:
    FLOPs}}``, ``total`` being FlopCounterMode's own (model + recompute), everything for the whole
    micro-batch; ``seq_len`` the positions each of its samples runs (the longest sample's, padding
    included; None for a family without a token sequence), the length to hold the ledger at."""
    arch = spec["model"]["arch"]
    batch = {k: torch.from_numpy(v) for k, v in make_pool(spec, 0)[0].items()}
    attribution = Attribution(model)
    counter = TermCounter(attribution, lambda module: families.flop_term(arch, module))
    with _meta_autocast_off(), attribution.hooks(), counter, HostData(), _Marker(attribution):
        loss_fn(model, batch).backward()
    terms: dict[str, int] = {}
    recompute: dict[str, int] = {}
    for (term, phase), flops in counter.by_term.items():
        target = recompute if phase == "recompute" else terms
        target[term] = target.get(term, 0) + flops
    seq_len = int(batch["input_ids"].shape[-1]) if "input_ids" in batch else None
    return {"samples": spec["batch"]["micro"], "seq_len": seq_len, "total": counter.get_total_flops(), "terms": terms,
            "recompute": recompute}
