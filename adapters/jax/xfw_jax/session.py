"""The JAX side of the harness protocol: build in Flax NNX, jit the step, time it, report what ran.

Neutral settings map to JAX's own mechanisms (docs/jax.md):

* O0: fp32 parameters and compute. O1, and O2 with master weights: Flax's mixed precision, fp32
  parameters (``param_dtype``, the master weights) and bf16 compute (``dtype``): XLA casts each
  weight where it is used. O2 with ``precision.master_weights: false``: bf16 parameters, optax
  updates them in bf16 (pure bf16). fp16 needs a loss scaler, not wired in: ``unsupported``.
* ``recompute``: each decoder layer under ``nnx.remat`` (``jax.checkpoint``) with the knob
  ``remat_policy`` (default ``nothing_saveable``: transformers' per-layer checkpointing).
* The optimizer: ``optax.adamw`` with the recipe's lr, betas, eps and weight decay (constant lr: the
  recipe has no schedule), after ``optax.clip_by_global_norm`` when ``optimizer.max_grad_norm`` is set.
* What trains: ``nnx.split`` by canonical name (``xfw_jax.model.trainable_filter``); ``jax.grad``
  differentiates the trained state only, so the frozen vision tower has no backward, as on PyTorch.
* The step: two ``jax.jit`` programs (forward + backward over the micro-batches, gradients averaged;
  the optimizer update), each compiled ahead of time on its first inputs (``.lower().compile()``),
  the compile time measured apart and recorded (``applied.compile_time_s``), never inside a step.
* Several ranks (``xfw_jax.parallel``): one process per rank (``xfw_jax.launch``), joined by
  ``jax.distributed``; a ``jax.sharding`` mesh over their devices, ``parallel.sharding`` choosing what
  is sharded (data parallel, ZeRO-1/2, FSDP), XLA's SPMD partitioner placing the collectives.

JAX dispatches asynchronously: :meth:`JaxSession.timestamp` waits for the arrays the step produced
before reading the clock (on CPU what PyTorch's synchronous execution does implicitly). Memory on
CPU is the process's peak RSS (``mem_source: peak_rss``); on an accelerator the device's own
``memory_stats`` peak.
"""

from __future__ import annotations

import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xfw.contract import knobs as knob_declaration
from xfw.contract.env import cpu_model, package_versions
from xfw.contract.harness import InvalidSpec, Unsupported, loader_settings, wants_grad_norm
from xfw_jax import model as models
from xfw_jax import parallel
from xfw_jax.families import FAMILIES, NOT_PORTED, NOT_PORTED_VARIANTS, family_module

KNOBS = set(knob_declaration.adapter_declaration(__file__))
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")


def _library_versions() -> dict[str, str]:
    return {"jax": jax.__version__, **package_versions(("jaxlib", "flax", "optax", "numpy"))}


def _device_name() -> str:
    device = jax.local_devices()[0]
    return cpu_model() if device.platform == "cpu" else getattr(device, "device_kind", device.platform)


def describe() -> dict:
    device = jax.local_devices()[0]
    import jaxlib

    return {
        "backend": "jax", "framework": "jax", "framework_version": jax.__version__,
        "framework_commit": getattr(jaxlib.version, "_git_hash", None) if hasattr(jaxlib, "version") else None,
        "versions": _library_versions(), "device": f"{device.platform}:0", "device_name": _device_name(),
        "families": sorted(FAMILIES), "unsupported": {**NOT_PORTED, **NOT_PORTED_VARIANTS},
        "launcher": ["{python}", "-m", "xfw_jax.launch", "--nnodes", "{nnodes}", "--node_rank", "{node_rank}",
                     "--master_addr", "{master_addr}", "--master_port", "{master_port}",
                     "--nproc_per_node", "{nproc}", "--"],
    }


def _precision(spec: dict):
    """(compute dtype or None, parameter dtype, master weights?, note)."""
    dtype, level = spec["precision"]["dtype"], spec["precision"]["amp_level"]
    if level == "O0" or dtype == "fp32":
        return None, jnp.float32, False, "fp32 throughout"
    if dtype == "fp16":
        raise Unsupported("precision.dtype fp16: a loss scaler is not wired into the JAX adapter; use bf16")
    if level == "O2" and not spec["precision"].get("master_weights", True):
        return jnp.bfloat16, jnp.bfloat16, False, "pure bf16: bf16 parameters, optax updates them in bf16"
    return jnp.bfloat16, jnp.float32, level == "O2", \
        f"{level}: Flax dtype=bfloat16 over param_dtype=float32 (the fp32 parameters are the master weights)"


def _shapes(tree) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(tree))


