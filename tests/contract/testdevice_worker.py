"""What tests/contract/test_testdevice.py runs inside Paddle on the ``testcpu`` device (the Paddle
environment has no pytest). Each mode writes ``<out>/<mode>.<rank>.json``; the test compares.

    python testdevice_worker.py OUT collectives          (under paddle.distributed.launch, 2 ranks)
    python testdevice_worker.py OUT collectives_big      (2 or 3 ranks; testdevice_cases.py)
    python testdevice_worker.py OUT views                (one process)
    python testdevice_worker.py OUT bf16                 (one process)
    python testdevice_worker.py OUT against_cpu          (one process)
    python testdevice_worker.py OUT bf16_reference       (one process; also writes bf16_reference.npz)
    python testdevice_worker.py OUT kernel_cases         (one process; testdevice_cases.py, kernel_cases.npz)
    python testdevice_worker.py OUT mlp LEVEL            (LEVEL none: one process; os_g / p_g_os: 2 ranks)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from xfw_paddle import testdevice

paddle = testdevice.activate()
import paddle.distributed as dist  # noqa: E402  (after activate: the device must be loaded first)
import testdevice_cases  # noqa: E402  (issue 43's kernel cases and large collectives)

DTYPES = ("float32", "bfloat16", "float16", "int32", "int64")


def values(rank: int, dtype: str):
    """Small integers (exact in every dtype) that differ per rank."""
    return paddle.to_tensor(np.arange(8) * (rank + 1) + 3 * rank).astype(dtype)


def as_list(t) -> list:
    return t.astype("float32").numpy().tolist()


def collectives() -> dict:
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {"rank": rank, "world": dist.get_world_size(), "device": paddle.get_device()}
    for dtype in DTYPES:
        x = values(rank, dtype)
        got = {}
        for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN),
                         ("prod", dist.ReduceOp.PROD)):
            y = x.clone()
            dist.all_reduce(y, op=op)
            got[f"all_reduce_{name}"] = as_list(y)
        y = x.clone()
        dist.reduce(y, dst=0)
        got["reduce_to_0"] = as_list(y)
        y = x.clone()
        dist.broadcast(y, src=1)
        got["broadcast_from_1"] = as_list(y)
        gathered = []
        dist.all_gather(gathered, x)
        got["all_gather"] = [as_list(t) for t in gathered]
        y = paddle.zeros([4], dtype=dtype)
        dist.reduce_scatter(y, [x[:4], x[4:]])
        got["reduce_scatter"] = as_list(y)
        out[dtype] = got
    big = paddle.full([9_000_000], float(rank + 1), dtype="float32")  # 36 MB: more than one shared slot
    dist.all_reduce(big)
    out["big_all_reduce"] = [float(big[0]), float(big[-1]), float(big.sum())]
    dist.barrier()
    return out


def views() -> dict:
    """In-place ops on a view (a slice sharing a larger buffer) must change the buffer."""
    # XFW_TESTCPU_FILL=nan (set by the test): memory fresh from the device reads as NaN until written
    # (64 MB: more than Paddle's allocator holds yet, so it comes from the device).
    fresh = paddle.empty([1 << 24], dtype="float32")
    out = {"fresh_memory": [float(paddle.isnan(fresh).astype("float32").mean())]}
    del fresh

    def check(name, dtype, fn):
        buf = paddle.zeros([12], dtype=dtype)
        view = buf._slice(4, 8)
        fn(view)
        whole = as_list(buf)
        out[name] = {"view": as_list(view), "buffer": whole}

    check("scale_", "float32", lambda v: (v.fill_(1.0), v.scale_(3.0)))
    check("fill_", "bfloat16", lambda v: v.fill_(2.0))
    check("zero_", "float32", lambda v: (v.fill_(5.0), v.zero_()))
    check("add_", "float32", lambda v: v.add_(paddle.ones([4])))
    check("subtract_", "float32", lambda v: v.subtract_(paddle.ones([4])))
    check("multiply_", "float32", lambda v: (v.fill_(2.0), v.multiply_(paddle.full([4], 3.0))))
    check("divide_", "float32", lambda v: (v.fill_(6.0), v.divide_(paddle.full([4], 2.0))))
    check("assign", "float32", lambda v: paddle.assign(paddle.full([4], 7.0), output=v))
    check("copy_", "bfloat16", lambda v: v.copy_(paddle.full([4], 9.0, dtype="bfloat16"), False))
    # The negative control: int16 scale has no native kernel (Paddle's CPU one runs on a copy), so the
    # buffer must NOT change; if it did, this check could not tell a fallback from a native kernel.
    check("control_int16_scale_", "int16", lambda v: (v.scale_(3.0, bias=1.0)))

    # adamw_ on a parameter whose storage is a view of a flat buffer, as stage 2/3 arrange it.
    buf = paddle.zeros([12], dtype="float32")
    param = paddle.create_parameter([4], "float32", default_initializer=paddle.nn.initializer.Constant(1.0))
    buf._slice(4, 8)._share_buffer_to(param)
    param.set_value(paddle.ones([4]))
    opt = paddle.optimizer.AdamW(learning_rate=0.1, parameters=[param], weight_decay=0.0)
    (param * paddle.to_tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    opt.step()
    out["adamw_"] = {"view": as_list(param), "buffer": as_list(buf)}
    return out


def bf16() -> dict:
    rng = np.random.RandomState(0)
    x, y = rng.randn(5, 7, 16).astype("float32"), rng.randn(16, 9).astype("float32")
    xb, yb = paddle.to_tensor(x).astype("bfloat16"), paddle.to_tensor(y).astype("bfloat16")
    got = paddle.matmul(xb, yb)
    halves = paddle.to_tensor(np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype="float32")).astype("bfloat16")
    return {"x_bf16": xb.astype("float32").numpy().tolist(), "y_bf16": yb.astype("float32").numpy().tolist(),
            "matmul": got.astype("float32").numpy().tolist(), "dtype": str(got.dtype),
            "ties": halves.astype("float32").numpy().tolist()}


def bf16_values(x: np.ndarray) -> np.ndarray:
    """fp32 rounded to bf16 (nearest even) in numpy, as fp32: the same inputs on the device and on the CPU."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)


