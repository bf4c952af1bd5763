"""Variables that can change the program a backend runs or what xfw measures of it.

A recipe (or a published file) may set any variable for a backend's processes
(``backends.<name>.env``), and every one is listed in the settings table. Those below can change
the result itself, so every report also names them in its warnings and beside the headline::

    effect("PYTHONPATH")       # -> "the interpreter's search path and start-up hooks (sitecustomize)"
    effect("OMP_NUM_THREADS")  # -> "host thread count"
    effect("NCCL_ALGO")        # -> None: listed as a setting only

A thread variable that contradicts ``measure.cpu_threads`` is refused when the recipe loads
(``xfw.recipe``): xfw sets those variables from ``measure.cpu_threads`` itself.
"""

from __future__ import annotations

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")
"""Host thread counts the frameworks' math libraries honour (``measure.cpu_threads`` sets the first two)."""

_EXACT = {
    **{name: "host thread count" for name in THREAD_VARIABLES},
    "PYTHONPATH": "the interpreter's search path and start-up hooks (sitecustomize)",
    "PYTHONHOME": "which Python runs", "PYTHONSTARTUP": "a start-up hook", "PYTHONUSERBASE": "user site packages",
    "PYTHONNOUSERSITE": "user site packages", "PYTHONSAFEPATH": "the interpreter's search path",
    "PYTHONEXECUTABLE": "which Python runs", "PYTHONPLATLIBDIR": "the interpreter's search path",
    "PYTHONINSPECT": "the interpreter's behaviour", "PYTHONOPTIMIZE": "the interpreter's behaviour",
    "PYTHONMALLOC": "the allocator", "PYTHONDEVMODE": "the interpreter's checks (slower)",
    "PYTHONWARNINGS": "the interpreter's behaviour", "PYTHONHASHSEED": "the interpreter's behaviour",
    "PATH": "which programs run", "LD_PRELOAD": "preloaded libraries", "LD_LIBRARY_PATH": "which libraries load",
    "LD_AUDIT": "preloaded libraries", "LD_BIND_NOW": "library loading", "GLIBC_TUNABLES": "the allocator",
    "PYTORCH_CUDA_ALLOC_CONF": "the allocator", "PYTORCH_HIP_ALLOC_CONF": "the allocator",
    "PYTORCH_NO_CUDA_MEMORY_CACHING": "the allocator", "CUDA_VISIBLE_DEVICES": "which devices run",
    "CUDA_LAUNCH_BLOCKING": "synchronous kernels (slower)", "NVIDIA_TF32_OVERRIDE": "TF32 matmuls",
    "TORCH_COMPILE_DISABLE": "compilation", "TORCHDYNAMO_DISABLE": "compilation",
    "FLAGS_allocator_strategy": "the allocator", "FLAGS_fraction_of_gpu_memory_to_use": "the allocator",
    "FLAGS_use_cuda_managed_memory": "the allocator", "FLAGS_eager_delete_tensor_gb": "the allocator",
    "FLAGS_cudnn_deterministic": "deterministic kernels", "FLAGS_embedding_deterministic": "deterministic kernels",
    "CUBLAS_WORKSPACE_CONFIG": "deterministic kernels", "KMP_AFFINITY": "thread placement",
    "GOMP_CPU_AFFINITY": "thread placement", "OMP_PROC_BIND": "thread placement",
}
_PREFIXES = (("MALLOC_", "the allocator"), ("LD_", "which libraries load"), ("PYTHON", "the interpreter's behaviour"),
             ("JEMALLOC", "the allocator"), ("TCMALLOC", "the allocator"), ("KMP_", "thread placement"),
             ("XLA_", "the compiler"))


def effect(name: str) -> str | None:
    """What setting ``name`` can change in a run's program or measurement, or None."""
    if name in _EXACT:
        return _EXACT[name]
    return next((what for prefix, what in _PREFIXES if name.startswith(prefix)), None)


def named(env: dict) -> dict[str, str]:
    """``NAME=value -> effect`` of each variable in ``env`` that can change the result, in name order."""
    return {f"{k}={''.join(c if c.isprintable() else ' ' for c in str(v)[:80])}": effect(k) for k, v in sorted(env.items()) if isinstance(k, str) and effect(k)}


def thread_conflict(env: dict, cpu_threads: int | None) -> str | None:
    """The first thread variable in ``env`` that says otherwise than ``measure.cpu_threads``, else None."""
    if cpu_threads is None:
        return None
    return next((k for k in THREAD_VARIABLES if k in env and str(env[k]).strip() != str(cpu_threads)), None)
