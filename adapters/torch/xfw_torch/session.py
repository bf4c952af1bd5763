"""The PyTorch side of the harness protocol: build, apply settings, step, time, report.

Neutral settings map to PyTorch's native mechanisms:

* O1: ``torch.autocast`` over fp32 weights.
* O2: weights cast to the low-precision dtype, autocast kept for its fp32 islands (softmax,
  losses), and fp32 master copies of the trainable weights owned by the optimizer
  (:class:`MasterWeights`) — what Paddle's ``decorate(level='O2', master_weight=True)`` does.
* fp16 adds a ``GradScaler``. Recompute is transformers' per-layer activation checkpointing.
* What trains: the stage's parts (or the recipe's ``model.trainable``), selected per parameter by
  its canonical name (:func:`select_trainable`, the family's facts in ``xfw.contract.families``);
  LoRA adapters go into the family's LoRA module (:func:`lora_target`).
* ``optimizer.max_grad_norm``: ``clip_grad_norm_`` over the trainable (master) gradients, unscaled,
  before the step (FSDP1's own ``clip_grad_norm_``; DeepSpeed's ``gradient_clipping``).
* Prepared data: ``torch.utils.data.DataLoader`` over the core's micro-batches, iterated inside
  the timed loop (:meth:`TorchSession.batches`; knobs ``loader_workers``, ``loader_prefetch``).

Timestamps are CUDA events on GPU and ``perf_counter`` on CPU (where execution is
synchronous); losses leave the GPU through pinned memory so reading them never syncs.
"""

from __future__ import annotations

import contextlib
import resource
import time

import torch

from xfw.contract import families, hf_names
from xfw.contract import weights as neutral
from xfw.contract.env import cpu_model, package_versions
from xfw.contract import knobs as knob_declaration
from xfw.contract.harness import InvalidSpec, Unsupported, loader_settings, wants_grad_norm
from xfw_torch import mechanisms, parallel
from xfw_torch.families import family_module

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# knobs.json beside this file: the one list, which xfw's core reads too (xfw validate).
KNOBS = set(knob_declaration.adapter_declaration(__file__))


def _library_versions() -> dict[str, str]:
    return {"torch": torch.__version__,
            **package_versions(("transformers", "diffusers", "peft", "accelerate", "deepspeed", "numpy"))}


def describe() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "backend": "torch", "framework": "torch", "framework_version": torch.__version__,
        "framework_commit": getattr(torch.version, "git_version", None) or None,  # the build's own record (builds.md)
        "versions": _library_versions(), "device": "cuda:0" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name(0) if cuda else cpu_model(),
        "cuda_version": torch.version.cuda, "cudnn_version": str(torch.backends.cudnn.version()) if cuda else None,
        "launcher": ["{python}", "-m", "torch.distributed.run", "--nnodes", "{nnodes}", "--node_rank", "{node_rank}",
                     "--master_addr", "{master_addr}", "--master_port", "{master_port}",
                     "--nproc_per_node", "{nproc}", "-m", "xfw_torch"],
    }


