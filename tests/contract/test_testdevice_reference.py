"""The CPU test device's bf16 kernels against an independent reference (issue 35, docs/testdevice.md).

Every bf16 kernel the tiny families run on ``testcpu`` (matmul at the tiny models' hidden sizes and at
K = 4096, elementwise arithmetic, activations, softmax, layer/group norm, reductions, conv2d/3d,
embedding), its output and each input gradient, and AdamW's update with and without fp32 master weights,
and the fp32 -> bf16 cast, run on the device (tests/contract/testdevice_worker.py, mode
``bf16_reference``). Here each is recomputed from the *same bf16 input values* in float64 with PyTorch
(a different framework's kernels, in a precision where the reference's own error is negligible) and
held to what "compute in fp32, round once to nearest even" allows.

The bound (``allowed``): the device promises ``RNE_bf16(v)`` where ``v`` is its fp32 value of the exact
result ``r``. Rounding to nearest even is monotone, so if ``|v - r| <= e`` the stored value lies in
``[RNE_bf16(RNE_f32(r - e)), RNE_bf16(RNE_f32(r + e))]`` (``RNE_f32`` of ``v`` is ``v``; both roundings are
monotone). ``e`` bounds the fp32 arithmetic only, which is 2**16 times finer than bf16's:

* sums of products (matmul, conv, reductions, the gradients of broadcasts and of embedding): the
  products of two bf16 values are exact in fp32, so recursive summation in any order is off by at most
  ``gamma_K * sum|a_i b_i|`` with ``gamma_K = K u / (1 - K u)``, ``u = 2**-24`` (Higham, Accuracy and
  Stability of Numerical Algorithms, 2nd ed., eq. 3.5); ``sum|a_i b_i|`` is the same reference on
  absolute values. With inputs of mixed signs that is tight only for small K, so K = 4096 uses positive
  inputs (no cancellation: ``sum|a_i b_i|`` is the result itself, ``e`` is 1/16 of a bf16 rounding);
* everything else (libm's expf/erff/tanhf within a few fp32 ulps, a handful of fp32 operations):
  ``e = 64 u M`` for a magnitude ``M`` of the largest intermediate, stated per op below (times the row
  length for the norms' gradients, whose sums run over the row).

So the check is nearly "equal to the correctly rounded value": the fraction of elements where the
interval holds two bf16 values (``ambiguous``) is printed and held below 10% overall. A kernel that
truncates instead of rounding misses on about half of its elements; one that drops an inner term or uses
a wrong constant misses by many roundings. What it cannot see: an error below ``e`` (a dropped term smaller
than 1/16 of a rounding, say), kernels the cases here do not call, and shapes they do not use.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from test_testdevice import device_env, run_worker  # noqa: F401  (the fixture is shared)

pytestmark = pytest.mark.contract

U = 2.0**-24  # fp32 unit roundoff
C = 64.0  # slack of a non-summation op in fp32 units of its largest intermediate


def to_bf16(x) -> np.ndarray:
    """float64 -> fp32 (nearest) -> bf16 (nearest even), as fp32 values."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    out = bits.astype(np.uint32).view(np.float32)
    return np.where(nan, np.float32("nan"), out)


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def allowed(ref, e):
    """The bf16 values "fp32 within e of ref, then rounded once" can give: [lo, hi] per element."""
    ref, e = np.asarray(ref, dtype=np.float64), np.broadcast_to(np.asarray(e, dtype=np.float64), np.shape(ref))
    return to_bf16(ref - e), to_bf16(ref + e)


def check(name: str, got, ref, e, tally: dict) -> list[str]:
    got = np.asarray(got, dtype=np.float32)
    ref = np.asarray(ref, dtype=np.float64).reshape(got.shape)
    lo, hi = allowed(ref, np.broadcast_to(e, ref.shape))
    assert np.array_equal(to_bf16(got), got), f"{name}: not bf16 values"
    bad = (got < lo) | (got > hi)
    tally["elements"] += got.size
    tally["ambiguous"] += int((lo != hi).sum())
    if not bad.any():
        return []
    i = np.unravel_index(np.argmax(bad), got.shape)
    ulp = np.abs(to_bf16(ref[i]).astype(np.float64)) * 2.0**-7
    return [f"{name}: {int(bad.sum())} of {got.size} outside the bound, e.g. at {tuple(int(j) for j in i)}: "
            f"device {got[i]!r}, allowed [{lo[i]!r}, {hi[i]!r}] (exact {ref[i]:.8g}, "
            f"off by {abs(got[i] - ref[i]) / max(ulp, 1e-30):.2f} bf16 ulps)"]


