"""Where arrays live: one device, or a ``jax.sharding`` mesh over every rank's device (docs/jax.md).

Several processes are JAX's multi-controller form, as on a TPU pod or several GPU hosts: each rank is
a process (started by ``xfw_jax.launch``), ``jax.distributed.initialize`` joins them (on CPU over
Gloo collectives), and one ``Mesh`` with a ``data`` axis spans their devices. Each rank reads its
own micro-batches (the harness's, as for the other adapters); ``jax.make_array_from_process_local_data``
makes them one global batch sharded over ``data``, and XLA's SPMD partitioner inserts the
collectives. The recipe's ``parallel.sharding`` picks what is sharded besides the batch:

* ``none``: data parallel, parameters and optimizer state replicated (gradients all-reduced);
* ``stage1``: the optimizer state sharded over ``data`` (ZeRO-1);
* ``stage2``: the gradients too (reduce-scattered; ZeRO-2);
* ``stage3``: the parameters too (FSDP: gathered where used, trained and frozen alike).

An array is sharded along its largest axis that ``data`` divides; one that no axis fits stays
replicated (small biases and norms, as FSDP's flat parameters are padded instead).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xfw.contract.harness import InvalidSpec, Unsupported

IMPLS = {"none": "jax_dp", "stage1": "jax_zero1", "stage2": "jax_zero2", "stage3": "jax_fsdp"}
DETAIL = {"none": "data parallel: parameters and optimizer state replicated, gradients all-reduced",
          "stage1": "optimizer state sharded over the data axis (ZeRO-1)",
          "stage2": "optimizer state and gradients sharded over the data axis (ZeRO-2)",
          "stage3": "parameters, gradients and optimizer state sharded over the data axis (FSDP)"}
COORDINATOR = "XFW_JAX_COORDINATOR"
FIXED_SHAPES = ("sd15",)
"""Families whose prepared samples all have one shape (SD1.5: images resized and cropped to the preset's size,
captions padded to the tokenizer's max_length), so the ranks' micro-batches make one global array."""


class Layout:
    def __init__(self, spec: dict):
        n = spec["derived"]["num_processes"]
        self.sharding = spec["parallel"]["sharding"]
        if n == 1:
            self.rank, self.num_ranks, self.mesh = 0, 1, None
            self.device = jax.devices()[0]
            self.impl, self.detail = "none", "one process, one device"
            return
        if spec["data"]["kind"] != "synthetic" and spec["model"]["family"] not in FIXED_SHAPES:
            raise Unsupported(f"parallel: {n} processes on prepared data: the ranks' micro-batches differ in "
                              "length, and one global JAX batch needs one shape; synthetic data, or a family "
                              f"whose prepared samples have one shape ({', '.join(FIXED_SHAPES)}), only for now")
        if self.sharding not in IMPLS:
            raise Unsupported(f"parallel.sharding {self.sharding!r} is not mapped by the JAX adapter")
        if COORDINATOR not in os.environ or "RANK" not in os.environ:
            raise InvalidSpec(f"parallel: {n} processes, but this process was not started by xfw_jax.launch "
                              f"({COORDINATOR} and RANK unset)")
        self.rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != n:
            raise InvalidSpec(f"parallel: the spec asks for {n} processes, the launcher started {world}")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; before any backend
        jax.distributed.initialize(os.environ[COORDINATOR], num_processes=world, process_id=self.rank)
        self.num_ranks = jax.process_count()
        self.mesh = Mesh(np.array(jax.devices()), ("data",))
        self.impl, self.detail = IMPLS[self.sharding], DETAIL[self.sharding]

    # -- shardings ----------------------------------------------------------------------------
    def _split(self, shape: tuple) -> NamedSharding:
        """Sharded over ``data`` along the largest axis it divides, else replicated."""
        size = self.mesh.shape["data"]
        axes = sorted((d for d in range(len(shape)) if shape[d] % size == 0 and shape[d] >= size),
                      key=lambda d: -shape[d])
        spec = [None] * len(shape)
        if axes:
            spec[axes[0]] = "data"
        return NamedSharding(self.mesh, P(*spec))

    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def shardings(self, tree, sharded: bool):
        return jax.tree.map(lambda x: self._split(x.shape) if sharded else self._replicated(), tree)

    def param_shardings(self, tree):
        return None if self.mesh is None else self.shardings(tree, self.sharding == "stage3")

    def grad_shardings(self, tree):
        return None if self.mesh is None else self.shardings(tree, self.sharding in ("stage2", "stage3"))

    def opt_shardings(self, tree):
        return None if self.mesh is None else self.shardings(tree, self.sharding != "none")

    # -- placing ------------------------------------------------------------------------------
    def _put(self, tree, shardings):
        def put(x, sharding):
            value = np.asarray(x)  # every rank holds the same start (one seed, one file)
            return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
        return jax.tree.map(put, tree, shardings)

    def place_params(self, state):
        if self.mesh is None:
            return jax.device_put(state, self.device)
        return self._put(state, self.param_shardings(state))

    def place_batch(self, batch: dict) -> dict:
        if self.mesh is None:
            return {k: jax.device_put(v, self.device) for k, v in batch.items()}
        sharding = NamedSharding(self.mesh, P("data"))
        return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
