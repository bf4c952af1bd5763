"""The model a Paddle run starts from: the family's model built with a seeded init, the checkpoint
in ``model.weights`` converted on the fly (canonical names, torch layouts), the parts the spec
trains selected by their canonical names, and LoRA adapters from ``paddlenlp.peft`` on exactly the
linears peft adapts on the PyTorch side (:func:`lora_config_for`)::

    model = start_model(spec, use_sdpa=True)     # what xfw_paddle.session.PaddleSession trains
"""

from __future__ import annotations

import numpy as np
import paddle

from xfw.contract import families, hf_names
from xfw.contract import weights as neutral
from xfw.contract.harness import InvalidSpec, Unsupported
from xfw_paddle.families import family_module
from xfw_paddle import nlp


def lora_config_for(target: paddle.nn.Layer, lora: dict):
    r"""paddlenlp's ``LoRAConfig`` for the neutral LoRA settings, adapters on exactly the linears
    peft adapts on the PyTorch side.

    peft takes a target name as a module-name suffix (``q_proj`` matches ``layers.0.self_attn.q_proj``);
    paddlenlp takes a regular expression over the full name (``re.fullmatch``), so each name
    becomes ``(.*\.)?q_proj``. Scaling is alpha / r in both (no rsLoRA). A name matching no
    Linear under ``target`` is an error here for every name (peft raises only when none matches).
    """
    import re

    LoRAConfig = nlp.load("paddlenlp.peft").LoRAConfig

    names = [name for name, layer in target.named_sublayers() if isinstance(layer, paddle.nn.Linear)]
    patterns = [rf"(.*\.)?{re.escape(t)}" for t in lora["targets"]]
    for t, pattern in zip(lora["targets"], patterns):
        if not any(re.fullmatch(pattern, n) for n in names):
            raise InvalidSpec(f"lora.targets: {t!r} names no linear layer of the language model")
    return LoRAConfig(target_modules=patterns, r=lora["r"], lora_alpha=lora["alpha"],
                      lora_dropout=lora["dropout"], rslora=False, dtype="float32")


def apply_lora(target: paddle.nn.Layer, lora: dict) -> None:
    """paddlenlp.peft LoRA adapters replace the targeted linears of ``target`` in place; within
    ``target`` only the adapters train (what the stage trains elsewhere is left as it is)."""
    LoRAModel = nlp.load("paddlenlp.peft").LoRAModel

    config = lora_config_for(target, lora)
    if not hasattr(target, "config"):  # LoRAModel reads config.tensor_parallel_degree
        from types import SimpleNamespace

        target.config = SimpleNamespace(tensor_parallel_degree=1)
    LoRAModel(target, config)  # replaces the sublayers of ``target``; the wrapper itself is not needed


def canonical_names(family, model: paddle.nn.Layer) -> dict[str, tuple[str, bool]]:
    """The family's ``{our name: (canonical name, transposed?)}`` with paddlenlp's LoRA adapters
    named as peft saves them: ``q_proj.lora_A`` [in, r] is ``q_proj.lora_A.weight`` [r, in]
    and ``q_proj.lora_B`` [r, out] is ``q_proj.lora_B.weight`` [out, r] (both transposed)."""
    names = dict(family.canonical_names(model))
    for ours in names:
        for part in ("lora_A", "lora_B"):
            if ours.endswith(f".{part}"):
                linear = names[f"{ours.removesuffix(part)}weight"][0].removesuffix(".weight")
                names[ours] = (f"{linear}.{part}.weight", True)
    return names


def load_weights(model: paddle.nn.Layer, names: dict[str, tuple[str, bool]], directory: str, *,
                 family: str = "", lora: bool = False) -> None:
    """Convert ``directory``'s tensors (canonical names, torch layouts; older transformers names
    mapped by xfw.contract.hf_names) on the fly and copy them into ``model``: ``names`` is
    :func:`canonical_names` (our name -> canonical name, transposed?). ``lora=False``: the base
    parameters; ``lora=True``: the adapters. Strict: every one present, nothing extra, shapes equal."""
    params = dict(model.named_parameters())
    names = {ours: v for ours, v in names.items() if hf_names.is_lora(v[0]) == lora}
    expected = {canon: tuple(reversed(params[ours].shape)) if transposed else tuple(params[ours].shape)
                for ours, (canon, transposed) in names.items()}
    try:
        ckpt = neutral.Checkpoint(directory, family=family)
        ckpt.check(expected, lora=lora)
        state = ckpt.load(expected)
    except neutral.WeightsError as err:
        raise InvalidSpec(str(err) if str(err).startswith("model.weights") else f"model.weights: {err}") from None
    for ours, (canon, transposed) in names.items():
        value = state[canon].T if transposed else state[canon]  # by layer kind, never by shape
        params[ours].set_value(np.ascontiguousarray(value).astype(str(params[ours].dtype).removeprefix("paddle.")))