class JaxSession:
    GRAD_NORM_ACROSS_RANKS = False

    def __init__(self, spec: dict):
        knobs = spec["backend_knobs"]
        unknown = sorted(set(knobs) - KNOBS)
        if unknown:
            raise InvalidSpec(f"backends.jax.{unknown[0]}: unknown knob (known: {', '.join(sorted(KNOBS))})")
        self.spec = spec
        attn = knobs.get("attn_implementation", "xla")
        if attn != "xla":
            raise Unsupported(f"backends.jax.attn_implementation {attn!r}: XLA has no fused attention kernel to "
                              "switch off (attention is einsum and softmax, fused by XLA like the rest); only 'xla'")
        self.family = family_module(spec["model"]["family"])
        self.compute_dtype, self.param_dtype, self.masters, self.precision_note = _precision(spec)
        self.layout = parallel.Layout(spec)  # ranks, mesh, sharding (xfw_jax.parallel)
        self.rank, self.num_ranks = self.layout.rank, self.layout.num_ranks
        model = models.build_model(spec, dtype=self.compute_dtype, param_dtype=self.param_dtype)
        self.remat_policy = None
        if knobs.get("recompute", spec["recompute"]):  # the recipe's, or this side's own (backends.jax.recompute)
            policy = knobs.get("remat_policy", "nothing_saveable")
            if policy not in REMAT_POLICIES:
                raise InvalidSpec(f"backends.jax.remat_policy: {policy!r} (known: {', '.join(REMAT_POLICIES)})")
            self.family.enable_recompute(model, getattr(jax.checkpoint_policies, policy))
            self.remat_policy = policy
        counted = models.counts(model, spec)
        self.num_params_total, self.num_params_trainable = counted["total"], counted["trainable"]
        if not self.num_params_trainable:
            raise Unsupported("nothing trains in this stage on the JAX adapter")
        self.graphdef, self.train, self.frozen = nnx.split(model, models.trainable_filter(spec), ...)
        self.train, self.frozen = self.layout.place_params(self.train), self.layout.place_params(self.frozen)
        opt = spec["optimizer"]
        if opt["name"] != "adamw":
            raise Unsupported(f"optimizer.name {opt['name']!r}: the JAX adapter runs adamw")
        self.max_grad_norm = opt.get("max_grad_norm") or 0.0
        adamw = optax.adamw(opt["lr"], b1=opt["betas"][0], b2=opt["betas"][1], eps=opt["eps"],
                            weight_decay=opt["weight_decay"])
        self.tx = optax.chain(optax.clip_by_global_norm(self.max_grad_norm), adamw) if self.max_grad_norm else adamw
        # optax's state made where it lives: sharded over the ranks from ZeRO-1 on (xfw_jax.parallel)
        opt_sh = self.layout.opt_shardings(jax.eval_shape(self.tx.init, self.train))
        self.opt_state = jax.jit(self.tx.init, out_shardings=opt_sh)(self.train)
        self.record_grad_norm = wants_grad_norm(spec)
        self.loader = loader_settings(spec)
        self.not_honoured = {}
        if self.loader[0]:
            self.not_honoured["loader_workers"] = (f"asked {self.loader[0]}, ran 0: the JAX adapter reads prepared "
                                                   "batches in the training process")
        self._grads, self._last, self._grad_norm = None, None, None
        self.compiled: dict = {}
        self.compile_time_s, self.compilations = 0.0, 0
        # Several ranks: the layouts pinned (xfw_jax.parallel), so every step keeps its sharding.
        train_sh = self.layout.param_shardings(self.train)
        grads_sh = self.layout.grad_shardings(self.train)
        replicated = None if self.layout.mesh is None else self.layout.shardings(0.0, False)
        self._fwd_bwd = jax.jit(self._fwd_bwd_fn, out_shardings=None if grads_sh is None else (replicated, grads_sh))
        self._update = jax.jit(self._update_fn, out_shardings=None if train_sh is None else (train_sh, opt_sh))
        self._eval = jax.jit(self._eval_fn)

    # -- the programs -------------------------------------------------------------------------
    def _loss(self, train, frozen, batch):
        return self.family.loss_fn(nnx.merge(self.graphdef, train, frozen), batch)

    def _fwd_bwd_fn(self, train, frozen, micro_batches):
        """Every micro-batch's loss and gradient, averaged (PyTorch's loss / accumulation, summed)."""
        grad_fn = jax.value_and_grad(self._loss)
        total, grads = None, None
        for batch in micro_batches:
            loss, g = grad_fn(train, frozen, batch)
            total = loss if total is None else total + loss
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        n = len(micro_batches)
        return total / n, jax.tree.map(lambda g: g / n, grads)

    def _update_fn(self, train, opt_state, grads):
        updates, opt_state = self.tx.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state

    def _eval_fn(self, train, frozen, batch):
        return self._loss(train, frozen, batch)

    def _run(self, name: str, jitted, *args):
        """``jitted(*args)`` through its ahead-of-time compiled executable for these shapes, compiling it
        (timed, outside any step's clock) the first time they occur."""
        key = (name, _shapes(args))
        if key not in self.compiled:
            t0 = time.perf_counter()
            self.compiled[key] = jitted.lower(*args).compile()
            self.compile_time_s += time.perf_counter() - t0
            self.compilations += 1
        return self.compiled[key](*args)

    # -- the step -----------------------------------------------------------------------------
    def to_device(self, batch: dict) -> dict:
        return self.layout.place_batch(batch)

    def batches(self, dataset):
        for batch, meta in dataset:
            yield self.to_device(batch), meta

    def train_step(self, micro_batches: list):
        loss = self.forward_backward(micro_batches)
        self.optimizer_step()
        return loss

    def forward_backward(self, micro_batches: list):
        loss, self._grads = self._run("fwd_bwd", self._fwd_bwd, self.train, self.frozen, list(micro_batches))
        self._last = (loss, self._grads)
        return loss

    def optimizer_step(self) -> None:
        if self.record_grad_norm:  # SYNC: parity only; float64 on the host, as the other adapters sum it
            self._grad_norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2)
                                                for g in jax.tree.leaves(self._grads))))
        self.train, self.opt_state = self._run("update", self._update, self.train, self.opt_state, self._grads)
        self._grads = None
        self._last = self.train

    def grad_norm(self) -> float:
        return self._grad_norm

    def eval_loss(self, batch: dict) -> float:
        return float(self._run("eval", self._eval, self.train, self.frozen, batch))  # SYNC: an evaluation

    # -- timing and memory --------------------------------------------------------------------
    def loss_token(self, loss):
        return loss

    def loss_value(self, token) -> float:
        return float(token)

    def timestamp(self):
        if self._last is not None:
            jax.block_until_ready(self._last)  # the step's arrays exist: its work is done
        return time.perf_counter()

    def is_done(self, stamp) -> bool:
        return True

    def elapsed_s(self, start, end) -> float:
        return end - start

    def synchronize(self) -> None:
        if self._last is not None:
            jax.block_until_ready(self._last)

    def memory_peaks(self) -> tuple[int | None, int | None]:
        stats = jax.local_devices()[0].memory_stats() if jax.local_devices()[0].platform != "cpu" else None
        if stats and "peak_bytes_in_use" in stats:
            return int(stats["peak_bytes_in_use"]), stats.get("bytes_reservable_limit")
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None  # KiB on Linux: the process's peak

    def is_oom(self, error: BaseException) -> bool:
        text = str(error).lower()
        return "resource_exhausted" in text or "out of memory" in text

    def applied(self) -> dict:
        on_cpu = jax.local_devices()[0].platform == "cpu"
        weight_dtype = str(jax.tree.leaves(self.train)[0].dtype)
        compute = "bfloat16" if self.compute_dtype is not None else "float32"
        notes = self.precision_note
        if self.remat_policy:
            notes += (f"; nnx.remat per block (a decoder layer; a UNet ResNet or transformer block), "
                      f"policy {self.remat_policy}")
        if self.max_grad_norm:
            notes += f"; optax.clip_by_global_norm({self.max_grad_norm:g})"
        if self.record_grad_norm:
            notes += "; gradient norm read every step (a host sync: parity, not a measurement)"
        notes += f"; {self.compilations} XLA compilations, {self.compile_time_s:.2f} s, outside the steps"
        versions = {f"version_{k}": v for k, v in _library_versions().items()}
        return dict(
            framework="jax", framework_version=jax.__version__, device=f"{jax.local_devices()[0].platform}:0",
            device_name=_device_name(), weight_dtype=weight_dtype, compute_dtype=compute,
            amp_level=self.spec["precision"]["amp_level"], master_weights=self.masters,
            sharding_impl=self.layout.impl, attention_impl="xla", tf32=False, fused_optimizer=True,
            recompute=self.remat_policy is not None, num_params_total=self.num_params_total,
            num_params_trainable=self.num_params_trainable, num_processes=self.num_ranks,
            grad_accum_steps=self.spec["derived"]["grad_accum_steps"],
            mem_source="peak_rss" if on_cpu else "cuda_allocator", notes=notes, **versions,
            compile_time_s=round(self.compile_time_s, 4),
            mechanisms={
                "attention_kernel": "XLA-fused einsum softmax (no named kernel)",
                "attention_impl": "xla",
                "optimizer_impl": "optax.adamw inside one jit program (XLA-fused)",
                "grad_reduce_dtype": "n/a (one process)" if self.num_ranks == 1 else weight_dtype,
                "master_weights": "fp32 parameters (param_dtype)" if self.masters else "none",
                "master_grads": f"the parameters' dtype ({weight_dtype})",
                "sharding_impl": self.layout.impl, "sharding_detail": self.layout.detail,
                "checkpointing": f"nnx.remat ({self.remat_policy})" if self.remat_policy else "none",
                "compile": f"jax.jit, ahead of time: {self.compilations} programs, {self.compile_time_s:.2f} s",
                "memory": "peak RSS of the process (ru_maxrss)" if on_cpu else "device memory_stats peak",
            },
            **({"not_honoured": dict(self.not_honoured)} if self.not_honoured else {}),
        )


def build_session(spec: dict) -> JaxSession:
    return JaxSession(spec)