def t(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


def autograd(fn, inputs, dout):
    """float64 output and input gradients of fn on the given values."""
    xs = [t(a) for a in inputs]
    y = fn(*xs)
    grads = torch.autograd.grad(y, xs, torch.tensor(np.asarray(dout, dtype=np.float64)), allow_unused=True)
    return y.detach().numpy(), [g.numpy() if g is not None else None for g in grads]


F = torch.nn.functional
# Sums of products: (reference function, number of summed terms of the output, of each gradient).
BILINEAR = {
    "matmul_k32": (torch.matmul, 32, (16, 8)),
    "matmul_k64": (torch.matmul, 64, (16, 8)),
    "matmul_k128": (torch.matmul, 128, (16, 8)),
    "matmul_k4096": (torch.matmul, 4096, ()),
    "matmul_grad_k4096": (torch.matmul, 64, (4096, 8)),
    "matmul_bt": (lambda a, b: a @ b.transpose(-1, -2), 64, (16, 8)),
    "add": (lambda a, b: a + b, 2, (1, 16)),
    "subtract": (lambda a, b: a - b, 2, (1, 16)),
    "multiply": (lambda a, b: a * b, 1, (1, 16)),
    "sum": (lambda a: a.sum(-1), 64, (1,)),
    "mean": (lambda a: a.mean(0), 9, (2,)),  # 8 terms and a division
    "conv2d": (lambda a, w: F.conv2d(a, w, padding=1), 72, (144, 72)),
    "conv3d": (lambda a, w: F.conv3d(a, w), 32, (48, 27)),
    "scale": (lambda a: a * 0.37 + 0.11, 3, ()),  # 0.37 and 0.11 are fp32 constants: 2 more roundings
}


def sig(x):
    return 1 / (1 + torch.exp(-x))


# Everything else: (reference function of the inputs, the output's magnitude M of its largest intermediate)
ELEMENTWISE = {
    "divide": (lambda a, b: a / b, lambda a, b: abs(a / b)),
    "gelu": (lambda a: F.gelu(a), lambda a: abs(a)),
    "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"), lambda a: abs(a) * (1 + a * a)),
    "silu": (F.silu, lambda a: abs(a)),
    "swiglu": (lambda a, b: F.silu(a) * b, lambda a, b: abs(a * b)),
    "sigmoid": (torch.sigmoid, lambda a: np.ones_like(a)),
    "tanh": (torch.tanh, lambda a: np.ones_like(a)),
    "exp": (torch.exp, lambda a: np.exp(a)),
    "rsqrt": (torch.rsqrt, lambda a: a**-0.5),
    "softmax": (lambda a: F.softmax(a, -1), lambda a: np.ones_like(a)),
}
# gradient kernels that read the forward's (bf16) output instead of its input: d(input) from (out, dout)
FROM_OUTPUT = {
    "sigmoid": (lambda y, g: g * y * (1 - y), lambda y, g: abs(g)),
    "tanh": (lambda y, g: g * (1 - y * y), lambda y, g: abs(g) * (1 + y * y)),
    "exp": (lambda y, g: g * y, lambda y, g: abs(g * y)),
    "rsqrt": (lambda y, g: -0.5 * g * y**3, lambda y, g: abs(g * y**3)),
    "softmax": (lambda y, g: y * (g - (g * y).sum(-1, keepdims=True)),
                lambda y, g: 64 * y * (abs(g) + (abs(g) * y).sum(-1, keepdims=True))),
}