def _weights_dir(spec: dict) -> str | None:
    weights = spec["model"].get("weights", "random")
    return None if weights == "random" else weights


def build_model(spec: dict, *, use_sdpa: bool, weights: bool = True) -> paddle.nn.Layer:
    """The family's model as a run starts from: seeded random init, then ``model.weights`` if
    it names a directory (and ``weights``), converted on the fly. Base weights only (LoRA: :func:`add_lora`)."""
    family = family_module(spec["model"]["family"])
    paddle.seed(spec["measure"]["seed"])
    model = family.build(spec["model"]["arch"], use_sdpa=use_sdpa, recompute=bool(spec["recompute"]))
    directory = _weights_dir(spec) if weights else None
    if directory is not None:
        load_weights(model, canonical_names(family, model), directory, family=spec["model"]["family"])
        try:
            neutral.Checkpoint(directory, family=spec["model"]["family"]).check_stage(spec["stage"])
        except neutral.WeightsError as err:
            raise InvalidSpec(str(err)) from None
    return model


def select_trainable(model: paddle.nn.Layer, spec: dict) -> None:
    """``stop_gradient`` per parameter from its canonical name (the family's ``canonical_names``):
    the parts the spec trains (its ``model.trainable``, else its stage's; ``xfw.contract.families``;
    the PyTorch adapter selects by the same facts)."""
    arch = spec["model"]["arch"]
    try:
        parts = families.spec_parts(spec)
    except KeyError as err:
        raise Unsupported(str(err)) from None
    names = canonical_names(family_module(spec["model"]["family"]), model)
    for ours, param in model.named_parameters():
        param.stop_gradient = not families.trains(arch, parts, names[ours][0])


def lora_target(arch: dict, model: paddle.nn.Layer) -> paddle.nn.Layer:
    """The layer stage lora's adapters go into: the outermost one holding exactly the parameters
    whose canonical names are under the family's ``LORA_MODULE`` (e.g. LLaVA's
    ``model.language_model`` is paddlenlp's ``language_model.llama``: the decoder without ``lm_head``)."""
    module = families.lora_module(arch)
    inside = {ours for ours, (canon, _) in family_module(arch["family"]).canonical_names(model).items()
              if canon.startswith(f"{module}.")}
    for path, layer in model.named_sublayers(include_self=True):
        if {f"{path}.{n}".lstrip(".") for n, _ in layer.named_parameters()} == inside:
            return layer
    raise Unsupported(f"no layer of the {arch['family']} model holds exactly {module}")


def add_lora(model: paddle.nn.Layer, spec: dict, *, weights: bool = True) -> None:
    """Stage ``lora``: paddlenlp.peft adapters on the family's LoRA module, then the adapters of
    ``model.weights`` when it holds any (else paddlenlp's seeded ones)."""
    family = family_module(spec["model"]["family"])
    # A family may bring its own (ppdiffusers models need a holder for paddlenlp.peft).
    getattr(family, "apply_lora", apply_lora)(lora_target(spec["model"]["arch"], model), spec["lora"])
    directory = _weights_dir(spec) if weights else None
    if directory is not None and neutral.Checkpoint(directory, family=spec["model"]["family"]).names(lora=True):
        load_weights(model, canonical_names(family, model), directory, family=spec["model"]["family"], lora=True)


def start_model(spec: dict, *, use_sdpa: bool, weights: bool = True) -> paddle.nn.Layer:
    """The model a run of this spec starts from: built, the stage's parts trainable and the rest
    frozen, LoRA adapters injected; ``weights=False`` leaves ``model.weights`` unread."""
    model = build_model(spec, use_sdpa=use_sdpa, weights=weights)
    select_trainable(model, spec)
    if spec["stage"] == "lora":
        add_lora(model, spec, weights=weights)
    return model
