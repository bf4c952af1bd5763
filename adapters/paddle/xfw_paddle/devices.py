"""Where the Paddle side runs: a GPU, the CPU, or xfw's CPU test device (``backends.paddle.device:
testcpu``, :mod:`xfw_paddle.testdevice`), and which attention kernels Paddle dispatched there."""

from __future__ import annotations

import paddle

from xfw.contract.env import cpu_model
from xfw.contract.harness import Unsupported
from xfw_paddle import parallel

TESTCPU = "testcpu (CPU test device: timings are not GPU-like)"
TESTCPU_NOTE = ("ran on xfw's CPU test device (a Paddle custom device backed by host memory): it proves the "
                "GPU-only code paths, its timings and memory are a CPU's and must never be read as GPU figures")


def on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def device_name(gpu: bool) -> str:
    return paddle.device.cuda.get_device_name(0) if gpu else cpu_model()


def device_kind(spec: dict) -> str:
    """``gpu``, ``cpu`` or ``testcpu`` (``backends.paddle.device``; the test device is activated in
    this process before Paddle starts: :mod:`xfw_paddle.__main__`)."""
    if spec["backend_knobs"].get("device", "auto") == "testcpu":
        from xfw_paddle import testdevice

        try:
            testdevice.activate(parallel.world()[2] if parallel.world()[1] > 1 else 0)
        except (RuntimeError, FileNotFoundError) as err:
            raise Unsupported(f"backends.paddle.device=testcpu: {err}") from None
        return "testcpu"
    return "gpu" if on_gpu() else "cpu"


def watch_attention() -> set:
    """The kernels Paddle's ``F.scaled_dot_product_attention`` dispatches to in this process (its own
    selector's answers, recorded as it gives them: ``flash_attn``, ``mem_efficient``, ``math``)."""
    try:  # Paddle 3.1 on: a module of its own; 3.0: a private function beside the attention itself
        from paddle.nn.functional import sdpa as module
        attribute = "select_sdp_for_sdpa"
    except ImportError:
        from paddle.nn.functional import flash_attention as module
        attribute = "_select_sdp_for_sdpa"

    seen, select = set(), getattr(module, attribute)
    if getattr(select, "xfw_seen", None) is not None:
        return select.xfw_seen

    def recording(*args, **kwargs):
        name = select(*args, **kwargs)
        seen.add({"math": "sdpa_math"}.get(name, name))
        return name

    recording.xfw_seen = seen
    setattr(module, attribute, recording)
    return seen


def backport_cpu_causal_softmax() -> str:
    """Before Paddle 3.3, causal attention's math path (``flash_attention._math_attention``, which
    ``scaled_dot_product_attention`` takes on a CPU) calls ``softmax_mask_fuse_upper_triangle``, a
    GPU-only kernel: every causal model crashes on a CPU ("Softmax mask fuse op only supports GPU now").
    Paddle 3.3 takes the plain path there (an upper-triangle mask added, then softmax); on a CPU with an
    older Paddle this does the same, so older builds run (xfw bisect, docs/builds.md). Returns the note
    the applied record carries, "" when nothing was changed (3.3 and later, or a GPU)."""
    import paddle.incubate
    import paddle.nn.functional as F

    major, minor = (int(x) for x in paddle.__version__.split(".")[:2])
    if (major, minor) >= (3, 3) or on_gpu() or getattr(paddle.incubate.softmax_mask_fuse_upper_triangle,
                                                       "xfw_backport", False):
        return ""
    fused = paddle.incubate.softmax_mask_fuse_upper_triangle

    def plain_on_cpu(x):
        if "cpu" not in paddle.get_device():
            return fused(x)
        n = x.shape[-1]
        upper = paddle.triu(paddle.full([n, n], float("-inf"), dtype=x.dtype), diagonal=1)
        return F.softmax(x + upper)

    plain_on_cpu.xfw_backport = True
    paddle.incubate.softmax_mask_fuse_upper_triangle = plain_on_cpu
    return (f"Paddle {paddle.__version__} on a CPU: causal attention's GPU-only fused softmax replaced by the "
            "plain masked softmax Paddle 3.3 runs there (xfw_paddle.devices.backport_cpu_causal_softmax)")