@pytest.fixture(scope="module")
def device(device_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16ref")
    [dtypes] = run_worker(device_env, out, "bf16_reference")
    with np.load(out / "bf16_reference.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return dtypes, arrays


def case_inputs(arrays, name):
    return [arrays[f"{name}/in{i}"].astype(np.float64) for i in range(4) if f"{name}/in{i}" in arrays]


def test_every_case_ran_in_bf16(device):
    dtypes, arrays = device
    names = set(BILINEAR) | set(ELEMENTWISE) | {"layer_norm", "group_norm", "embedding", "cast", "adamw_master",
                                                 "adamw_plain"}
    assert names <= set(dtypes), names - set(dtypes)
    assert all(v == "paddle.bfloat16" for v in dtypes.values()), dtypes


def test_bf16_kernels_equal_a_float64_reference_rounded_once(device):
    """Outputs and input gradients of every case within the derived bound (module docstring)."""
    _, arrays = device
    failures, tally = [], {"elements": 0, "ambiguous": 0}
    for name, (fn, k_out, k_grads) in BILINEAR.items():
        ins = case_inputs(arrays, name)
        dout = arrays.get(f"{name}/dout", np.zeros(arrays[f"{name}/out"].shape))
        ref, grads = autograd(fn, ins, dout)
        mag, mag_grads = autograd(fn, [np.abs(a) for a in ins], np.abs(dout))
        failures += check(name, arrays[f"{name}/out"], ref, gamma(k_out) * np.abs(mag), tally)
        for i, k in enumerate(k_grads):
            failures += check(f"{name} d{i}", arrays[f"{name}/grad{i}"], grads[i], gamma(k) * np.abs(mag_grads[i]),
                              tally)
    for name, (fn, magnitude) in ELEMENTWISE.items():
        ins = case_inputs(arrays, name)
        dout = arrays[f"{name}/dout"].astype(np.float64)
        ref, grads = autograd(fn, ins, dout)
        failures += check(name, arrays[f"{name}/out"], ref, C * U * magnitude(*ins), tally)
        if name in FROM_OUTPUT:
            grad_fn, grad_mag = FROM_OUTPUT[name]
            y = arrays[f"{name}/out"].astype(np.float64)
            failures += check(f"{name} d0", arrays[f"{name}/grad0"], grad_fn(y, dout), C * U * grad_mag(y, dout), tally)
            continue
        # gradients from the inputs: |dout| times the magnitude of the derivative's terms (1 + |x|^2 covers
        # GELU's and SiLU's x * pdf(x) and the tanh form's cubic); divide's d(b) sums 16 rows of dout * a / b^2
        if name == "divide":
            a, b = ins
            failures += check("divide d0", arrays["divide/grad0"], grads[0], C * U * np.abs(dout / b), tally)
            m = (np.abs(dout * a) / (b * b)).sum(0)
            failures += check("divide d1", arrays["divide/grad1"], grads[1], (gamma(16) + C * U) * m, tally)
            continue
        for i, g in enumerate(grads):
            e = C * U * np.abs(dout) * (1 + sum(np.abs(a) for a in ins) ** 2)
            failures += check(f"{name} d{i}", arrays[f"{name}/grad{i}"], g, e, tally)
    failures += norms(arrays, tally)
    failures += embedding(arrays, tally)
    print(f"bf16 reference: {tally['elements']} elements, {tally['ambiguous']} where the bound admits two bf16 values")
    assert not failures, "\n".join(failures)
    assert tally["ambiguous"] < 0.1 * tally["elements"], tally  # the bound is nearly exact


def norms(arrays, tally) -> list[str]:
    """layer_norm over rows of 64, group_norm over groups of 2 channels x 4 x 4 (32 values); every
    magnitude is computed in rows of one normalised group each."""
    failures = []
    for name, fn, wshape, n in (("layer_norm", lambda a, w, b: F.layer_norm(a, [64], w, b, eps=1e-5), (1, -1), 64),
                                ("group_norm", lambda a, w, b: F.group_norm(a, 4, w, b, eps=1e-5), (1, -1, 1, 1), 32)):
        x, w, b = case_inputs(arrays, name)
        dout = arrays[f"{name}/dout"].astype(np.float64)
        ref, grads = autograd(fn, [x, w, b], dout)
        rows = x.reshape(-1, n)
        mu, inv = rows.mean(-1, keepdims=True), 1 / np.sqrt(rows.var(-1, keepdims=True) + 1e-5)

        def full(a):  # per-row values back in x's shape
            return np.broadcast_to(a, rows.shape).reshape(x.shape)

        ww = np.broadcast_to(np.abs(w).reshape(wshape), x.shape)
        bb = np.broadcast_to(np.abs(b).reshape(wshape), x.shape)
        xhat = np.abs(x - full(mu)) * full(inv)
        m_out = (np.abs(x) + np.abs(full(mu))) * full(inv) * ww + bb
        failures += check(name, arrays[f"{name}/out"], ref, C * U * m_out, tally)
        # dx = inv * (g - mean(g) - xhat * mean(g * xhat)), g = dout * w: sums of n terms over the row
        g = (np.abs(dout) * ww).reshape(-1, n)
        xr = xhat.reshape(-1, n)
        m_dx = full(inv) * (np.abs(dout) * ww + full(g.mean(-1, keepdims=True)) * (1 + xhat)
                            + full((g * xr).mean(-1, keepdims=True)) * xhat * (1 + xhat))
        failures += check(f"{name} dx", arrays[f"{name}/grad0"], grads[0], n * C * U * m_dx, tally)
        reduce_axes = tuple(i for i in range(x.ndim) if wshape[i] == 1)
        terms = x.size // w.size
        m_dw = (np.abs(dout) * (xhat + 1)).sum(axis=reduce_axes)
        failures += check(f"{name} dscale", arrays[f"{name}/grad1"], grads[1], (terms + C) * U * m_dw, tally)
        failures += check(f"{name} dbias", arrays[f"{name}/grad2"], grads[2],
                          gamma(terms) * np.abs(dout).sum(axis=reduce_axes), tally)
    return failures


def embedding(arrays, tally) -> list[str]:
    ids = arrays["embedding/ids"].astype(np.int64)
    w = arrays["embedding/in0"].astype(np.float64)
    dout = arrays["embedding/dout"].astype(np.float64).reshape(-1, w.shape[1])
    grad, mag = np.zeros_like(w), np.zeros_like(w)
    np.add.at(grad, ids.ravel(), dout)
    np.add.at(mag, ids.ravel(), np.abs(dout))
    return (check("embedding", arrays["embedding/out"], w[ids], 0.0, tally)
            + check("embedding dweight", arrays["embedding/grad0"], grad, gamma(ids.size) * mag, tally))


def test_fp32_to_bf16_cast_rounds_to_nearest_even(device):
    """Exactly: the cast is one rounding of an fp32 value (ties included: 1 + 2**-8 -> 1, 1 + 3 * 2**-8 -> 1 + 2**-6)."""
    _, arrays = device
    values, got = arrays["cast/in0"], arrays["cast/out"]
    want = to_bf16(values)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:10]
    assert got[-5:].tolist() == [1.0, 1.015625, -1.0, 2.0, 1.0078125]


def adamw_reference(p, grads, master: bool):
    """AdamW (decoupled weight decay 0.1, lr 1e-2, betas 0.9/0.999, eps 1e-8) in float64, bias-corrected."""
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    m = v = np.zeros_like(p)
    out = []
    for step, g in enumerate(grads, 1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**step)) / (np.sqrt(v / (1 - b2**step)) + eps)
        out.append(p)
    return out


