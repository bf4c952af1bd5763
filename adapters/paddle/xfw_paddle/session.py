"""The Paddle side of the harness protocol: build, apply settings, step, time, report.

Neutral settings map to Paddle's native mechanisms:

* O1: ``paddle.amp.auto_cast(level='O1')`` over fp32 weights.
* O2: ``paddle.amp.decorate(models, level='O2')`` + ``AdamW(multi_precision=True)`` (fp32 master
  weights) + ``auto_cast(level='O2')``, and master gradients as PaddleNLP's Trainer holds them:
  fp32 ``main_grad`` through ``MixPrecisionLayer`` / ``MixPrecisionOptimizer`` (never
  ``decorate(master_grad=True)``: under stage 2/3 it diverges, tests/contract/test_paddle_sharding.py);
  the order of the wrappers is in :mod:`xfw_paddle.parallel`. fp16 adds a ``GradScaler``.
  Paddle's CPU build ignores AMP and has no bf16 kernels, so on a plain CPU every run is fp32 and
  ``applied`` says so, with the request in ``notes`` (the ``main_grad`` machinery still runs, in fp32).
* ``backends.paddle.device``: ``auto`` (a GPU if Paddle sees one, else the CPU) or ``testcpu``:
  xfw's CPU test device, a Paddle custom device (``xfw_paddle.testdevice``) on which AMP runs bf16
  and ``group_sharded_parallel`` runs stage 2/3. Its timings are a CPU's, never GPU-like figures.
* ``backends.paddle.find_unused_parameters``: DataParallel's (default: the family's choice);
  ``backends.paddle.sharding_segment_size``: stage 3's ``segment_size`` (default Paddle's, 2**20, as the
  Trainer leaves it: a tiny model's parameters are all below it, so the tests lower it to slice them);
  ``backends.paddle.stage2_overlap``: stage 2's communication overlap (default off, as the Trainer without
  ``enable_stage2_overlap``; :mod:`xfw_paddle.parallel`).
* recompute: ``fleet.utils.recompute`` per decoder block (paddlenlp's for LLaVA's Llama, the
  family's own for Qwen2-VL).
* what trains: the stage's parts (or the recipe's ``model.trainable``), selected per parameter by
  its canonical name (``xfw_paddle.model.select_trainable``, the family's facts in ``xfw.contract.families``).
* ``optimizer.max_grad_norm``: ``paddle.nn.ClipGradByGlobalNorm`` as the optimizer's ``grad_clip``
  (with O2 it clips the fp32 master gradients; with a GradScaler, unscaled ones).
* prepared data: ``paddle.io.DataLoader`` over the core's micro-batches, iterated inside the timed
  loop (:meth:`PaddleSession.batches`; knobs ``loader_workers``, ``loader_prefetch``). A family may
  derive host-side inputs from a batch's numpy arrays (``host_inputs``: e.g. LLaVA-1.6's tile and
  feature indices from ``image_sizes``), so the step never reads a tensor back to the host.
* LoRA: ``paddlenlp.peft`` adapters in the family's LoRA module (``lora_target``, e.g. the
  decoder), on exactly the linears peft adapts on the PyTorch side, scaling alpha / r
  (:mod:`xfw_paddle.model`).

Timestamps are CUDA events on GPU, ``perf_counter`` on CPU (Paddle executes CPU kernels
synchronously) and ``perf_counter`` after a device synchronize on the test device; losses leave the GPU through pinned memory so reading them never syncs.
The GPU paths are written to Paddle's documentation and have not run here (no Paddle GPU build
fits this environment)::

    python -m xfw_paddle --spec run/spec.json --records run/steps.jsonl
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from xfw.contract.env import package_versions
from xfw.contract import knobs as knob_declaration
from xfw.contract.harness import InvalidSpec, Unsupported, loader_settings, wants_grad_norm
from xfw_paddle import parallel, testdevice
from xfw_paddle.devices import (TESTCPU, TESTCPU_NOTE, backport_cpu_causal_softmax, device_kind, device_name, on_gpu,
                                watch_attention)
from xfw_paddle.model import start_model
from xfw_paddle.families import family_module

AMP_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# The knobs and their values: knobs.json beside this file, the one list xfw's core reads too (xfw validate).
_DECLARED = knob_declaration.adapter_declaration(__file__)
KNOBS = {k: v for k, v in _DECLARED.items() if v is not None}
FREE_KNOBS = {k for k, v in _DECLARED.items() if v is None}  # the loader knobs: checked by loader_settings
VERSIONED = ("paddlepaddle", "paddlenlp", "ppdiffusers", "numpy")
AMP_NOTES = {
    "O0": "fp32 throughout",
    "O1": "paddle.amp.auto_cast O1 over fp32 weights",
    "O2": "paddle.amp.decorate O2 (low-precision weights) + AdamW multi_precision (fp32 master weights) + "
          "MixPrecisionLayer/MixPrecisionOptimizer (fp32 main_grad) + auto_cast O2",
}


def library_versions() -> dict[str, str]:
    return package_versions(VERSIONED)


def describe() -> dict:
    gpu = on_gpu()
    # paddle.distributed.launch runs a script, not a module (`-m` falls into its legacy mode
    # and is taken for a file name), so the launcher names __main__.py by path.
    # xfw_paddle.launch is paddle.distributed.launch with the CPU test device's environment when asked.
    main_py = str(Path(__file__).with_name("__main__.py"))
    return {
        "backend": "paddle", "framework": "paddle", "framework_version": paddle.__version__,
        "framework_commit": getattr(paddle.version, "commit", None) or None,  # the build's own record (builds.md)
        "versions": library_versions(), "device": "gpu:0" if gpu else "cpu", "device_name": device_name(gpu),
        **({"cpu_test_device": testdevice.DEVICE_TYPE} if testdevice.available() else {}),
        "launcher": ["{python}", "-m", "xfw_paddle.launch", "--nnodes", "{nnodes}", "--rank", "{node_rank}",
                     "--master", "{master_addr}:{master_port}", "--nproc_per_node", "{nproc}",
                     "--log_dir", "{log_dir}", main_py],
    }


@dataclass(frozen=True)
class Precision:
    """What will run: AMP level, compute dtype, and a note when it differs from the request."""

    amp_level: str
    compute_dtype: str
    note: str


def plan_precision(dtype: str, amp_level: str, gpu: bool) -> Precision:
    """``gpu``: AMP runs here (a GPU, or the CPU test device)."""
    if amp_level == "O0" or gpu:
        return Precision(amp_level, AMP_DTYPES[dtype], "")
    return Precision("O0", "float32", f"requested {dtype} {amp_level}, ran fp32 O0: Paddle's CPU build ignores "
                                      f"AMP (auto_cast acts only on CUDA/XPU/custom devices) and lacks bf16 kernels")


def check_spec(spec: dict) -> None:
    """Everything this adapter rejects, before anything heavy is imported or built."""
    knobs = spec["backend_knobs"]
    for knob, value in knobs.items():
        if knob == "sharding_segment_size":  # group_sharded_parallel's segment_size (stage 3): a positive int
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidSpec(f"backends.paddle.sharding_segment_size: {value!r} is not a positive integer")
            continue
        if knob in FREE_KNOBS:
            continue
        if knob not in KNOBS:
            raise InvalidSpec(f"backends.paddle.{knob}: unknown knob (known: {', '.join(sorted({*KNOBS, *FREE_KNOBS}))})")
        if value not in KNOBS[knob]:
            raise InvalidSpec(f"backends.paddle.{knob}: {value!r} is not one of {', '.join(map(str, KNOBS[knob]))}")
    precision, sharding = spec["precision"], spec["parallel"]["sharding"]
    if knobs.get("stage2_overlap") and (sharding != "stage2" or spec["derived"]["num_processes"] == 1):
        raise InvalidSpec("backends.paddle.stage2_overlap: true needs sharding stage2 on more than one process "
                          "(Paddle's overlap belongs to group_sharded_parallel os_g)")
    pure = precision["amp_level"] == "O2" and not precision.get("master_weights", True)
    if pure and knobs.get("device") == "testcpu" and spec["derived"]["num_processes"] > 1:
        # Measured: stage 1 reduces low-precision gradients with the stream `reduce`, which fails on the test
        # device ("interface not found"); stage 2's clip (HybridParallelClipGrad) makes its bf16 factor only on a GPU or on npu /
        # iluvatar_gpu / metax_gpu custom devices (hybrid_parallel_optimizer.py), so on testcpu it crashes.
        if sharding == "stage1" or (sharding == "stage2" and spec["optimizer"].get("max_grad_norm")):
            raise Unsupported(f"precision.master_weights: false with sharding {sharding}"
                              + (" and gradient clipping" if sharding == "stage2" else "")
                              + " cannot run on the CPU test device (Paddle's own code for it runs only on a GPU; "
                              "docs/testdevice.md); DataParallel and stage 3 run here")


def device_batch(family, arch: dict, batch: dict, *, gpu: bool) -> dict:
    """A micro-batch as the family's loss takes it: its numpy arrays (or the CPU tensors Paddle's
    DataLoader made of them) on the device, with the family's host-side inputs
    (``host_inputs(arch, numpy batch)``, when it has one) computed from the numpy values first."""
    host = getattr(family, "host_inputs", None)
    if host is not None and not any(k in batch for k in getattr(family, "HOST_KEYS", ())):
        numpy = {k: v.numpy() if isinstance(v, paddle.Tensor) else v for k, v in batch.items()}
        batch = {**batch, **host(arch, numpy)}
    out = {}
    for key, value in batch.items():
        if isinstance(value, np.ndarray):
            value = paddle.to_tensor(value)
        elif isinstance(value, paddle.Tensor) and gpu:  # gpu: a device that is not the host (GPU, test device)
            value = value._copy_to(paddle.framework._current_expected_place(), True)
        out[key] = value
    return out


class PreparedDataset(paddle.io.Dataset):
    """The core's micro-batches (``xfw.contract.batches.MicroBatches``) as a Paddle data set; the
    family's host-side inputs are computed here, in the loader's worker, from numpy."""

    def __init__(self, micro_batches, family, arch: dict):
        super().__init__()
        self.micro_batches, self.family, self.arch = micro_batches, family, arch

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, k: int):
        batch, meta = self.micro_batches[k]
        host = getattr(self.family, "host_inputs", None)
        return ({**batch, **host(self.arch, batch)} if host else batch), meta


def _majority_dtype(params: list) -> str:
    counts: dict[str, int] = {}
    for p in params:
        name = str(p.dtype).removeprefix("paddle.")
        counts[name] = counts.get(name, 0) + int(p.size)
    return max(counts, key=counts.get)


class PaddleSession:
    GRAD_NORM_ACROSS_RANKS = True  # parallel.NormRecorder sums each rank's share

    def __init__(self, spec: dict):
        check_spec(spec)
        family = family_module(spec["model"]["family"])
        self.spec = spec
        self.rank, self.num_ranks, local_rank = parallel.world()
        self.device = device_kind(spec)
        self.gpu = self.device == "gpu"
        self.on_device = self.device != "cpu"  # tensors leave the host: a GPU or the test device
        if self.device != "testcpu":  # testdevice.activate selected it
            paddle.set_device(f"gpu:{local_rank}" if self.gpu else "cpu")
        self.attn = spec["backend_knobs"].get("attn_implementation", "sdpa")
        requested = spec["precision"]
        self.precision = plan_precision(requested["dtype"], requested["amp_level"], self.on_device)
        self.kernels = watch_attention()
        self.backport = backport_cpu_causal_softmax()  # older builds on a CPU (docs/builds.md)

        model = start_model(spec, use_sdpa=self.attn == "sdpa")
        model.train()
        trainable = [p for p in model.parameters() if not p.stop_gradient]
        self.trainable = trainable
        self.record_grad_norm = wants_grad_norm(spec, across_ranks=True)
        self.num_params_total = sum(int(p.size) for p in model.parameters())
        self.num_params_trainable = sum(int(p.size) for p in trainable)

        o = spec["optimizer"]
        level, dtype = self.precision.amp_level, self.precision.compute_dtype
        # precision.master_weights: false (O2): no fp32 copies, the optimizer updates the low-precision weights.
        self.master_weights = level == "O2" and spec["precision"].get("master_weights", True)
        self.max_grad_norm = o.get("max_grad_norm") or 0.0
        clip = paddle.nn.ClipGradByGlobalNorm(self.max_grad_norm) if self.max_grad_norm else None
        adamw = paddle.optimizer.AdamW(learning_rate=o["lr"], beta1=o["betas"][0], beta2=o["betas"][1],
                                       epsilon=o["eps"], weight_decay=o["weight_decay"], parameters=trainable,
                                       grad_clip=clip, multi_precision=self.master_weights)
        self.family, self.loader = family, loader_settings(spec)
        if level == "O2":  # as PaddleNLP's Trainer: the model decorated, the optimizer multi_precision
            model = paddle.amp.decorate(models=model, level="O2", dtype=dtype)
        scaler = paddle.amp.GradScaler(init_loss_scaling=2.0 ** 16) if dtype == "float16" else None
        # Master gradients when O2 was asked for, even where AMP cannot run (fp32 main_grad all the same).
        master = AMP_DTYPES[requested["dtype"]] if requested["amp_level"] == "O2" and requested["dtype"] != "fp32" \
            and requested.get("master_weights", True) else None
        self.model = model
        self.find_unused = spec["backend_knobs"].get("find_unused_parameters", getattr(family, "DDP_FIND_UNUSED", False))
        self.wrapped = parallel.apply_parallel(
            parallel.LossLayer(model, family.loss_fn, self._autocast), adamw, spec=spec,
            sharding_device=self.on_device, find_unused=self.find_unused, master_dtype=master, scaler=scaler,
            segment_size=spec["backend_knobs"].get("sharding_segment_size"),
            stage2_overlap=spec["backend_knobs"].get("stage2_overlap", False))
        self.layer, self.optimizer, self.scaler = self.wrapped.layer, self.wrapped.optimizer, self.wrapped.scaler
        self.impl = self.wrapped.impl
        self._norm = parallel.record_grad_norm(adamw, self.wrapped) if self.record_grad_norm else None
        self.grads_held = None
        self.reset_memory_peaks()  # like the PyTorch adapter: peaks count from here, model built

    # -- the step ---------------------------------------------------------------------------
    def to_device(self, batch: dict) -> dict:
        return device_batch(self.family, self.spec["model"]["arch"], batch, gpu=self.gpu)

    def batches(self, dataset):
        """The core's micro-batches of prepared data through Paddle's DataLoader (each item a whole
        micro-batch; tensors stay on the host until moved here), on the device as they come."""
        workers, prefetch = self.loader
        loader = paddle.io.DataLoader(PreparedDataset(dataset, self.family, self.spec["model"]["arch"]),
                                      batch_size=None, shuffle=False, num_workers=workers, prefetch_factor=prefetch,
                                      use_buffer_reader=False, return_list=True)
        for batch, meta in loader:
            yield self.to_device(batch), meta.numpy()

    def _autocast(self):
        if self.precision.amp_level == "O0":
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(level=self.precision.amp_level, dtype=self.precision.compute_dtype)

    def train_step(self, micro_batches: list) -> paddle.Tensor:
        loss = self.forward_backward(micro_batches)
        self.optimizer_step()
        return loss

    def forward_backward(self, micro_batches: list) -> paddle.Tensor:
        """The step's first part (the harness's breakdown): every micro-batch's forward and backward."""
        total = paddle.zeros([], dtype="float32")
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            with parallel.gradient_sync(self.wrapped, enabled=i == last):
                loss = self.layer(**batch) / len(micro_batches)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        parallel.after_backward(self.wrapped)
        return total

    def optimizer_step(self) -> None:
        """The step's second part: clipping (the optimizer's grad_clip), the update, clearing the gradients."""
        if self._norm is not None:
            self._norm.norm = None
        if self.grads_held is None:  # once (a warm-up step): what holds the gradients the optimizer applies
            self.grads_held = parallel.grads_held(self.trainable)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        parallel.clear_grad(self.wrapped)

    def grad_norm(self) -> float:
        """The norm the optimizer's clip saw (:class:`xfw_paddle.parallel.NormRecorder`): the gradients
        as applied, after every reduction; NaN when the step was skipped (a GradScaler found inf)."""
        norm = self._norm.norm
        return float(norm.numpy()) if norm is not None else float("nan")  # SYNC: only when asked (parity)

    def eval_loss(self, batch: dict) -> float:
        """One held-out micro-batch's loss (``measure.eval_every``, xfw converge): the training forward
        (the same wrapper, precision and autocast) without gradients, the model in eval mode."""
        self.layer.eval()
        try:
            with paddle.no_grad():
                loss = self.layer(**batch)
            return float(loss.detach().astype("float32").numpy())  # SYNC: an evaluation, between steps
        finally:
            self.layer.train()

    # -- timing and memory ------------------------------------------------------------------
    def loss_token(self, loss: paddle.Tensor):
        if not self.gpu:
            return loss
        # Untested on GPU: async device-to-host copy into pinned memory; it is complete once
        # the timestamp recorded after it is done (the harness reads it only then).
        return loss._copy_to(paddle.CUDAPinnedPlace(), False)

    def loss_value(self, token: paddle.Tensor) -> float:
        return float(token.numpy())

    def timestamp(self):
        if self.device == "testcpu":  # the device's queue drained first: a clock after a synchronize
            paddle.device.synchronize()
        if not self.gpu:
            return time.perf_counter()
        event = paddle.device.cuda.Event(enable_timing=True)
        event.record()
        return event

    def is_done(self, stamp) -> bool:
        return stamp.query() if self.gpu else True

    def elapsed_s(self, start, end) -> float:
        if not self.gpu:
            return end - start
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        if self.on_device:
            paddle.device.synchronize()

    def reset_memory_peaks(self) -> None:
        if self.device == "testcpu":  # Paddle's allocator statistics for the device (host memory)
            paddle.device.reset_max_memory_allocated(paddle.device.get_device())
            paddle.device.reset_max_memory_reserved(paddle.device.get_device())
        elif self.gpu:
            paddle.device.cuda.reset_max_memory_allocated()
            paddle.device.cuda.reset_max_memory_reserved()
        else:
            for stat in ("Allocated", "Reserved"):
                paddle.base.core.host_memory_stat_reset_peak_value(stat, 0)

    def memory_peaks(self) -> tuple[int | None, int | None]:
        if self.device == "testcpu":
            where = paddle.device.get_device()
            return int(paddle.device.max_memory_allocated(where)), int(paddle.device.max_memory_reserved(where))
        if self.gpu:
            return int(paddle.device.cuda.max_memory_allocated()), int(paddle.device.cuda.max_memory_reserved())
        # Paddle's host allocator statistics (device id 0 = the CPU place).
        stat = paddle.base.core.host_memory_stat_peak_value
        return int(stat("Allocated", 0)), int(stat("Reserved", 0))

    def is_oom(self, error: BaseException) -> bool:
        # Paddle raises ResourceExhaustedError, translated to Python's MemoryError.
        text = f"{type(error).__name__}: {error}".lower()
        return isinstance(error, MemoryError) or "resourceexhausted" in text or "out of memory" in text

    def applied(self) -> dict:
        level = self.precision.amp_level
        notes = AMP_NOTES[level]
        if level == "O2" and not self.master_weights:
            notes = "paddle.amp.decorate O2 (low-precision weights), no master weights: AdamW updates them in place"
        if self.scaler:
            notes += "; GradScaler"
        if self.precision.note:  # a fallback: say what was asked and why it did not run
            notes = self.precision.note
            if self.wrapped.master_grads:
                notes += "; master gradients held as asked: fp32 main_grad (MixPrecisionLayer/MixPrecisionOptimizer)"
        if self.wrapped.find_unused is not None:
            notes += f"; {self.wrapped.detail}"
        if self.device == "testcpu":
            notes += f"; {TESTCPU_NOTE}"
        if self.backport:
            notes += f"; {self.backport}"
        if self.record_grad_norm:
            notes += "; gradient norm read every step (a host sync: parity, not a measurement)"
        if self.max_grad_norm:
            notes += f"; gradients clipped to global norm {self.max_grad_norm:g}"
        # TF32 for fp32 GEMMs: on by default in Paddle's CUDA builds (phi/backends/context_pool.cc,
        # allow_tf32_cublas = true), off by default in torch.
        tf32 = self.gpu and bool(paddle.base.core.get_cublas_switch())
        versions = {f"version_{k}": v for k, v in library_versions().items()}
        return dict(
            framework="paddle", framework_version=paddle.__version__,
            device={"gpu": "gpu:0", "cpu": "cpu", "testcpu": TESTCPU}[self.device],
            device_name=device_name(self.gpu), weight_dtype=_majority_dtype(self.model.parameters()),
            compute_dtype=self.precision.compute_dtype, amp_level=level, master_weights=self.master_weights,
            sharding_impl=self.impl, attention_impl=self.attn, tf32=tf32, fused_optimizer=False,
            recompute=bool(getattr(self.model, "recompute_enabled", self.spec["recompute"])),
            num_params_total=self.num_params_total, num_params_trainable=self.num_params_trainable,
            num_processes=self.num_ranks, grad_accum_steps=self.spec["derived"]["grad_accum_steps"],
            mem_source="cuda_allocator" if self.gpu else "host_allocator", notes=notes,
            mechanisms=self.mechanisms(tf32), **versions,
        )

    def mechanisms(self, tf32: bool) -> dict:
        """How each setting was carried out, under the neutral keys both adapters report."""
        w, level = self.wrapped, self.precision.amp_level
        reduce_dtype = ("float32" if w.master_grads or level != "O2" else self.precision.compute_dtype)
        return {
            "master_grads": ("fp32 main_grad (MixPrecisionLayer)" if w.master_grads else "none")
            + f"; held: {self.grads_held or 'not seen'}",  # what the optimizer was given, seen at the first step
            "master_weights": "fp32 (AdamW multi_precision)" if self.master_weights else
            f"none: the optimizer updates the {self.precision.compute_dtype} weights (precision.master_weights: false)"
            if self.precision.amp_level == "O2" else "none (fp32 weights)",
            "attention_impl": self.attn,
            "grad_reduce_dtype": reduce_dtype if self.num_ranks > 1 else "n/a (one process)",
            "sharding_impl": w.neutral, "sharding_detail": w.detail,
            "attention_kernel": ", ".join(sorted(self.kernels)) or "matmul",
            "optimizer_impl": "AdamW per-parameter" + (" multi_precision" if self.master_weights else ""),
            "tf32": tf32 if self.gpu else "n/a", "device": self.device,
            # cuDNN's TF32 for convolutions (get_cudnn_switch), apart from the GEMMs' cuBLAS switch above
            "tf32_conv": bool(paddle.base.core.get_cudnn_switch()) if self.gpu else "n/a",
            "comm_overlap": parallel.comm_overlap(w, self.num_ranks),
            # what the families pass: use_reentrant=False (llava's recompute_use_reentrant, qwen2vl's and sd3's
            # recompute calls); sd15's is ppdiffusers' own choice, which its model reports
            "checkpointing": ("recompute full per block (fleet.utils.recompute, use_reentrant="
                              f"{bool(getattr(self.model, 'recompute_use_reentrant', False))})"
                              if getattr(self.model, "recompute_enabled", self.spec["recompute"]) else "none"),
        }


def build_session(spec: dict) -> PaddleSession:
    return PaddleSession(spec)
