"""The Paddle side of the harness protocol: build, apply settings, step, time, report.

Neutral settings map to Paddle's native mechanisms:

* O1: ``paddle.amp.auto_cast(level='O1')`` over fp32 weights.
* O2: ``paddle.amp.decorate(level='O2', master_weight=True, master_grad=True)`` +
  ``auto_cast(level='O2')``. fp16 adds a ``GradScaler``. Paddle's CPU build ignores AMP and
  has no bf16 kernels, so on CPU every run is fp32 and ``applied`` says so, with the request
  in ``notes``.
* recompute: ``fleet.utils.recompute`` per decoder block (paddlenlp's for LLaVA's Llama, the
  family's own for Qwen2-VL).
* what trains: the stage's parts (or the recipe's ``model.trainable``), selected per parameter by
  its canonical name (:func:`select_trainable`, the family's facts in ``xfw.contract.families``).
* ``optimizer.max_grad_norm``: ``paddle.nn.ClipGradByGlobalNorm`` as the optimizer's ``grad_clip``
  (with O2 it clips the fp32 master gradients; with a GradScaler, unscaled ones).
* prepared data: ``paddle.io.DataLoader`` over the core's micro-batches, iterated inside the timed
  loop (:meth:`PaddleSession.batches`; knobs ``loader_workers``, ``loader_prefetch``). A family may
  derive host-side inputs from a batch's numpy arrays (``host_inputs``: e.g. LLaVA-1.6's tile and
  feature indices from ``image_sizes``), so the step never reads a tensor back to the host.
* LoRA: ``paddlenlp.peft`` adapters in the family's LoRA module (:func:`lora_target`, e.g. the
  decoder), on exactly the linears peft adapts on the PyTorch side, scaling alpha / r
  (:func:`lora_config_for`).

Timestamps are CUDA events on GPU and ``perf_counter`` on CPU (Paddle executes CPU kernels
synchronously); losses leave the GPU through pinned memory so reading them never syncs.
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

from xfw.contract import families, hf_names
from xfw.contract import weights as neutral
from xfw.contract.env import cpu_model, package_versions
from xfw.contract.harness import GRAD_NORM_KNOB, LOADER_KNOBS, InvalidSpec, Unsupported, loader_settings, wants_grad_norm
from xfw_paddle import parallel
from xfw_paddle.families import family_module

AMP_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
KNOBS = {"attn_implementation": ("sdpa", "eager"), GRAD_NORM_KNOB: (True, False)}
FREE_KNOBS = set(LOADER_KNOBS)  # checked by loader_settings
VERSIONED = ("paddlepaddle", "paddlenlp", "ppdiffusers", "numpy")
AMP_NOTES = {
    "O0": "fp32 throughout",
    "O1": "paddle.amp.auto_cast O1 over fp32 weights",
    "O2": "paddle.amp.decorate O2 (low-precision weights, fp32 master weights and grads) + auto_cast O2",
}


def library_versions() -> dict[str, str]:
    return package_versions(VERSIONED)


def _on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def _device_name(gpu: bool) -> str:
    return paddle.device.cuda.get_device_name(0) if gpu else cpu_model()


def describe() -> dict:
    gpu = _on_gpu()
    # paddle.distributed.launch runs a script, not a module (`-m` falls into its legacy mode
    # and is taken for a file name), so the launcher names __main__.py by path.
    main_py = str(Path(__file__).with_name("__main__.py"))
    return {
        "backend": "paddle", "framework": "paddle", "framework_version": paddle.__version__,
        "versions": library_versions(), "device": "gpu:0" if gpu else "cpu", "device_name": _device_name(gpu),
        "launcher": ["{python}", "-m", "paddle.distributed.launch", "--nnodes", "{nnodes}", "--rank", "{node_rank}",
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
    if amp_level == "O0" or gpu:
        return Precision(amp_level, AMP_DTYPES[dtype], "")
    return Precision("O0", "float32", f"requested {dtype} {amp_level}, ran fp32 O0: Paddle's CPU build ignores "
                                      f"AMP (auto_cast acts only on CUDA/XPU/custom devices) and lacks bf16 kernels")


def check_spec(spec: dict) -> None:
    """Everything this adapter rejects, before anything heavy is imported or built."""
    knobs = spec["backend_knobs"]
    for knob, value in knobs.items():
        if knob in FREE_KNOBS:
            continue
        if knob not in KNOBS:
            raise InvalidSpec(f"backends.paddle.{knob}: unknown knob (known: {', '.join(sorted({*KNOBS, *FREE_KNOBS}))})")
        if value not in KNOBS[knob]:
            raise InvalidSpec(f"backends.paddle.{knob}: {value!r} is not one of {', '.join(KNOBS[knob])}")


def lora_config_for(target: paddle.nn.Layer, lora: dict):
    r"""paddlenlp's ``LoRAConfig`` for the neutral LoRA settings, adapters on exactly the linears
    peft adapts on the PyTorch side.

    peft takes a target name as a module-name suffix (``q_proj`` matches ``layers.0.self_attn.q_proj``);
    paddlenlp takes a regular expression over the full name (``re.fullmatch``), so each name
    becomes ``(.*\.)?q_proj``. Scaling is alpha / r in both (no rsLoRA). A name matching no
    Linear under ``target`` is an error here for every name (peft raises only when none matches).
    """
    import re

    from paddlenlp.peft import LoRAConfig

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
    from paddlenlp.peft import LoRAModel

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
        elif isinstance(value, paddle.Tensor) and gpu:
            value = value.cuda()
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
    def __init__(self, spec: dict):
        check_spec(spec)
        family = family_module(spec["model"]["family"])
        self.spec = spec
        self.rank, self.num_ranks, local_rank = parallel.world()
        self.gpu = _on_gpu()
        paddle.set_device(f"gpu:{local_rank}" if self.gpu else "cpu")
        self.attn = spec["backend_knobs"].get("attn_implementation", "sdpa")
        self.precision = plan_precision(spec["precision"]["dtype"], spec["precision"]["amp_level"], self.gpu)

        model = start_model(spec, use_sdpa=self.attn == "sdpa")
        model.train()
        trainable = [p for p in model.parameters() if not p.stop_gradient]
        self.trainable = trainable
        self.record_grad_norm = wants_grad_norm(spec)
        self._grad_norm = None
        self.num_params_total = sum(int(p.size) for p in model.parameters())
        self.num_params_trainable = sum(int(p.size) for p in trainable)

        o = spec["optimizer"]
        self.max_grad_norm = o.get("max_grad_norm") or 0.0
        clip = paddle.nn.ClipGradByGlobalNorm(self.max_grad_norm) if self.max_grad_norm else None
        optimizer = paddle.optimizer.AdamW(learning_rate=o["lr"], beta1=o["betas"][0], beta2=o["betas"][1],
                                           epsilon=o["eps"], weight_decay=o["weight_decay"], parameters=trainable,
                                           grad_clip=clip)
        self.family, self.loader = family, loader_settings(spec)
        level, dtype = self.precision.amp_level, self.precision.compute_dtype
        self.master_weights = level == "O2"
        if level == "O2":
            # GPU only (plan_precision). Untested here: written to paddle.amp.decorate's docs.
            model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=dtype,
                                                   master_weight=True, master_grad=True)
        self.scaler = paddle.amp.GradScaler(init_loss_scaling=2.0 ** 16) if dtype == "float16" else None
        self.model = model
        self.layer, self.optimizer, self.impl = parallel.apply_parallel(
            parallel.LossLayer(model, family.loss_fn, self._autocast), optimizer, spec=spec, gpu=self.gpu,
            find_unused=getattr(family, "DDP_FIND_UNUSED", False))
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
        total = paddle.zeros([], dtype="float32")
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            with parallel.gradient_sync(self.layer, self.impl, enabled=i == last):
                loss = self.layer(**batch) / len(micro_batches)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        if self.record_grad_norm:
            self._grad_norm = self._global_grad_norm()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.clear_grad(set_to_zero=False)
        return total

    def _global_grad_norm(self) -> paddle.Tensor:
        """L2 over every trainable gradient, in float64, on the device (no sync here)."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # the step below then skips its own unscale
        squares = [p.grad.detach().astype("float64").square().sum() for p in self.trainable if p.grad is not None]
        return paddle.add_n(squares).sqrt() if squares else paddle.zeros([], dtype="float64")

    def grad_norm(self) -> float:
        return float(self._grad_norm.numpy())  # SYNC: only when the spec asks for it (parity)

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
        if self.gpu:
            paddle.device.cuda.synchronize()

    def reset_memory_peaks(self) -> None:
        if self.gpu:
            paddle.device.cuda.reset_max_memory_allocated()
            paddle.device.cuda.reset_max_memory_reserved()
        else:
            for stat in ("Allocated", "Reserved"):
                paddle.base.core.host_memory_stat_reset_peak_value(stat, 0)

    def memory_peaks(self) -> tuple[int | None, int | None]:
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
        if self.scaler:
            notes += "; GradScaler"
        if self.precision.note:  # a fallback: say what was asked and why it did not run
            notes = self.precision.note
        if self.record_grad_norm:
            notes += "; gradient norm read every step (a host sync: parity, not a measurement)"
        if self.max_grad_norm:
            notes += f"; gradients clipped to global norm {self.max_grad_norm:g}"
        # TF32 for fp32 GEMMs: on by default in Paddle's CUDA builds (phi/backends/context_pool.cc,
        # allow_tf32_cublas = true), off by default in torch.
        tf32 = self.gpu and bool(paddle.base.core.get_cublas_switch())
        versions = {f"version_{k}": v for k, v in library_versions().items()}
        return dict(
            framework="paddle", framework_version=paddle.__version__, device="gpu:0" if self.gpu else "cpu",
            device_name=_device_name(self.gpu), weight_dtype=_majority_dtype(self.model.parameters()),
            compute_dtype=self.precision.compute_dtype, amp_level=level, master_weights=self.master_weights,
            sharding_impl=self.impl, attention_impl=self.attn, tf32=tf32, fused_optimizer=False,
            recompute=bool(getattr(self.model, "recompute_enabled", self.spec["recompute"])),
            num_params_total=self.num_params_total, num_params_trainable=self.num_params_trainable,
            num_processes=self.num_ranks, grad_accum_steps=self.spec["derived"]["grad_accum_steps"],
            mem_source="cuda_allocator" if self.gpu else "host_allocator", notes=notes, **versions,
        )


def build_session(spec: dict) -> PaddleSession:
    return PaddleSession(spec)
