"""The PyTorch adapter's side tasks: what ``python -m xfw_torch`` does besides training, each on
the model a run of the spec starts from (:func:`xfw_torch.session.start_model`)::

    python -m xfw_torch --export-weights DIR --spec spec.json          # initial weights, canonical names
    python -m xfw_torch --probe-modules FILE --spec spec.json          # per-module outputs (xfw.contract.module_outputs)
    python -m xfw_torch --count-params FILE --spec a.json --spec b.json   # sizes, built on the meta device
    python -m xfw_torch --count-flops FILE --spec a.json --spec b.json    # one step's FLOPs, on the meta device

The file formats are ``xfw.contract.harness``'s.
"""

from __future__ import annotations

import torch

from xfw.contract import families, hf_names
from xfw.contract import weights as neutral
from xfw_torch.families import family_module
from xfw_torch.session import start_model


def _attn(spec: dict) -> str:
    return spec["backend_knobs"].get("attn_implementation", "sdpa")


def count_params(spec: dict) -> dict:
    """``--count-params``: the spec's starting model built on the meta device (shapes, no
    storage: a 13B model costs no memory), stage freezing and LoRA adapters applied as a run
    applies them; its parameters tallied by part (``xfw.contract.families.tally``)."""
    with torch.device("meta"):  # peft's adapters too
        model = start_model(spec, torch.device("meta"), _attn(spec), weights=False)
    return families.tally(spec["model"]["arch"], ((hf_names.peft_to_canonical(n), p.numel(), p.requires_grad)
                                                  for n, p in model.named_parameters()))


def count_flops(spec: dict) -> dict:
    """``--count-flops``: the spec's starting model built on the meta device as for
    ``--count-params``, recompute enabled when the spec asks, one training step's forward and
    backward on its first micro-batch under FlopCounterMode, by ledger term (:mod:`xfw_torch.flops`)."""
    from xfw_torch.flops import count_step

    family = family_module(spec["model"]["family"])
    with torch.device("meta"):
        model = start_model(spec, torch.device("meta"), _attn(spec), weights=False)
    if spec["recompute"]:
        family.enable_recompute(model)
    model.train()
    return count_step(spec, model, family.loss_fn)


def export_weights(spec: dict, directory: str) -> None:
    """``python -m xfw_torch --export-weights DIR --spec spec.json``: the model a run of this
    spec starts from, LoRA adapters included, written to ``DIR/model.safetensors`` under the
    canonical names."""
    model = start_model(spec, torch.device("cpu"), _attn(spec))
    tensors = {hf_names.peft_to_canonical(n): p.detach().float().cpu().numpy() for n, p in model.named_parameters()}
    neutral.save_file(tensors, f"{directory}/{neutral.WEIGHTS_FILE}", metadata={"format": "pt"})


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((t for t in (_first_tensor(v) for v in values) if t is not None), None)


def probe_modules(spec: dict, path: str) -> None:
    """``--probe-modules FILE``: one forward pass of the spec's starting model on the first
    batch (synthetic or prepared); the output of every module that owns a parameter, in call order
    (first call only), under its canonical name (this model's own), written by
    ``xfw.contract.module_outputs``."""
    from xfw.contract.synthetic import first_batch
    from xfw.contract.module_outputs import write_probe

    model = start_model(spec, torch.device("cpu"), _attn(spec))
    model.train()  # as a run's first step computes it
    found: list[tuple[str, object]] = []
    seen: set[str] = set()

    def hook(name):
        def record(_module, _inputs, output):
            tensor = _first_tensor(output)
            if name not in seen and tensor is not None and tensor.is_floating_point():
                seen.add(name)
                found.append((name, tensor.detach().float().cpu().numpy()))
        return record

    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:  # peft's q_proj.base_layer is q_proj
            module.register_forward_hook(hook(hf_names.peft_to_canonical(f"{name}.").removesuffix(".")))
    batch = {k: torch.from_numpy(v) for k, v in first_batch(spec).items()}
    with torch.no_grad():
        family_module(spec["model"]["family"]).loss_fn(model, batch)
    write_probe(path, found)