def apply_lora(target: torch.nn.Module, lora: dict) -> None:
    """peft LoRA adapters injected in place into ``target``; only the adapters train there."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=list(lora["targets"]))
    try:
        inject_adapter_in_model(config, target)
    except ValueError as err:  # e.g. a target module name that does not exist
        raise InvalidSpec(f"lora.targets: {err}") from None


def load_weights(model: torch.nn.Module, directory: str, *, family: str = "", lora: bool = False) -> None:
    """Copy ``directory``'s tensors (canonical names, xfw.contract.weights; older transformers names
    mapped by xfw.contract.hf_names) into ``model``, strictly: every parameter, nothing extra, same
    shapes. ``lora=False``: the base parameters (the file's LoRA adapters are not looked at);
    ``lora=True``: the peft adapters injected since, named as peft saves them."""
    params = {hf_names.peft_to_canonical(n): p for n, p in model.named_parameters()}  # tied: first name only
    params = {n: p for n, p in params.items() if hf_names.is_lora(n) == lora}
    try:
        ckpt = neutral.Checkpoint(directory, family=family)
        ckpt.check({n: tuple(p.shape) for n, p in params.items()}, lora=lora)
        state = ckpt.load(params)
    except neutral.WeightsError as err:
        raise InvalidSpec(str(err) if str(err).startswith("model.weights") else f"model.weights: {err}") from None
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(torch.from_numpy(state[name]))


def _weights_dir(spec: dict) -> str | None:
    weights = spec["model"].get("weights", "random")
    return None if weights == "random" else weights


def build_model(spec: dict, device: torch.device, attn: str, *, weights: bool = True) -> torch.nn.Module:
    """The family's model as a run starts from: seeded random init, then ``model.weights`` if
    it names a directory (and ``weights``). Base weights only (LoRA comes after the stage's
    freezing: :func:`add_lora`)."""
    torch.manual_seed(spec["measure"]["seed"])  # the same initial weights on every rank
    with device:  # initialise on the device: a 7B model built on the host takes minutes
        model = family_module(spec["model"]["family"]).build(spec["model"]["arch"], attn_implementation=attn)
    directory = _weights_dir(spec) if weights else None
    if directory is not None:
        load_weights(model, directory, family=spec["model"]["family"])
        try:
            neutral.Checkpoint(directory, family=spec["model"]["family"]).check_stage(spec["stage"])
        except neutral.WeightsError as err:
            raise InvalidSpec(str(err)) from None
    return model


def select_trainable(model: torch.nn.Module, spec: dict) -> None:
    """``requires_grad`` per parameter from its canonical name: the parts the spec trains (its
    ``model.trainable``, else its stage's; ``xfw.contract.families``; the Paddle adapter selects by
    the same facts)."""
    arch = spec["model"]["arch"]
    try:
        parts = families.spec_parts(spec)
    except KeyError as err:
        raise Unsupported(str(err)) from None
    for name, param in model.named_parameters():
        param.requires_grad_(families.trains(arch, parts, hf_names.peft_to_canonical(name)))


def lora_target(arch: dict, model: torch.nn.Module) -> torch.nn.Module:
    """The module stage lora's adapters go into: the family's ``LORA_MODULE`` (a canonical name,
    which is this model's own module name)."""
    return model.get_submodule(families.lora_module(arch))


def add_lora(model: torch.nn.Module, spec: dict, *, weights: bool = True) -> None:
    """Stage ``lora``: peft adapters on the family's LoRA module, seeded (the RNG continues from
    the model's init), then the adapters of ``model.weights`` when it holds any (else the seeded ones)."""
    apply_lora(lora_target(spec["model"]["arch"], model), spec["lora"])
    directory = _weights_dir(spec) if weights else None
    if directory is not None and neutral.Checkpoint(directory, family=spec["model"]["family"]).names(lora=True):
        load_weights(model, directory, family=spec["model"]["family"], lora=True)


def start_model(spec: dict, device: torch.device, attn: str, *, weights: bool = True) -> torch.nn.Module:
    """The model a run of this spec starts from: built, the stage's parts trainable and the rest
    frozen, LoRA adapters injected; ``weights=False`` leaves ``model.weights`` unread."""
    model = build_model(spec, device, attn, weights=weights)
    select_trainable(model, spec)
    if spec["stage"] == "lora":
        add_lora(model, spec, weights=weights)
    return model


class MasterWeights:
    """fp32 master copies of low-precision trainable weights; the optimizer updates these."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.model_params = params
        self.master_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]

    def grads_to_master(self) -> None:
        for p, m in zip(self.model_params, self.master_params):
            m.grad = None if p.grad is None else p.grad.float()

    def master_to_model(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master_params):
                p.copy_(m)
                p.grad = None


class TorchSession:
    def __init__(self, spec: dict):
        knobs = spec["backend_knobs"]
        unknown = sorted(set(knobs) - KNOBS)
        if unknown:
            raise InvalidSpec(f"backends.torch.{unknown[0]}: unknown knob (known: {', '.join(sorted(KNOBS))})")
        self.plan = plan = mechanisms.Plan(spec, torch.cuda.is_available())  # knobs -> mechanisms (module doc)
        impl = plan.sharding_impl(spec, parallel.IMPLS) if spec["derived"]["num_processes"] > 1 else "none"
        family = family_module(spec["model"]["family"])
        self.rank, self.num_ranks, self.device = parallel.init_distributed(torch.cuda.is_available())
        plan.apply_tf32()
        if self.num_ranks != spec["derived"]["num_processes"]:
            raise InvalidSpec(f"parallel: the spec asks for {spec['derived']['num_processes']} processes, "
                              f"the launcher started {self.num_ranks}")
        self.cuda = self.device.type == "cuda"
        attn = plan.attn
        model = start_model(spec, self.device, attn)
        if plan.recompute:  # the recipe's, or this side's own (backends.torch.recompute)
            family.enable_recompute(model, reentrant=plan.checkpointing == "reentrant")
        # A debugging switch people leave on by accident (every op records its traceback and every
        # backward checks for NaN): slow by design; the nightly suite uses it to inject a slowdown.
        self.detect_anomaly = bool(knobs.get("detect_anomaly", False))
        torch.autograd.set_detect_anomaly(self.detect_anomaly, check_nan=self.detect_anomaly)
        self.compiled = bool(knobs.get("compile", False))
        if self.compiled:
            # Per block, not the whole model: the blocks share one graph (compiled once), and
            # recompute and FSDP keep working at block boundaries.
            for unit in getattr(family, "compile_units", family.shard_units)(model):
                unit.compile()
        model.train()
        self.model = model
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.num_params_total = sum(p.numel() for p in model.parameters())
        self.num_params_trainable = sum(p.numel() for p in trainable)

        dtype_name, level = spec["precision"]["dtype"], spec["precision"]["amp_level"]
        self.dtype = DTYPES[dtype_name]
        fsdp = impl in ("fsdp1", "fsdp2")
        # O2: FSDP keeps fp32 shards and computes in low precision (its shards are the master
        # weights); everything else casts the weights and keeps fp32 masters in the optimizer.
        # (DeepSpeed likewise: it casts the fp32 model itself and keeps the fp32 masters.)
        fp32_masters_elsewhere = fsdp or impl == "deepspeed"
        model.to(self.device, dtype=self.dtype if level == "O2" and not fp32_masters_elsewhere else torch.float32)
        self.module, self.impl = parallel.apply_parallel(
            parallel.LossModule(model, family.loss_fn), spec=spec, impl=impl, units=family.shard_units(model),
            device=self.device, dtype=self.dtype if level == "O2" and fsdp else None,
            find_unused=getattr(family, "DDP_FIND_UNUSED", False))
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.engine, self.deepspeed_version = None, None
        if self.impl == "deepspeed":
            if dtype_name == "fp16":
                raise Unsupported("sharding_impl deepspeed with fp16: DeepSpeed's loss scaler is not wired in; "
                                  "use bf16 or another sharding_impl")
            # ZeRO keeps the fp32 masters itself under O2, and owns the optimizer and accumulation.
            self.engine, self.deepspeed_version = parallel.deepspeed_engine(self.module, trainable, spec, plan)
            self.module = self.engine
        # precision.master_weights: false (O2): the optimizer updates the low-precision weights themselves,
        # pure bf16/fp16 training; FSDP and DeepSpeed keep fp32 masters of their own, which cannot be turned off.
        masters = spec["precision"].get("master_weights", True)
        if not masters and (fsdp or self.engine):
            raise Unsupported(f"precision.master_weights: false with {impl}: it keeps fp32 master weights itself "
                              "(its shards / its optimizer); use DDP or one process for pure low-precision training")
        self.master = MasterWeights(trainable) if level == "O2" and not fsdp and not self.engine and masters else None
        self.optimizer = None if self.engine else parallel.make_optimizer(
            self.master.master_params if self.master else trainable, self.impl, spec["optimizer"],
            plan.optimizer_kwargs())
        self.fused = mechanisms.optimizer_impl(self.optimizer) == "fused"
        plan.note_unused_deepspeed(self.impl)
        self.attention_kernel = None  # observed on the first warm-up step (mechanisms.watch_first_step)
        self.autocast = level in ("O1", "O2")
        self.scaler = None
        if dtype_name == "fp16":
            if fsdp:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(self.device.type)
            else:
                self.scaler = torch.amp.GradScaler(self.device.type)
        self.spec, self.attn, self.level = spec, attn, level
        self.record_grad_norm = wants_grad_norm(spec)
        self._grad_norm = None
        self.max_grad_norm = spec["optimizer"].get("max_grad_norm") or 0.0
        self.loader = loader_settings(spec)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    # -- the step ---------------------------------------------------------------------------
    def to_device(self, batch: dict) -> dict:
        return {k: torch.from_numpy(v).to(self.device, non_blocking=True) for k, v in batch.items()}

    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def batches(self, dataset):
        """The core's micro-batches of prepared data through torch's DataLoader (no batching of its
        own: each item is a whole micro-batch), moved to the device as they come."""
        workers, prefetch = self.loader
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers,
                                             prefetch_factor=prefetch if workers else None, pin_memory=self.cuda)
        for batch, meta in loader:
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}, meta.numpy()

    def _trainable_grads(self) -> list:
        return self.master.master_params if self.master else [p for p in self.module.parameters() if p.requires_grad]

    def train_step(self, micro_batches: list) -> torch.Tensor:
        loss = self.forward_backward(micro_batches)
        self.optimizer_step()
        return loss

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        """The step's first part (the harness's breakdown): every micro-batch's forward and backward;
        the first warm-up step's attention operators observed (``applied.mechanisms``)."""
        with mechanisms.watch_first_step(self, self.spec["measure"]["warmup_steps"], self.compiled):
            return self._forward_backward(micro_batches)

    def _forward_backward(self, micro_batches: list) -> torch.Tensor:
        if self.engine is not None:
            return self._deepspeed_step(micro_batches)
        total = torch.zeros((), device=self.device)
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            with parallel.gradient_sync(self.module, self.impl, enabled=i == last):
                with self._autocast():
                    loss = self.module(**batch) / len(micro_batches)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach().float()
        return total

    def optimizer_step(self) -> None:
        """The step's second part: clipping, the update, zeroing the gradients."""
        if self.engine is not None:
            self.engine.step()  # the last micro-batch's: the engine's optimizer step
            return
        if self.master:
            self.master.grads_to_master()
        if self.scaler and (self.record_grad_norm or self.max_grad_norm):
            self.scaler.unscale_(self.optimizer)  # the step below then skips its own unscale
        if self.record_grad_norm:
            self._grad_norm = self._global_grad_norm()
        if self.max_grad_norm:  # the global norm, before the step (PaddleNLP's and transformers' max_grad_norm)
            if self.impl == "fsdp1":
                self.module.clip_grad_norm_(self.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(self._trainable_grads(), self.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master:
            self.master.master_to_model()

    def _deepspeed_step(self, micro_batches: list) -> torch.Tensor:
        """The engine scales each micro-batch's loss by 1/accumulation in backward and applies the
        optimizer at the last one (:meth:`optimizer_step`); the reported loss is the same mean as the plain path's."""
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            with self._autocast():
                loss = self.engine(**batch)
            self.engine.backward(loss)
            if i < len(micro_batches) - 1:
                self.engine.step()
            total += loss.detach().float() / len(micro_batches)
        return total

    def _global_grad_norm(self) -> torch.Tensor:
        """L2 over every trainable gradient (unscaled), in float64, on the device (no sync here)."""
        squares = [p.grad.detach().double().square().sum() for p in self._trainable_grads() if p.grad is not None]
        return torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)

    def grad_norm(self) -> float:
        return float(self._grad_norm.item())  # SYNC: only when the spec asks for it (parity)

    def eval_loss(self, batch: dict) -> float:
        """One held-out micro-batch's loss (``measure.eval_every``, xfw converge): the training forward
        (the same wrapper, precision and autocast) without gradients, the model in eval mode."""
        self.module.eval()
        try:
            with torch.no_grad(), self._autocast():
                loss = self.module(**batch)
            return float(loss.detach().float().item())  # SYNC: an evaluation, between steps
        finally:
            self.module.train()

    # -- timing and memory ------------------------------------------------------------------
    def loss_token(self, loss: torch.Tensor):
        if not self.cuda:
            return loss
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(loss, non_blocking=True)  # async D2H; valid once the next timestamp is done
        return host

    def loss_value(self, token: torch.Tensor) -> float:
        return float(token.item())

    def timestamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def is_done(self, stamp) -> bool:
        return stamp.query() if self.cuda else True

    def elapsed_s(self, start, end) -> float:
        if not self.cuda:
            return end - start
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def memory_peaks(self) -> tuple[int | None, int | None]:
        if self.cuda:
            return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        # ru_maxrss is in KiB on Linux: the whole process's peak, not an allocator's.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None

    def is_oom(self, error: BaseException) -> bool:
        return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()

    def applied(self) -> dict:
        level = self.level
        weight_dtype = next(self.model.parameters()).dtype
        compute = str(self.dtype).removeprefix("torch.") if self.autocast else "float32"
        fsdp = self.impl in ("fsdp1", "fsdp2")
        notes = {"O0": "fp32 throughout", "O1": "torch.autocast over fp32 weights",
                 "O2": "low-precision weights + autocast + fp32 master weights in the optimizer"}[level]
        if level == "O2" and not fsdp and self.engine is None and self.master is None:
            notes = "low-precision weights + autocast, no master weights: the optimizer updates them in place"
        if level == "O2" and fsdp:
            notes = f"{self.impl} mixed precision: {compute} compute over fp32 shards (the master weights), fp32 reduce"
        if self.engine is not None:
            stage = self.spec["parallel"]["sharding"].removeprefix("stage")
            notes = (f"DeepSpeed {self.deepspeed_version} ZeRO-{stage}, torch AdamW; "
                     + ("bf16 weights, fp32 master weights in ZeRO's optimizer" if level == "O2" else notes))
        if self.scaler:
            notes += f"; {type(self.scaler).__name__}"
        if self.compiled:
            notes += "; torch.compile per block"
        if self.record_grad_norm:
            notes += "; gradient norm read every step (a host sync: parity, not a measurement)"
        if self.detect_anomaly:
            notes += "; autograd anomaly detection on"
        if self.max_grad_norm:
            notes += f"; gradients clipped to global norm {self.max_grad_norm:g}"
        versions = {f"version_{k}": v for k, v in _library_versions().items()}
        return dict(
            framework="torch", framework_version=torch.__version__, device=str(self.device),
            device_name=torch.cuda.get_device_name(self.device) if self.cuda else cpu_model(),
            weight_dtype=str(weight_dtype).removeprefix("torch."), compute_dtype=compute, amp_level=level,
            master_weights=self.master is not None or (level == "O2" and (fsdp or self.engine is not None)), sharding_impl=self.impl,
            attention_impl=self.attn, tf32=bool(self.cuda and torch.backends.cuda.matmul.allow_tf32),
            fused_optimizer=self.fused, recompute=self.plan.recompute,
            num_params_total=self.num_params_total, num_params_trainable=self.num_params_trainable,
            num_processes=self.num_ranks, grad_accum_steps=self.spec["derived"]["grad_accum_steps"],
            mem_source="cuda_allocator" if self.cuda else "peak_rss", notes=notes, **versions,
            mechanisms=mechanisms.mechanisms(self, self.spec),
            **({"not_honoured": dict(self.plan.not_honoured)} if self.plan.not_honoured else {}),
        )


def build_session(spec: dict) -> TorchSession:
    return TorchSession(spec)