def test_adamw_with_and_without_master_weights_equals_a_float64_reference(device):
    """The update of a bf16 parameter: with fp32 master weights (two steps; the master held to 1e-6 of the
    step size, the bf16 parameter equal to the master rounded once) and without (the update computed in
    fp32 from the bf16 parameter, rounded once; moments start at zero so they are exact in the first step)."""
    _, arrays = device
    p0 = arrays["adamw_master/param0"].astype(np.float64)
    grads = [arrays[f"adamw_master/grad{i}"].astype(np.float64) for i in range(2)]
    for step, want in enumerate(adamw_reference(p0, grads, True), 1):
        master = arrays[f"adamw_master/master{step}"]
        # fp32 state and arithmetic over two steps: a few fp32 roundings of |p| plus of the step (lr)
        np.testing.assert_allclose(master, want, rtol=0, atol=float(C * U * (np.abs(p0).max() + 1e-2 * step)),
                                   err_msg=f"master weight after step {step}")
        assert np.array_equal(arrays[f"adamw_master/param{step}"], to_bf16(master)), f"bf16 parameter, step {step}"
    p0 = arrays["adamw_plain/param0"].astype(np.float64)
    [want] = adamw_reference(p0, [arrays["adamw_plain/grad0"].astype(np.float64)], False)
    tally = {"elements": 0, "ambiguous": 0}
    failures = check("adamw without master weights", arrays["adamw_plain/param1"], want, C * U * (np.abs(p0) + 1e-2), tally)
    assert not failures, failures