def bf16_ops() -> dict:
    """Each bf16 kernel the tiny models need, forward and backward, against the same op in fp32 on the
    same bf16-valued inputs, the fp32 side on Paddle's own CPU kernels (``paddle.set_device('cpu')``: most
    device kernels are registered for fp32 too, so a bug both dtypes share would pass a device-vs-device
    comparison): largest error relative to the largest fp32 magnitude, per op and output."""
    F = paddle.nn.functional
    rng = np.random.RandomState(3)

    def arr(*shape):
        return rng.randn(*shape).astype("float32")

    ids_np = rng.randint(0, 10, (2, 5)).astype("int64")
    cases = {
        "matmul": ([arr(3, 4, 8), arr(8, 5)], lambda a, b: paddle.matmul(a, b)),
        "matmul_t": ([arr(3, 4, 8), arr(3, 6, 8)], lambda a, b: paddle.matmul(a, b, transpose_y=True)),
        "gelu": ([arr(4, 8)], lambda a: F.gelu(a)),
        "gelu_tanh": ([arr(4, 8)], lambda a: F.gelu(a, approximate=True)),
        "silu": ([arr(4, 8)], lambda a: F.silu(a)),
        "swiglu": ([arr(4, 8), arr(4, 8)], lambda a, b: paddle.incubate.nn.functional.swiglu(a, b)),
        "softmax": ([arr(4, 8)], lambda a: F.softmax(a, -1)),
        "layer_norm": ([arr(4, 8), arr(8), arr(8)], lambda a, w, b: F.layer_norm(a, [8], w, b)),
        "group_norm": ([arr(2, 4, 3, 3), arr(4), arr(4)], lambda a, w, b: F.group_norm(a, 2, weight=w, bias=b)),
        "conv2d": ([arr(2, 3, 6, 6), arr(4, 3, 3, 3)], lambda a, w: F.conv2d(a, w, stride=2, padding=1)),
        "conv3d": ([arr(1, 2, 4, 4, 4), arr(3, 2, 2, 2, 2)], lambda a, w: F.conv3d(a, w, stride=2)),
        "pad": ([arr(1, 2, 3, 3)], lambda a: F.pad(a, [0, 1, 0, 1])),
        "mean_sum": ([arr(3, 4, 5)], lambda a: a.mean(axis=1) * 2.0 + a.sum(axis=1)),
        "mul_add_bcast": ([arr(3, 4), arr(4)], lambda a, b: a * b + b - a / (b * b + 1.0)),
        "tril_where": ([arr(4, 4)], lambda a: paddle.where(paddle.tril(paddle.ones([4, 4])) > 0, a, -a)),
        "sin_cos_exp": ([arr(3, 4)], lambda a: paddle.sin(a) * paddle.cos(a) + paddle.exp(a * 0.1)),
        "embedding": ([arr(10, 6)], lambda w: F.embedding(paddle.to_tensor(ids_np), w)),
        "expand_concat": ([arr(1, 4), arr(3, 2)], lambda a, b: paddle.concat([a.expand([3, 4]), b], axis=-1)),
        "clip_rsqrt": ([arr(3, 4)], lambda a: paddle.rsqrt(a.clip(0.5, 2.0) + 1.0)),
    }
    out = {}
    for name, (inputs, fn) in cases.items():
        got = {}
        device = paddle.get_device()
        for dtype in ("float32", "bfloat16"):
            paddle.set_device("cpu" if dtype == "float32" else device)
            xs = [paddle.to_tensor(bf16_values(x)).astype(dtype) for x in inputs]
            for x in xs:
                x.stop_gradient = False
            y = fn(*xs)
            weights = np.random.RandomState(11).randn(*y.shape).astype("float32")  # the same for both dtypes
            (y.astype("float32") * paddle.to_tensor(weights)).sum().backward()
            got[dtype] = [y.astype("float32").numpy()] + [x.grad.astype("float32").numpy() for x in xs]
        paddle.set_device(device)
        out[name] = [float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-6))
                     for a, b in zip(got["float32"], got["bfloat16"])]
        out[name + ":dtype"] = str(y.dtype)
    return out


