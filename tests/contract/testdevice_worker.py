"""What tests/contract/test_testdevice.py runs inside Paddle on the ``testcpu`` device (the Paddle
environment has no pytest). Each mode writes ``<out>/<mode>.<rank>.json``; the test compares.

    python testdevice_worker.py OUT collectives          (under paddle.distributed.launch, 2 ranks)
    python testdevice_worker.py OUT views                (one process)
    python testdevice_worker.py OUT bf16                 (one process)
    python testdevice_worker.py OUT against_cpu          (one process)
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


def bf16_ops() -> dict:
    """Each bf16 kernel the tiny models need, forward and backward, against the same op in fp32 on the
    same bf16-valued inputs (fp32 runs the device's fp32 kernel or Paddle's CPU one): largest error
    relative to the largest fp32 magnitude, per op and output."""
    F = paddle.nn.functional
    rng = np.random.RandomState(3)

    def arr(*shape):
        return rng.randn(*shape).astype("float32")

    ids = paddle.to_tensor(rng.randint(0, 10, (2, 5)).astype("int64"))
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
        "embedding": ([arr(10, 6)], lambda w: F.embedding(ids, w)),
        "expand_concat": ([arr(1, 4), arr(3, 2)], lambda a, b: paddle.concat([a.expand([3, 4]), b], axis=-1)),
        "clip_rsqrt": ([arr(3, 4)], lambda a: paddle.rsqrt(a.clip(0.5, 2.0) + 1.0)),
    }
    out = {}
    for name, (inputs, fn) in cases.items():
        got = {}
        for dtype in ("float32", "bfloat16"):
            xs = [paddle.to_tensor(x).astype("bfloat16").astype(dtype) for x in inputs]
            for x in xs:
                x.stop_gradient = False
            y = fn(*xs)
            weights = np.random.RandomState(11).randn(*y.shape).astype("float32")  # the same for both dtypes
            (y.astype("float32") * paddle.to_tensor(weights)).sum().backward()
            got[dtype] = [y.astype("float32").numpy()] + [x.grad.astype("float32").numpy() for x in xs]
        out[name] = [float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-6))
                     for a, b in zip(got["float32"], got["bfloat16"])]
        out[name + ":dtype"] = str(y.dtype)
    return out


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


def mlp(level: str) -> dict:
    """A 2-layer MLP, AdamW with global-norm clipping, 6 steps of a global batch of 8 (split by rank)."""
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank() if world > 1 else 0
    paddle.seed(7)
    model = paddle.nn.Sequential(paddle.nn.Linear(16, 32), paddle.nn.GELU(), paddle.nn.Linear(32, 4))
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(), weight_decay=0.01,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    if world > 1:
        from paddle.distributed.sharding import group_sharded_parallel

        model, opt, _ = group_sharded_parallel(model, opt, level=level)
    rng = np.random.RandomState(1)
    losses = []
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
    return {"losses": losses, "world": world}


def main(argv: list[str]) -> int:
    out, mode, *rest = argv
    result = {"collectives": collectives, "views": views, "bf16": bf16, "against_cpu": against_cpu,
              "bf16_ops": bf16_ops}.get(mode)
    data = result() if result else mlp(*rest)
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    Path(out, f"{mode}.{rank}.json").write_text(json.dumps(data))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
