"""Where arrays live: one device, or a ``jax.sharding`` mesh over several (docs/jax.md).

:class:`Layout` maps the recipe's ``parallel`` section onto JAX's own mechanism. One process drives
its devices (JAX's single-controller model): ``parallel.nproc_per_node`` > 1 asks for several
processes, each a rank, which this adapter does not launch yet (``unsupported``, with the reason).
"""

from __future__ import annotations

import jax

from xfw.contract.harness import Unsupported


class Layout:
    def __init__(self, spec: dict):
        n = spec["derived"]["num_processes"]
        if n != 1:
            raise Unsupported(f"parallel: {n} processes: the JAX adapter runs one controller process; "
                              "multi-process jax.distributed is not wired in yet")
        self.rank, self.num_ranks = 0, 1
        self.device = jax.devices()[0]
        self.impl, self.detail = "none", "one process, one device"

    def place_params(self, state):
        return jax.device_put(state, self.device)

    def place_batch(self, batch: dict) -> dict:
        return {k: jax.device_put(v, self.device) for k, v in batch.items()}
