"""The Paddle adapter's side tasks: what ``python -m xfw_paddle`` does besides training, each on
the model a run of the spec starts from (:func:`xfw_paddle.model.start_model`)::

    python -m xfw_paddle --export-weights DIR --spec spec.json          # initial weights, canonical names
    python -m xfw_paddle --probe-modules FILE --spec spec.json          # per-module outputs (xfw.contract.module_outputs)
    python -m xfw_paddle --count-params FILE --spec a.json --spec b.json   # sizes, built lazily

The file formats are ``xfw.contract.harness``'s.
"""

from __future__ import annotations

import contextlib

import numpy as np
import paddle

from xfw.contract import families
from xfw.contract import weights as neutral
from xfw_paddle.families import family_module
from xfw_paddle import nlp
from xfw_paddle.model import canonical_names, start_model
from xfw_paddle.session import check_spec, device_batch


def _use_sdpa(spec: dict) -> bool:
    return spec["backend_knobs"].get("attn_implementation", "sdpa") == "sdpa"


def count_params(spec: dict) -> dict:
    """``--count-params``: the spec's starting model built under ``paddle.LazyGuard`` (parameters
    get shapes, no storage: a 13B model costs no memory) with paddlenlp's ``no_init_weights``
    (its models otherwise initialise, and so allocate, every weight in ``__init__``; paddlenlp's own
    ``from_pretrained(low_cpu_mem_usage=True)`` builds the same way), stage freezing and LoRA
    adapters applied as a run applies them; its parameters tallied by part
    (``xfw.contract.families.tally``)."""
    no_init_weights = nlp.load("paddlenlp.transformers.model_utils").no_init_weights

    check_spec(spec)
    paddle.set_device("cpu")
    with no_init_weights(_enable=True), paddle.LazyGuard():
        model = start_model(spec, use_sdpa=_use_sdpa(spec), weights=False)
    names = canonical_names(family_module(spec["model"]["family"]), model)
    return families.tally(spec["model"]["arch"], ((names[ours][0], int(p.size), not p.stop_gradient)
                                                  for ours, p in model.named_parameters()))


def export_weights(spec: dict, directory: str) -> None:
    """``python -m xfw_paddle --export-weights DIR --spec spec.json``: the model a run of this
    spec starts from, LoRA adapters included, written to ``DIR/model.safetensors`` under the
    canonical names and torch layouts (Linear weights and adapters transposed back to [out, in])."""
    check_spec(spec)
    paddle.set_device("cpu")
    model = start_model(spec, use_sdpa=_use_sdpa(spec))
    params = dict(model.named_parameters())
    names = canonical_names(family_module(spec["model"]["family"]), model)
    tensors = {canon: np.ascontiguousarray(params[ours].numpy().T if transposed else params[ours].numpy())
               for ours, (canon, transposed) in names.items()}
    neutral.save_file(tensors, f"{directory}/{neutral.WEIGHTS_FILE}", metadata={"format": "paddle"})


def _first_tensor(output):
    if isinstance(output, paddle.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((t for t in (_first_tensor(v) for v in values) if t is not None), None)


def probe_modules(spec: dict, path: str) -> None:
    """``--probe-modules FILE``: as the PyTorch adapter's (outputs in the same layout: a Linear's
    output is [..., out] on both sides), with each layer named by the canonical name of the module
    its parameters map to (the family's ``canonical_names``)."""
    from xfw.contract.synthetic import first_batch
    from xfw.contract.module_outputs import write_probe

    check_spec(spec)
    paddle.set_device("cpu")
    family = family_module(spec["model"]["family"])
    model = start_model(spec, use_sdpa=_use_sdpa(spec))
    model.train()
    names = canonical_names(family, model)
    found: list[tuple[str, np.ndarray]] = []
    seen: set[str] = set()

    def hook(name):
        def record(_layer, _inputs, output):
            tensor = _first_tensor(output)
            if name not in seen and tensor is not None and tensor.dtype in (paddle.float32, paddle.float64):
                seen.add(name)
                found.append((name, tensor.detach().astype("float32").numpy()))
        return record

    for name, layer in model.named_sublayers():
        own = next(iter(layer.named_parameters(include_sublayers=False)), None)
        if own is not None and f"{name}.{own[0]}" in names:
            canon = names[f"{name}.{own[0]}"][0].removesuffix(f".{own[0]}")
            layer.register_forward_post_hook(hook(canon))
    batch = device_batch(family, spec["model"]["arch"], first_batch(spec), gpu=False)
    with paddle.no_grad():
        family.loss_fn(model, batch, contextlib.nullcontext)
    write_probe(path, found)
