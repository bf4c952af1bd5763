"""xfw's JAX adapter: ``python -m xfw_jax --spec spec.json --records steps.jsonl``.

Builds the neutral architecture in the spec in Flax NNX, trains it with optax through the core's
shared loop (``xfw.contract.harness``), and reports the settings it actually applied.
"""
