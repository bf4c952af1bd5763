"""Every device kernel the tiny families reach, in every dtype they reach it in, against float64
(issue 43; docs/testdevice.md "Which kernels the models reach").

The cases run on ``testcpu`` in tests/contract/testdevice_cases.py (bf16, fp16, fp32, and the fp64, int and
bool kernels the runs reach), with special values (+-inf, NaN, values past bf16's and fp16's range,
denormals, softmax logits near 1000 and -inf masks), strided and transposed inputs and broadcasts on
either side. Each output and input gradient is recomputed here in float64 with PyTorch from the exact
values the kernel read, and held to the device's promise "computed in fp32 (fp64 for fp64), rounded once
to nearest even into its dtype": with ``e`` a bound on the compute-precision error, the stored value lies
in ``[round(ref - e), round(ref + e)]`` (rounding is monotone; the same argument as
test_testdevice_reference.py, whose ``gamma`` and constant ``C`` are used). Non-finite references must be
matched exactly (NaN where NaN, the same infinity). fp16 is rounded with fp16's own rounding (11 bits,
overflow past 65504 to inf), not bf16's.

``test_every_reached_kernel_has_an_independent_case`` holds results/cpu/testdevice-mutation/reached.json
(what benchmarks/testdevice_coverage.py recorded the families calling) to these cases and to
test_testdevice_reference.py's: a reached kernel and dtype with no case here, or a case whose kernel the
device never ran (``XFW_TESTCPU_KERNEL_LOG``), fails.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from conftest import ROOT
from test_testdevice import device_env, run_worker  # noqa: F401  (the fixture is shared)
from test_testdevice_reference import C, adamw_reference, to_bf16

pytestmark = pytest.mark.contract

F = torch.nn.functional
REACHED = ROOT / "results" / "cpu" / "testdevice-mutation" / "reached.json"
SRC = ROOT / "adapters" / "paddle" / "testdevice"
UNIT = {"bfloat16": 2.0**-24, "float16": 2.0**-24, "float32": 2.0**-24, "float64": 2.0**-53}
# kernels test_testdevice_reference.py checks (bf16 only) besides the cases here
ELSEWHERE = {("adamw", "bfloat16"): "test_testdevice_reference.py adamw_master/adamw_plain"}


def gamma(k: int, u: float = 2.0**-24) -> float:
    """Higham's gamma_k for unit roundoff u (fp32 by default; fp64 kernels pass 2**-53)."""
    return k * u / (1 - k * u)


