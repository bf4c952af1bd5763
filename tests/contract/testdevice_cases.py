"""The kernel cases of tests/contract/test_testdevice_kernels.py, run inside Paddle on ``testcpu`` (mode
``kernel_cases`` of testdevice_worker.py). Each case runs one op in one dtype on the device, from inputs
given as float64 values (stored in the case's dtype, so the test reads back the exact values the kernel
saw), and records its output and the gradient of every float input for a random ``dout``. Special values
(+-inf, NaN, values past bf16's and fp16's range, denormals, logits of 1000), strided and transposed
inputs and broadcast shapes are among the inputs. Each case names the device kernels it checks; the
worker writes ``kernel_cases.npz`` (values) and returns {case: {"kernels": [...], "dtype": ...}}.
The test recomputes every case in float64 (PyTorch's kernels; never the device's).

Also ``collectives_big`` (mode ``collectives_big``, tests/contract/test_testdevice_collectives.py): every
collective over one 32 MiB slot on 2 or 3 ranks, twice in a row with different payloads."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

FLOATS = ("bfloat16", "float16", "float32")


def run(paddle, out: str) -> dict:
    F = paddle.nn.functional
    rng = np.random.RandomState(11)
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, dict] = {}

    def tensor(a, dtype, grad=True):
        t = paddle.to_tensor(np.asarray(a, dtype="float64")).astype(dtype).detach()
        t.stop_gradient = not grad
        return t

    def f64(t):
        return t.astype("float64").numpy() if t.dtype != paddle.bool else t.numpy().astype("float64")

    def case(name, dtype, kernels, inputs, fn, grad=True, extra=None):
        key = f"{dtype}:{name}"
        xs = [tensor(a, dtype, grad) for a in inputs]
        y = fn(*xs)
        meta[key] = {"kernels": kernels, "dtype": dtype, "out_dtype": str(y.dtype).replace("paddle.", "")}
        for i, x in enumerate(xs):
            arrays[f"{key}/in{i}"] = f64(x)
        arrays[f"{key}/out"] = f64(y)
        if grad:
            dout = tensor(rng.randn(*y.shape), str(y.dtype).replace("paddle.", ""), grad=False)
            grads = paddle.grad([y], xs, [dout], allow_unused=True)
            arrays[f"{key}/dout"] = f64(dout)
            for i, g in enumerate(grads):
                if g is not None:
                    arrays[f"{key}/grad{i}"] = f64(g)
        for k, v in (extra or {}).items():
            arrays[f"{key}/{k}"] = np.asarray(v, dtype="float64")

    def randn(*shape, scale=1.0):
        return rng.randn(*shape) * scale

    for dt in FLOATS:
        # elementwise arithmetic with broadcasting both ways (the left operand broadcast too)
        for op, fn in (("add", paddle.add), ("subtract", paddle.subtract), ("multiply", paddle.multiply),
                       ("divide", paddle.divide), ("maximum", paddle.maximum), ("minimum", paddle.minimum)):
            b = rng.uniform(0.5, 2.0, (1, 8)) * rng.choice([-1, 1], (1, 8)) if op == "divide" else randn(1, 8)
            grad_kernel = [f"{op}_grad"] if op in ("add", "subtract", "multiply", "divide") else []
            case(f"{op}_bcast", dt, [op, *grad_kernel], [randn(3, 1, 8), b], fn, grad=bool(grad_kernel))
            case(f"{op}_bcast_left", dt, [op, *grad_kernel], [b, randn(2, 3, 8)], fn, grad=bool(grad_kernel))
        # special values through arithmetic (no gradients: inf - inf is NaN by definition there)
        special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, 3e38, -3.4e38, 65504.0, 7e4, 1e-7, 6e-8])
        case("add_special", dt, ["add"], [special, special[::-1].copy()], paddle.add, grad=False)
        case("multiply_special", dt, ["multiply"], [special, np.full(12, 2.0)], paddle.multiply, grad=False)
        # activations and unary math
        x = randn(4, 16, scale=2.0)
        for op, fn, inp in (("gelu", F.gelu, x), ("gelu_tanh", lambda a: F.gelu(a, approximate=True), x),
                            ("silu", F.silu, x), ("sigmoid", F.sigmoid, x), ("tanh", paddle.tanh, x / 2),
                            ("relu", F.relu, x), ("exp", paddle.exp, x / 2), ("square", paddle.square, x),
                            ("sqrt", paddle.sqrt, np.abs(x) + 0.1), ("rsqrt", paddle.rsqrt, np.abs(x) + 0.1),
                            ("pow", lambda a: paddle.pow(a, 3.0), x / 2)):
            kernel = op.replace("_tanh", "")
            case(op, dt, [kernel, f"{kernel}_grad"], [inp], fn)
        if dt != "float32":  # registered for bf16 and fp16 only
            for op, fn in (("sin", paddle.sin), ("cos", paddle.cos), ("erf", paddle.erf)):
                case(op, dt, [op, f"{op}_grad"], [x], fn)
            case("clip", dt, ["clip", "clip_grad"], [x], lambda a: paddle.clip(a, -1.0, 1.5))
            case("where", dt, ["where", "where_grad"], [x, randn(4, 16)],
                 lambda a, b: paddle.where(paddle.to_tensor(np.arange(64).reshape(4, 16) % 3 == 0), a, b))
            case("expand", dt, ["expand", "expand_grad"], [randn(1, 3, 1)], lambda a: paddle.expand(a, [2, 3, 4]))
            case("concat", dt, ["concat_grad"], [randn(2, 3), randn(2, 5)], lambda a, b: paddle.concat([a, b], 1))
            case("pad3d_constant", dt, ["pad3d", "pad3d_grad"], [randn(1, 2, 3, 4, 5)],
                 lambda a: F.pad(a, [1, 2, 0, 1, 2, 0], value=0.5, data_format="NCDHW"))
            case("pad3d_replicate", dt, ["pad3d", "pad3d_grad"], [randn(1, 2, 3, 4, 5)],
                 lambda a: F.pad(a, [1, 2, 0, 1, 2, 0], mode="replicate", data_format="NCDHW"))
            case("group_norm", dt, ["group_norm", "group_norm_grad"], [randn(2, 8, 3, 3) * 3 + 1, 1 + 0.2 * randn(8),
                 0.1 * randn(8)], lambda a, w, b: F.group_norm(a, 4, epsilon=1e-5, weight=w, bias=b))
            case("conv2d_same_odd", dt, ["conv2d", "conv2d_grad"], [randn(1, 3, 6, 5), randn(4, 3, 2, 2)],
                 lambda a, w: F.conv2d(a, w, padding="SAME"))
            case("conv2d_strided", dt, ["conv2d", "conv2d_grad"], [randn(1, 4, 7, 7), randn(4, 2, 3, 3)],
                 lambda a, w: F.conv2d(a, w, stride=2, padding=1, groups=2))
            case("conv3d", dt, ["conv3d", "conv3d_grad"], [randn(1, 3, 4, 6, 6), randn(4, 3, 2, 3, 3)],
                 lambda a, w: F.conv3d(a, w, stride=[2, 3, 3]))  # Qwen2-VL's patch embedding: stride = kernel
            case("squared_l2_norm", dt, ["squared_l2_norm"], [randn(64)],
                 lambda a: paddle._C_ops.squared_l2_norm(a), grad=False)
        # masks and shape kernels (triu/tril for every float dtype)
        case("triu", dt, ["triu", "triu_grad"], [randn(2, 4, 5)], lambda a: paddle.triu(a, 1))
        case("tril", dt, ["tril", "tril_grad"], [randn(2, 4, 5)], lambda a: paddle.tril(a, -1))
        case("swiglu", dt, ["swiglu", "swiglu_grad"], [randn(4, 16), randn(4, 16)], lambda a, b: F.swiglu(a, b))
        # softmax: ordinary rows, rows of logits near 1000 (needs the max subtraction), -inf masked entries
        logits = randn(4, 16, scale=3.0)
        logits[1] += 1000.0 if dt != "float16" else 30000.0
        logits[2, :5] = -np.inf
        case("softmax", dt, ["softmax", "softmax_grad"], [logits], lambda a: F.softmax(a, -1))
        # reductions, mean with keepdim, layer_norm, matmul (transposed, broadcast batch), embedding
        case("sum", dt, ["sum", "sum_grad"], [randn(3, 4, 8)], lambda a: a.sum(axis=[0, 2]))
        case("mean", dt, ["mean", "mean_grad"], [randn(3, 4, 8)], lambda a: a.mean(axis=1, keepdim=True))
        case("layer_norm", dt, ["layer_norm", "layer_norm_grad"], [randn(6, 32) * 4 + 1, 1 + 0.2 * randn(32),
             0.1 * randn(32)], lambda a, w, b: F.layer_norm(a, [32], w, b, epsilon=1e-5))
        case("matmul_bcast_left", dt, ["matmul", "matmul_grad"], [randn(4, 8), randn(3, 8, 5)], paddle.matmul)
        case("matmul_t", dt, ["matmul", "matmul_grad"], [randn(2, 8, 4), randn(2, 5, 8)],
             lambda a, b: paddle.matmul(a, b, transpose_x=True, transpose_y=True))
        ids = rng.randint(0, 10, (3, 5))
        case("embedding", dt, ["embedding", "embedding_grad"], [randn(10, 6)],
             lambda w: F.embedding(paddle.to_tensor(ids), w), extra={"ids": ids})
        case("scale", dt, ["scale"], [randn(4, 8)], lambda a: paddle.scale(a, 0.37, bias=0.11), grad=False)
        case("add_n", dt, ["add_n"], [randn(3, 4), randn(3, 4), randn(3, 4)], lambda a, b, c: paddle.add_n([a, b, c]),
             grad=False)
        # strided and transposed inputs: contiguous() of a view, an op on a strided slice, a strided write
        case("transpose_contiguous", dt, ["contiguous"], [randn(3, 4, 5)],
             lambda a: a.transpose([2, 0, 1]).contiguous(), grad=False)
        case("slice_exp", dt, ["contiguous", "exp"], [randn(4, 9)], lambda a: paddle.exp(a[:, 1:8:3]), grad=False)

        def strided_write(a, b):
            buf = a.clone()
            buf[:, 1:4].copy_(b, False)  # a strided view written in place: strided_copy into the larger buffer
            return buf
        case("strided_write", dt, ["strided_copy"], [randn(3, 6), randn(3, 3)], strided_write, grad=False)
        # casts with special values, into and out of every float dtype
        cast_in = np.concatenate([special, randn(64, scale=100.0), [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11]])
        for to in ("float32", "bfloat16", "float16", "float64"):
            if to != dt:
                case(f"cast_to_{to}", dt, ["cast"], [cast_in], lambda a, to=to: a.astype(to), grad=False)
        case("full", dt, ["full"], [], lambda: paddle.full([3, 2], -2.5e-3, dtype=dt), grad=False)
        case("full_like", dt, ["full_like"], [randn(2, 3)], lambda a: paddle.full_like(a, 7.1e-2), grad=False)
        case("fill", dt, ["fill"], [randn(2, 3)], lambda a: a.clone().fill_(0.3), grad=False)
        case("assign", dt, ["assign"], [special], lambda a: paddle.assign(a), grad=False)
        case("div_scale", dt, ["div_scale"], [randn(2, 3)], lambda a: a / 3.0, grad=False)
    # AdamW, one step on a low-precision parameter with fp32 master weights (O2's multi_precision)
    for dt in ("bfloat16", "float16"):
        key = f"{dt}:adamw_master"
        param = paddle.create_parameter([64], dt, default_initializer=paddle.nn.initializer.Constant(0.0))
        param.set_value(tensor(randn(64), dt, grad=False))
        arrays[f"{key}/param0"] = f64(param)
        opt = paddle.optimizer.AdamW(learning_rate=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-8, parameters=[param],
                                     weight_decay=0.1, multi_precision=True)
        g = tensor(randn(64) * 10.0 ** rng.uniform(-3, 0, 64), dt, grad=False)
        (param * g).sum().backward()
        arrays[f"{key}/grad0"] = f64(param.grad)
        opt.step()
        arrays[f"{key}/param1"] = f64(param)
        arrays[f"{key}/master1"] = opt._master_weights[param.name].astype("float64").numpy()
        meta[key] = {"kernels": ["adamw"], "dtype": dt, "out_dtype": dt}
    # fp32 -> fp64 and fp64 kernels the models reach (global-norm clipping in float64)
    for name, fn, kernels in (("square", paddle.square, ["square"]), ("sqrt", paddle.sqrt, ["sqrt"]),
                              ("sum_all", lambda a: a.sum(), ["sum"]), ("add_self", lambda a: a + a, ["add"])):
        case(name, "float64", kernels, [np.abs(randn(16)) + 0.5], fn, grad=False)
    case("cast_to_float32", "float64", ["cast"], [np.concatenate([randn(16) * 1e3, [1e-300, 1e300, np.inf, np.nan]])],
         lambda a: a.astype("float32"), grad=False)
    case("full", "float64", ["full"], [], lambda: paddle.full([3, 2], -2.5e-3, dtype="float64"), grad=False)
    case("add_n", "float64", ["add_n"], [randn(3), randn(3)], lambda a, b: paddle.add_n([a, b]), grad=False)
    # integer and bool kernels the models reach (masks, position ids): exact
    case("multiply", "int64", ["multiply"], [rng.randint(-50, 50, (3, 4)), rng.randint(-50, 50, (4,))], paddle.multiply,
         grad=False)
    case("scale", "int64", ["scale"], [rng.randint(-50, 50, (3, 4))], lambda a: paddle.scale(a, 3.0, bias=2.0), grad=False)
    for dt in ("int64", "int32", "bool"):
        case("full", dt, ["full"], [], lambda dt=dt: paddle.full([2, 3], 1, dtype=dt), grad=False)
    case("cast_to_float32", "int64", ["cast"], [rng.randint(-2**40, 2**40, 8)], lambda a: a.astype("float32"), grad=False)
    case("cast_to_float32", "bool", ["cast"], [rng.randint(0, 2, 8)], lambda a: a.astype("float32"), grad=False)
    case("tril", "bool", ["tril"], [rng.randint(0, 2, (4, 5))], lambda a: paddle.tril(a, 0), grad=False)
    case("transpose_contiguous", "int64", ["contiguous"], [rng.randint(0, 99, (3, 4))],
         lambda a: a.transpose([1, 0]).contiguous(), grad=False)
    np.savez(Path(out, "kernel_cases.npz"), **arrays)
    return meta


BIG = 9_000_001  # fp32 elements: 36 MB, more than one 32 MiB shared slot, and not a multiple of the chunk


@functools.lru_cache(maxsize=2)
def _ramp(n: int, top: int) -> np.ndarray:
    """0, 1, .., top-1, 0, 1, .. over n elements, in int32 (every payload value fits): built once per size, as
    the payloads are built ~20 times per call on every rank (about 7 s of CPU per rank in int64, rebuilt each time)."""
    ramp = np.arange(n, dtype=np.int32) % top
    ramp.flags.writeable = False
    return ramp


def big_payload(rank: int, call: int, n: int = BIG, dtype: str = "float32") -> np.ndarray:
    """Integers that differ per rank, per call and along the buffer; sums of 3 stay exact (bf16: below 256)."""
    top = 40 if dtype == "bfloat16" else 1000
    return (_ramp(n, top) * (rank + 1) + 7 * call + rank) % (top + 37)


def collectives_big(paddle, dist) -> dict:
    """Every collective with a payload over one slot, on however many ranks the launcher started, each called
    twice in a row with different payloads (a rank that reads a peer's slot before the peer rewrote it, or
    after it moved on, gets the other call's numbers). Expected values from numpy; mismatching elements
    counted per collective and call."""
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    bad: dict[str, int] = {}

    def count(name, got, want):
        bad[name] = int(np.count_nonzero(got.astype("float32").numpy() != np.asarray(want, dtype="float32")))

    def every(call, n=BIG, dtype="float32"):
        return [big_payload(r, call, n, dtype) for r in range(world)]

    for call in range(2):
        for dtype in ("float32", "bfloat16"):
            n = BIG if dtype == "float32" else 2 * BIG  # bf16: twice the elements for the same bytes
            xs = every(call, n, dtype)
            y = paddle.to_tensor(xs[rank]).astype(dtype)
            dist.all_reduce(y)
            count(f"all_reduce_{dtype}_{call}", y, np.sum(xs, 0))
        xs = every(call)
        y = paddle.to_tensor(xs[rank]).astype("float32")
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        count(f"all_reduce_max_{call}", y, np.max(xs, 0))
        y = paddle.to_tensor(xs[rank]).astype("float32")
        dist.reduce(y, dst=world - 1)
        count(f"reduce_{call}", y, np.sum(xs, 0) if rank == world - 1 else xs[rank])
        y = paddle.to_tensor(xs[rank]).astype("float32")
        dist.broadcast(y, src=world - 1)
        count(f"broadcast_{call}", y, xs[world - 1])
        gathered = []
        dist.all_gather(gathered, paddle.to_tensor(xs[rank]).astype("float32"))
        count(f"all_gather_{call}", paddle.concat(gathered), np.concatenate(xs))
        parts = [big_payload(rank, call + 10 * j) for j in range(world)]  # block j of rank r
        y = paddle.zeros([BIG], dtype="float32")
        dist.reduce_scatter(y, [paddle.to_tensor(p).astype("float32") for p in parts])
        count(f"reduce_scatter_{call}", y, sum(big_payload(r, call + 10 * rank) for r in range(world)))
    dist.barrier()
    return {"rank": rank, "world": world, "mismatches": bad}