def bf16_reference(out: str) -> dict:
    """Each bf16 kernel the tiny families run, on bf16 inputs, its output and every input gradient (one
    kernel each: the gradient of one op given a bf16 ``dout``), and AdamW's update with and without
    master weights, and casts: all written as fp32 values to ``bf16_reference.npz`` for
    tests/contract/test_testdevice_reference.py to hold against float64 references rounded to bf16.
    Returns each case's output dtype."""
    F = paddle.nn.functional
    rng = np.random.RandomState(5)
    arrays, dtypes = {}, {}

    def f32(t) -> np.ndarray:
        return t.astype("float32").numpy()

    def leaf(a):
        t = paddle.to_tensor(np.asarray(a, dtype="float32")).astype("bfloat16").detach()
        t.stop_gradient = False
        return t

    def case(name, inputs, fn, grad=True):
        xs = [leaf(a) for a in inputs]
        y = fn(*xs)
        dtypes[name] = str(y.dtype)
        for i, x in enumerate(xs):
            arrays[f"{name}/in{i}"] = f32(x)
        arrays[f"{name}/out"] = f32(y)
        if grad:
            dout = leaf(rng.randn(*y.shape))
            dout.stop_gradient = True
            grads = paddle.grad([y], xs, [dout])
            arrays[f"{name}/dout"] = f32(dout)
            for i, g in enumerate(grads):
                dtypes[f"{name}/grad{i}"] = str(g.dtype)
                arrays[f"{name}/grad{i}"] = f32(g)

    def randn(*shape):
        return rng.randn(*shape)

    def positive(*shape):  # no cancellation: fp32 accumulation error far below a bf16 rounding (see the test)
        return rng.uniform(0.5, 1.0, shape)

    # matmul at the tiny models' hidden sizes (32, 64, 128) and at 4096
    for k in (32, 64, 128):
        case(f"matmul_k{k}", [randn(8, k), randn(k, 16)], paddle.matmul)
    case("matmul_k4096", [positive(4, 4096), positive(4096, 8)], paddle.matmul, grad=False)
    case("matmul_grad_k4096", [positive(8, 64), positive(64, 4096)], paddle.matmul)  # dx sums 4096 terms
    case("matmul_bt", [randn(2, 8, 64), randn(2, 16, 64)], lambda a, b: paddle.matmul(a, b, transpose_y=True))
    # elementwise arithmetic (broadcast) and scale
    case("add", [randn(16, 64), randn(64)], lambda a, b: a + b)
    case("subtract", [randn(16, 64), randn(64)], lambda a, b: a - b)
    case("multiply", [randn(16, 64), randn(64)], lambda a, b: a * b)
    case("divide", [randn(16, 64), rng.uniform(0.5, 2.0, 64) * rng.choice([-1, 1], 64)], lambda a, b: a / b)
    case("scale", [randn(16, 64)], lambda a: paddle.scale(a, 0.37, bias=0.11), grad=False)
    # activations
    case("gelu", [randn(16, 64) * 2], F.gelu)
    case("gelu_tanh", [randn(16, 64) * 2], lambda a: F.gelu(a, approximate=True))
    case("silu", [randn(16, 64) * 2], F.silu)
    case("swiglu", [randn(16, 64) * 2, randn(16, 64)], lambda a, b: F.swiglu(a, b))
    case("sigmoid", [randn(16, 64) * 2], F.sigmoid)
    case("tanh", [randn(16, 64)], paddle.tanh)
    case("exp", [randn(16, 64)], paddle.exp)
    case("rsqrt", [rng.uniform(0.1, 4.0, (16, 64))], paddle.rsqrt)
    # softmax, norms (rows of very different scales: the epsilon matters in the small ones)
    case("softmax", [randn(16, 64) * 3], lambda a: F.softmax(a, -1))
    row_scale = 10.0 ** rng.uniform(-2.5, 1, (16, 1))
    case("layer_norm", [randn(16, 64) * row_scale + 0.5, 1 + 0.2 * randn(64), 0.1 * randn(64)],
         lambda a, w, b: F.layer_norm(a, [64], w, b, epsilon=1e-5))
    group_scale = np.repeat(10.0 ** rng.uniform(-2.5, 1, (2, 4, 1, 1)), 2, axis=1)
    case("group_norm", [randn(2, 8, 4, 4) * group_scale, 1 + 0.2 * randn(8), 0.1 * randn(8)],
         lambda a, w, b: F.group_norm(a, 4, epsilon=1e-5, weight=w, bias=b))
    # reductions, convolutions, embedding
    case("sum", [randn(8, 64)], lambda a: a.sum(axis=-1))
    case("mean", [randn(8, 64)], lambda a: a.mean(axis=0))
    case("conv2d", [randn(2, 8, 6, 6), randn(16, 8, 3, 3)], lambda a, w: F.conv2d(a, w, padding=1))
    case("conv3d", [randn(1, 4, 4, 4, 4), randn(6, 4, 2, 2, 2)], lambda a, w: F.conv3d(a, w, stride=1))
    ids = rng.randint(0, 12, (6, 8))
    arrays["embedding/ids"] = ids.astype("float32")
    case("embedding", [randn(12, 32)], lambda w: F.embedding(paddle.to_tensor(ids.astype("int64")), w))

    # casts: fp32 -> bf16 (random values and exact ties) and bf16 -> fp32
    values = np.concatenate([rng.randn(4096) * 10.0 ** rng.uniform(-3, 3, 4096),
                             np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2 + 2**-7, 1 + 2**-8 + 2**-20])])
    values = values.astype("float32")
    arrays["cast/in0"] = values
    arrays["cast/out"] = f32(paddle.to_tensor(values).astype("bfloat16"))
    dtypes["cast"] = str(paddle.to_tensor(values).astype("bfloat16").dtype)

    # AdamW on a bf16 parameter of 256 elements, with fp32 master weights (2 steps) and without (1 step)
    for master in (True, False):
        name = "adamw_master" if master else "adamw_plain"
        param = paddle.create_parameter([256], "bfloat16", default_initializer=paddle.nn.initializer.Constant(0.0))
        start = rng.randn(256).astype("float32")
        param.set_value(paddle.to_tensor(start).astype("bfloat16"))
        arrays[f"{name}/param0"] = f32(param)
        opt = paddle.optimizer.AdamW(learning_rate=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-8, parameters=[param],
                                     weight_decay=0.1, multi_precision=master)
        for step in range(2 if master else 1):
            grad = leaf(rng.randn(256) * 10.0 ** rng.uniform(-3, 0, 256))
            grad.stop_gradient = True
            (param * grad).sum().backward()  # the gradient is exactly the bf16 values of grad
            arrays[f"{name}/grad{step}"] = f32(grad)
            assert np.array_equal(f32(param.grad), arrays[f"{name}/grad{step}"])
            opt.step()
            opt.clear_grad()
            arrays[f"{name}/param{step + 1}"] = f32(param)
            if master:
                arrays[f"{name}/master{step + 1}"] = opt._master_weights[param.name].numpy()
        dtypes[name] = str(param.dtype)
    np.savez(Path(out, "bf16_reference.npz"), **{k: np.asarray(v, dtype="float32") for k, v in arrays.items()})
    return dtypes