def rnd(x, dtype: str) -> np.ndarray:
    """float64 -> the device's dtype by its rounding (fp32 first, then bf16/fp16 to nearest even)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
        if dtype == "bfloat16":
            return to_bf16(f).astype(np.float64)
        if dtype == "float16":
            return f.astype(np.float16).astype(np.float64)
        return f.astype(np.float64)


@pytest.fixture(scope="module")
def cases(device_env, tmp_path_factory):
    python, env = device_env
    out = tmp_path_factory.mktemp("kernel_cases")
    log = out / "hits.log"
    [meta] = run_worker((python, dict(env, XFW_TESTCPU_KERNEL_LOG=str(log))), out, "kernel_cases")
    with np.load(out / "kernel_cases.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return meta, arrays, hits(log.read_text())


def kernel_names() -> dict[str, str]:
    names = {}
    for path in sorted(SRC.glob("kernels_*.cc")):
        for name, fn in re.findall(r"PD_BUILD_PHI_KERNEL\((\w+), testcpu, ALL_LAYOUT, (\w+),", path.read_text()):
            names[fn] = name
    return names


def hits(text: str) -> set[tuple[str, str]]:
    names = kernel_names()
    return {(names.get(fn, fn), dt) for fn, dt in (line.split() for line in text.splitlines() if line.strip())}


def check(name, got, ref, e, dtype, failures, tally):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64).reshape(np.shape(got))
    e = np.broadcast_to(np.nan_to_num(np.asarray(e, np.float64), nan=0.0, posinf=0.0), ref.shape)
    finite = np.isfinite(ref)
    with np.errstate(invalid="ignore"):
        lo, hi = rnd(np.where(finite, ref - e, 0), dtype), rnd(np.where(finite, ref + e, 0), dtype)
        bad = np.where(finite, ~((got >= lo) & (got <= hi)),
                       ~((np.isnan(ref) & np.isnan(got)) | (got == ref)))
    # bf16/fp16 only: in fp32/fp64 the bound spans several values by design (C units of the dtype); the norms' dx
    # (sums over the row of terms the bound takes at their largest) are held tightly in bf16 by
    # test_testdevice_reference.py and here only by the bound
    if dtype in ("bfloat16", "float16") and not name.endswith("norm dx"):
        tally["elements"] += got.size
        tally["ambiguous"] += int((finite & (lo != hi)).sum())
    if bad.any():
        i = np.unravel_index(np.argmax(bad), got.shape)
        failures.append(f"{name}: {int(bad.sum())} of {got.size} outside the bound, e.g. at {tuple(map(int, i))}: "
                        f"device {got[i]!r}, exact {ref[i]!r}, allowed [{lo[i]!r}, {hi[i]!r}]")


def t64(a, grad=True):
    return torch.tensor(np.asarray(a, np.float64), requires_grad=grad)


def autograd(fn, ins, dout):
    xs = [t64(a) for a in ins]
    y = fn(*xs)
    if dout is None:
        return y.detach().numpy(), []
    gs = torch.autograd.grad(y, xs, torch.tensor(dout), allow_unused=True)
    return y.detach().numpy(), [None if g is None else g.numpy() for g in gs]


def _mask():
    return torch.tensor(np.arange(64).reshape(4, 16) % 3 == 0)


# sums of products (and divide): bound gamma(K) * the same op and its gradient on absolute values (every
# term of a sum then has one sign, so that is the sum of the terms' magnitudes)
LINEAR = {
    "add_bcast": torch.add, "add_bcast_left": torch.add, "subtract_bcast": torch.sub,
    "subtract_bcast_left": torch.sub, "multiply_bcast": torch.mul, "multiply_bcast_left": torch.mul,
    "add_special": torch.add, "multiply_special": torch.mul,
    "maximum_bcast": torch.maximum, "maximum_bcast_left": torch.maximum,
    "minimum_bcast": torch.minimum, "minimum_bcast_left": torch.minimum,
    "where": lambda a, b: torch.where(_mask(), a, b),
    "expand": lambda a: a.expand(2, 3, 4), "concat": lambda a, b: torch.cat([a, b], 1),
    "pad3d_constant": lambda a: F.pad(a, [1, 2, 0, 1, 2, 0], value=0.5),
    "pad3d_replicate": lambda a: F.pad(a, [1, 2, 0, 1, 2, 0], mode="replicate"),
    "conv2d_same_odd": lambda a, w: F.conv2d(F.pad(a, [0, 1, 0, 1]), w),  # SAME, odd totals: the extra on the end
    "conv2d_strided": lambda a, w: F.conv2d(a, w, stride=2, padding=1, groups=2),
    "conv3d": lambda a, w: F.conv3d(a, w, stride=(2, 3, 3)),
    "triu": lambda a: torch.triu(a, 1), "tril": lambda a: torch.tril(a, -1),
    "sum": lambda a: a.sum((0, 2)), "sum_all": lambda a: a.sum(), "add_self": lambda a: a + a, "mean": lambda a: a.mean(1, keepdim=True),
    "matmul_bcast_left": torch.matmul, "matmul_t": lambda a, b: a.transpose(-1, -2) @ b.transpose(-1, -2),
    "scale": lambda a: a * 0.37 + 0.11, "add_n": lambda a, b, c=None: a + b + (0 if c is None else c),
    "transpose_contiguous": lambda a: a.permute(2, 0, 1) if a.dim() == 3 else a.T,
    "strided_write": lambda a, b: torch.cat([a[:, :1], b, a[:, 4:]], 1),
    "squared_l2_norm": lambda a: (a * a).sum().reshape(1), "clip": lambda a: a.clamp(-1.0, 1.5),
    "divide_bcast": torch.div, "divide_bcast_left": torch.div, "div_scale": lambda a: a / 3.0, "square": torch.square,
}
# nonlinear: (reference, magnitude of the output's intermediates, of the gradient's per unit |dout|)
NONLINEAR = {
    "gelu": (F.gelu, lambda a: abs(a) + 1, lambda a: (1 + abs(a)) ** 3),
    "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"), lambda a: abs(a) * (1 + a * a) + 1, lambda a: (1 + abs(a)) ** 4),
    "silu": (F.silu, lambda a: abs(a) + 1, lambda a: (1 + abs(a)) ** 2),
    "relu": (F.relu, lambda a: 0 * a, lambda a: 0 * a),  # exact: a copy or a zero
    "sigmoid": (torch.sigmoid, lambda a: 1 + 0 * a, lambda a: 1 + 0 * a),
    "tanh": (torch.tanh, lambda a: 1 + 0 * a, lambda a: 1 + 0 * a),
    "exp": (torch.exp, np.exp, np.exp),
    "sqrt": (torch.sqrt, np.sqrt, lambda a: 1 / np.sqrt(a)),
    "rsqrt": (torch.rsqrt, lambda a: a**-0.5, lambda a: a**-1.5),
    "pow": (lambda a: a**3, lambda a: abs(a) ** 3, lambda a: 3 * a * a + 1),
    "sin": (torch.sin, lambda a: 1 + abs(a), lambda a: 1 + abs(a)),
    "cos": (torch.cos, lambda a: 1 + abs(a), lambda a: 1 + abs(a)),
    "erf": (torch.erf, lambda a: 1 + 0 * a, lambda a: 1 + a * a),
    "swiglu": (lambda a, b: F.silu(a) * b, lambda a, b: (1 + abs(a)) * abs(b), lambda a, b: (1 + abs(a)) ** 2 * (1 + abs(b))),
    "slice_exp": (lambda a: torch.exp(a[:, 1:8:3]), lambda a: np.exp(a[:, 1:8:3]), None),
}


def run_case(key, meta, arrays, failures, tally):
    dtype, name = key.split(":", 1)
    out_dtype = meta["out_dtype"]
    ins = [arrays[f"{key}/in{i}"] for i in range(4) if f"{key}/in{i}" in arrays]
    got = arrays.get(f"{key}/out")
    dout = arrays.get(f"{key}/dout")
    u = UNIT.get(dtype, 0.0)
    if name.startswith("cast_to_") or name in ("full", "full_like", "fill", "assign"):
        want = {"full": lambda: np.full(got.shape, -2.5e-3 if dtype in UNIT else 1.0),
                "full_like": lambda: np.full(got.shape, 7.1e-2), "fill": lambda: np.full(got.shape, 0.3),
                "assign": lambda: ins[0]}.get(name, lambda: ins[0])()
        target = name[len("cast_to_"):] if name.startswith("cast_to_") else dtype
        return check(key, got, rnd(want, target) if target in UNIT else want, 0.0, target, failures, tally)
    if name == "embedding":
        ids = arrays[f"{key}/ids"].astype(np.int64)
        check(key, got, ins[0][ids], 0.0, dtype, failures, tally)
        grad, mag = np.zeros_like(ins[0]), np.zeros_like(ins[0])
        np.add.at(grad, ids.ravel(), dout.reshape(-1, ins[0].shape[1]))
        np.add.at(mag, ids.ravel(), np.abs(dout).reshape(-1, ins[0].shape[1]))
        return check(key + " dweight", arrays[f"{key}/grad0"], grad, gamma(ids.size) * mag, dtype, failures, tally)
    if name in ("softmax", "layer_norm", "group_norm"):
        return normalising(key, name, dtype, ins, got, dout, arrays, failures, tally)
    if name == "adamw_master":
        p0, g = arrays[f"{key}/param0"], arrays[f"{key}/grad0"]
        [want] = adamw_reference(p0, [g], True)
        np.testing.assert_allclose(arrays[f"{key}/master1"], want, rtol=0, atol=float(C * u * (np.abs(p0).max() + 1e-2)))
        return check(key + " param", arrays[f"{key}/param1"], arrays[f"{key}/master1"], 0.0, dtype, failures, tally)
    if name in LINEAR:
        fn = LINEAR[name]
        k = max(a.size for a in ins)
        ref, grads = autograd(fn, ins, dout)
        with np.errstate(invalid="ignore", over="ignore"):
            mag, mgrads = autograd(fn, [np.abs(a) for a in ins], None if dout is None else np.abs(dout))
        check(key, got, ref, (gamma(k, u) + C * u) * np.abs(mag), out_dtype, failures, tally)
        for i, g in enumerate(grads):
            if f"{key}/grad{i}" in arrays and g is not None:
                check(f"{key} d{i}", arrays[f"{key}/grad{i}"], g, (gamma(k, u) + C * u) * np.abs(mgrads[i]), dtype,
                      failures, tally)
        return None
    fn, m_out, m_grad = NONLINEAR[name]
    ref, grads = autograd(fn, ins, dout)
    check(key, got, ref, C * u * m_out(*ins), out_dtype, failures, tally)
    if dout is None:
        return None
    from_output = {"sigmoid": lambda y, g: g * y * (1 - y), "tanh": lambda y, g: g * (1 - y * y),
                   "exp": lambda y, g: g * y, "rsqrt": lambda y, g: -0.5 * g * y**3, "sqrt": lambda y, g: 0.5 * g / y,
                   "relu": lambda y, g: g * (y > 0)}
    for i, g in enumerate(grads):
        if name in from_output:  # these gradient kernels read the stored (rounded) output, not the input
            g = from_output[name](got, dout)
        e = C * u * np.abs(dout) * (m_grad(*ins) + np.abs(g) / np.maximum(np.abs(dout), 1e-30))
        check(f"{key} d{i}", arrays[f"{key}/grad{i}"], g, e, dtype, failures, tally)
    return None


def normalising(key, name, dtype, ins, got, dout, arrays, failures, tally):
    u = UNIT[dtype]
    if name == "softmax":
        x = ins[0]
        ref = torch.softmax(torch.tensor(x), -1).numpy()
        check(key, got, ref, 2 * C * u * ref, dtype, failures, tally)  # exp and the row sum: relative errors
        y = got  # the gradient kernel reads the stored output
        g = y * (dout - (dout * y).sum(-1, keepdims=True))
        e = C * u * x.shape[-1] * y * (np.abs(dout) + (np.abs(dout) * y).sum(-1, keepdims=True))
        return check(key + " dx", arrays[f"{key}/grad0"], g, e, dtype, failures, tally)
    x, w, b = ins
    if name == "layer_norm":
        fn, n, wshape = (lambda a, ww, bb: F.layer_norm(a, [x.shape[-1]], ww, bb, eps=1e-5)), x.shape[-1], (1, -1)
    else:
        fn, n, wshape = (lambda a, ww, bb: F.group_norm(a, 4, ww, bb, eps=1e-5)), x.size // x.shape[0] // 4, (1, -1, 1, 1)
    ref, grads = autograd(fn, [x, w, b], dout)
    rows = x.reshape(-1, n)
    inv = 1 / np.sqrt(rows.var(-1, keepdims=True) + 1e-5)
    scale = np.broadcast_to((np.abs(rows).max(-1, keepdims=True) + 1) * inv, rows.shape).reshape(x.shape)
    ww = np.broadcast_to(np.abs(w).reshape(wshape), x.shape)
    check(key, got, ref, C * u * (scale * ww + np.abs(b).reshape(wshape)), dtype, failures, tally)
    gmag = np.broadcast_to((np.abs(dout) * ww).reshape(-1, n).sum(-1, keepdims=True), rows.shape).reshape(x.shape)
    check(key + " dx", arrays[f"{key}/grad0"], grads[0], C * u * n * scale * (np.abs(dout) * ww + gmag), dtype,
          failures, tally)
    axes = tuple(i for i in range(x.ndim) if wshape[i] == 1)
    check(key + " dscale", arrays[f"{key}/grad1"], grads[1], (n + C) * u * x.size / w.size * (np.abs(dout) * scale).sum(axis=axes)
          / (x.size / w.size), dtype, failures, tally)
    check(key + " dbias", arrays[f"{key}/grad2"], grads[2], gamma(x.size) * np.abs(dout).sum(axis=axes), dtype,
          failures, tally)
    return None


def test_every_case_against_float64(cases):
    meta, arrays, _ = cases
    failures, tally = [], {"elements": 0, "ambiguous": 0}
    for key in meta:
        if meta[key]["dtype"] in ("int64", "int32", "bool"):
            continue
        run_case(key, meta[key], arrays, failures, tally)
    print(f"kernel cases: {len(meta)} cases, {tally['elements']} elements, {tally['ambiguous']} ambiguous")
    assert not failures, "\n".join(failures)
    assert tally["ambiguous"] < 0.1 * tally["elements"], tally  # bf16/fp16: nearly "the correctly rounded value"


def test_integer_and_bool_kernels_are_exact(cases):
    meta, arrays, _ = cases
    expect = {"int64:multiply": lambda a, b: a * b, "int64:scale": lambda a: a * 3 + 2, "int64:full": lambda: 1,
              "int32:full": lambda: 1, "bool:full": lambda: 1, "int64:cast_to_float32": lambda a: rnd(a, "float32"),
              "bool:cast_to_float32": lambda a: a, "bool:tril": lambda a: np.tril(a),
              "int64:transpose_contiguous": lambda a: a.T}
    assert {k for k, m in meta.items() if m["dtype"] in ("int64", "int32", "bool")} == set(expect)
    for key, fn in expect.items():
        ins = [arrays[f"{key}/in{i}"] for i in range(3) if f"{key}/in{i}" in arrays]
        np.testing.assert_array_equal(arrays[f"{key}/out"], np.broadcast_to(fn(*ins), arrays[f"{key}/out"].shape),
                                      err_msg=key)


def test_every_reached_kernel_has_an_independent_case(cases):
    """reached.json's kernels x dtypes (the families' runs) each have a case here, or in ELSEWHERE, and every
    kernel a case names ran on the device in that dtype (not a CPU fallback)."""
    meta, _, ran = cases
    declared = {(k, m["dtype"]) for m in meta.values() for k in m["kernels"]}
    missing_run = sorted(declared - ran)
    assert not missing_run, f"cases name kernels the device never ran: {missing_run}"
    reached = json.loads(REACHED.read_text())["reached"]
    pairs = {(k, dt) for k, dts in reached.items() for dt in dts}
    unchecked = sorted(p for p in pairs - declared if p not in ELSEWHERE)
    assert not unchecked, f"reached by the tiny families, no independent case: {unchecked}"
