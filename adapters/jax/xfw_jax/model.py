"""The model a run starts from, in Flax NNX: built, the neutral checkpoint loaded, split into what trains.

* ``build_model``: the family's module tree (``xfw_jax.families``), seeded (``measure.seed``), then
  ``model.weights`` when it names a directory (canonical names, ``xfw_jax.names``), strictly: every
  parameter, nothing extra, same shapes (``xfw.contract.weights.Checkpoint``); in stage ``lora`` the
  adapters (``xfw_jax.lora``), then the file's adapters when it holds any.
* What trains is selected per parameter by its canonical name with the family's facts
  (``xfw.contract.families.trains``), as the two other adapters select it: :func:`trainable_filter`
  is an NNX filter, so ``nnx.split(model, trainable, nnx.Param, ...)`` gives the trained state apart
  from the frozen one and ``jax.grad`` differentiates only the first.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from xfw.contract import families
from xfw.contract import weights as neutral
from xfw.contract.harness import InvalidSpec, Unsupported
from xfw.contract.hf_names import is_lora
from xfw_jax import names
from xfw_jax.families import family_module


def params(model) -> list[tuple[tuple, nnx.Variable]]:
    """(NNX path, variable) of every parameter, in the module tree's order."""
    return [(path, var) for path, var in nnx.state(model, nnx.Param).flat_state()]


def _weights_dir(spec: dict) -> str | None:
    weights = spec["model"].get("weights", "random")
    return None if weights == "random" else weights


def load_weights(model, directory: str, family: str, *, lora: bool = False) -> None:
    """The base parameters (``lora=False``) or the LoRA adapters (True) from ``directory``, strictly."""
    import jax.numpy as jnp

    found = [(p, v) for p, v in params(model) if is_lora(names.canonical(p)) == lora]
    shapes = {names.canonical(p): names.canonical_shape(p, v[...].shape) for p, v in found}
    try:
        ckpt = neutral.Checkpoint(directory, family=family)
        ckpt.check(shapes, lora=lora)
        state = ckpt.load(shapes)
    except neutral.WeightsError as err:
        raise InvalidSpec(str(err) if str(err).startswith("model.weights") else f"model.weights: {err}") from None
    for path, var in found:
        value = names.from_canonical(path, np.asarray(state[names.canonical(path)], np.float32))
        var[...] = jnp.asarray(value, dtype=var[...].dtype)


def build_model(spec: dict, *, dtype=None, param_dtype=None, weights: bool = True):
    import jax.numpy as jnp

    family = spec["model"]["family"]
    model = family_module(family).build(spec["model"]["arch"], dtype=dtype, param_dtype=param_dtype or jnp.float32,
                                        seed=spec["measure"]["seed"])
    directory = _weights_dir(spec) if weights else None
    if directory is not None:
        load_weights(model, directory, family)
        try:
            neutral.Checkpoint(directory, family=family).check_stage(spec["stage"])
        except neutral.WeightsError as err:
            raise InvalidSpec(str(err)) from None
    if spec["stage"] == "lora":  # after the base weights, as peft injects its adapters
        from xfw_jax.lora import add_lora

        add_lora(model, spec)
        if directory is not None and neutral.Checkpoint(directory, family=family).names(lora=True):
            load_weights(model, directory, family, lora=True)
    return model


def trainable_filter(spec: dict):
    """An NNX filter: the parameters the spec's parts train (its ``model.trainable``, else its stage's)."""
    arch = spec["model"]["arch"]
    try:
        parts = families.spec_parts(spec)
    except KeyError as err:
        raise Unsupported(str(err)) from None

    def trains(path, value) -> bool:
        return isinstance(value, nnx.Param) and families.trains(arch, parts, names.canonical(path))
    return trains


def counts(model, spec: dict) -> dict:
    """``xfw.contract.families.tally`` of the model's parameters (the adapter's ``--count-params``)."""
    trains = trainable_filter(spec)
    return families.tally(spec["model"]["arch"],
                          ((names.canonical(p), int(np.prod(v[...].shape)), trains(p, v)) for p, v in params(model)))


def export(model, path: str) -> None:
    """The model's parameters, fp32, under the canonical names, to ``path`` (``xfw.contract.weights``)."""
    tensors = {names.canonical(p): names.to_canonical(p, np.asarray(v[...], np.float32)) for p, v in params(model)}
    neutral.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path, metadata={"format": "flax"})