def against_cpu() -> dict:
    """The same fp32 training (matmul, GELU, LayerNorm, softmax, AdamW, global-norm clip) on Paddle's own
    CPU kernels and on the device's native ones, in one process: losses and final weights."""
    out = {}
    for device in ("cpu", "testcpu:0"):
        paddle.set_device(device)
        paddle.seed(7)
        model = paddle.nn.Sequential(paddle.nn.Linear(16, 32), paddle.nn.GELU(), paddle.nn.LayerNorm(32),
                                     paddle.nn.Linear(32, 4))
        opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(), weight_decay=0.01,
                                     grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
        rng = np.random.RandomState(1)
        losses = []
        for _ in range(6):
            x, y = rng.randn(8, 16).astype("float32"), rng.randn(8, 4).astype("float32")
            probs = paddle.nn.functional.softmax(model(paddle.to_tensor(x)), -1)
            loss = (probs - paddle.to_tensor(y)).square().mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        out[device.split(":")[0]] = {"losses": losses, "weight": model[3].weight.numpy().ravel().tolist()}
    return out


SEGMENT = 64  # stage 3 slices parameters of more than this many elements: both weights here (512, 128)


def mlp(level: str) -> dict:
    """A 2-layer MLP, AdamW with global-norm clipping, 6 steps of a global batch of 8 (split by rank):
    the mean loss over the ranks and the global norm of the gradients the optimizer applies, per step
    (xfw_paddle.parallel.NormRecorder: each rank's applied share, summed over the ranks). Stage 3 with
    a segment size under which both weight matrices are sliced, so that parameters really are gathered."""
    from xfw_paddle.parallel import NormRecorder

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank() if world > 1 else 0
    paddle.seed(7)
    model = paddle.nn.Sequential(paddle.nn.Linear(16, 32), paddle.nn.GELU(), paddle.nn.Linear(32, 4))
    opt = inner = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(), weight_decay=0.01,
                                         grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    group = None
    if world > 1:
        from paddle.distributed.sharding import group_sharded_parallel

        group = dist.new_group(list(range(world)))
        model, opt, _ = group_sharded_parallel(model, opt, level=level, group=group,
                                               **({"segment_size": SEGMENT} if level == "p_g_os" else {}))
    recorder = inner._grad_clip = NormRecorder(inner._grad_clip, group)
    unsliced = getattr(model, "_unslice_params", None)  # stage 3's parameters it keeps whole
    sliced = 0 if unsliced is None else sum(1 for p in model.parameters() if p.trainable and p not in unsliced)
    rng = np.random.RandomState(1)
    losses, norms = [], []
    for _ in range(6):
        x, y = rng.randn(8, 16).astype("float32"), rng.randn(8, 4).astype("float32")
        part = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = ((model(paddle.to_tensor(x[part])) - paddle.to_tensor(y[part])) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        mean = paddle.to_tensor(loss.numpy())
        if world > 1:
            dist.all_reduce(mean)
        losses.append(float(mean.numpy()) / world)
        norms.append(float(recorder.norm))
    return {"losses": losses, "norms": norms, "world": world, "sliced": sliced}


def main(argv: list[str]) -> int:
    out, mode, *rest = argv
    result = {"collectives": collectives, "collectives_big": lambda: testdevice_cases.collectives_big(paddle, dist),
              "views": views, "bf16": bf16, "against_cpu": against_cpu,
              "bf16_ops": bf16_ops}.get(mode)
    if mode == "bf16_reference":
        data = bf16_reference(out)
    elif mode == "kernel_cases":
        data = testdevice_cases.run(paddle, out)
    else:
        data = result() if result else mlp(*rest)
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    Path(out, f"{mode}.{rank}.json").write_text(json.dumps(data))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
