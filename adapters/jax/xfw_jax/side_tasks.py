"""The JAX adapter's side tasks (``xfw.contract.harness``'s file formats)::

    python -m xfw_jax --export-weights DIR --spec spec.json          # initial weights, canonical names
    python -m xfw_jax --count-params FILE --spec a.json [--spec ...]  # sizes by part, shapes only
"""

from __future__ import annotations

from xfw.contract import weights as neutral
from xfw_jax import model as models


def count_params(spec: dict) -> dict:
    """``--count-params``: the spec's starting model traced abstractly (``nnx.eval_shape``: shapes, no
    storage), the stage's parts marked trainable as a run marks them, tallied by part."""
    from flax import nnx

    abstract = nnx.eval_shape(lambda: models.build_model(spec, weights=False))
    return models.counts(abstract, spec)


def export_weights(spec: dict, directory: str) -> None:
    """``--export-weights DIR``: the model a run of this spec starts from, fp32, canonical names."""
    models.export(models.build_model(spec), f"{directory}/{neutral.WEIGHTS_FILE}")
