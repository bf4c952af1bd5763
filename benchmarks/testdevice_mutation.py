"""Mutation check of the Paddle CPU test device's tests (issue 35; docs/testdevice.md): plants each bug of
MUTATIONS in a scratch copy of adapters/paddle/testdevice, builds that copy into a scratch plugin directory
(scripts/build_testdevice.sh with XFW_TESTDEVICE_SRC and XFW_TESTDEVICE_DIR; .venv/paddle's plugin is not
touched), runs the tests that should catch it against that plugin, and reports each mutation killed (some
test failed) or survived. An unmutated copy runs first and must pass, or nothing is reported. Not part of
``make test``: about 1 to 2 minutes a mutation on 2 cores.

    .venv/torch/bin/python benchmarks/testdevice_mutation.py [--out results/cpu/testdevice-mutation]
        [--only NAME ...] [--sharding]

``--sharding`` also runs tests/contract/test_paddle_sharding.py's test-device tests for each mutation
(tens of minutes each). Writes ``mutation.json`` and ``mutation.md`` under ``--out``; exit 1 if any
mutation survived or the unmutated copy failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "adapters" / "paddle" / "testdevice"
PY = ROOT / ".venv" / "torch" / "bin" / "python"
FAST = ["tests/contract/test_testdevice.py", "tests/contract/test_testdevice_reference.py",
        "tests/contract/test_testdevice_collectives.py", "tests/contract/test_testdevice_kernels.py"]
KERNELS = ("tests/contract/test_testdevice_kernels.py",)
COLLECTIVES = ("tests/contract/test_testdevice_collectives.py",)
SHARDING = ["tests/contract/test_paddle_sharding.py", "-k", "testcpu or stage or decorate"]


@dataclass
class Mutation:
    name: str
    what: str
    file: str
    old: str
    new: str
    origin: str = "added"  # "issue 35" for the five the issue lists
    tests: tuple = ()  # the test files meant to kill it (issue 43's); empty: every FAST file


MUTATIONS = [
    Mutation("matmul_truncate", "bf16 matmul output truncated toward zero instead of rounded to nearest even",
             "kernels_matmul.cc",
             "  out->set_dtype(x.dtype());\n  StoreF32(ctx, out, o.data(), static_cast<int64_t>(o.size()));",
             "  out->set_dtype(x.dtype());\n"
             "  if (x.dtype() == PD_DataType::BFLOAT16)\n"
             "    for (auto& v : o) { uint32_t u; std::memcpy(&u, &v, 4); u &= 0xffff0000u; std::memcpy(&v, &u, 4); }\n"
             "  StoreF32(ctx, out, o.data(), static_cast<int64_t>(o.size()));", "issue 35"),
    Mutation("matmul_drop_last_term", "bf16/fp32 matmul forward drops the last inner term when K > 16",
             "kernels_matmul.cc",
             "    for (int64_t m = 0; m < M; ++m)\n      for (int64_t k = 0; k < K; ++k) {\n        float av = pa[m * K + k];\n"
             "        for (int64_t n = 0; n < N; ++n) po",
             "    for (int64_t m = 0; m < M; ++m)\n      for (int64_t k = 0; k < (K > 16 ? K - 1 : K); ++k) {\n"
             "        float av = pa[m * K + k];\n        for (int64_t n = 0; n < N; ++n) po", "issue 35"),
    Mutation("adamw_no_bias_correction_master", "AdamW without bias correction, only with master weights",
             "kernels_inplace.cc",
             "    float lr_t = lr * std::sqrt(1.f - b2p) / (1.f - b1p);\n    float eps_t = eps * std::sqrt(1.f - b2p);",
             "    float lr_t = use_master ? lr : lr * std::sqrt(1.f - b2p) / (1.f - b1p);\n"
             "    float eps_t = use_master ? eps : eps * std::sqrt(1.f - b2p);", "issue 35"),
    Mutation("avg_divides_by_n_plus_1", "AVG reductions divide by n + 1", "collectives.cc",
             "if (op == AVG) acc = acc / static_cast<decltype(acc)>(n);",
             "if (op == AVG) acc = acc / static_cast<decltype(acc)>(n + 1);", "issue 35"),
    Mutation("stale_gather_rank1", "rank 1 reuses the first all_gather result of each size and dtype (stale "
             "gathered parameters under stage 3)", "collectives.cc",
             "    if (count == 0) break;\n  }\n  return true;\n}",
             "    if (count == 0) break;\n  }\n"
             "  static std::string seen_key[64], seen_val[64];\n  static int seen = 0;\n"
             "  if (c->rank == 1) {\n    std::string key = std::to_string(count) + \":\" + std::to_string(int(t));\n"
             "    size_t bytes = size_t(c->nranks) * count * es;\n    int i = 0;\n"
             "    while (i < seen && seen_key[i] != key) ++i;\n"
             "    if (i < seen) std::memcpy(recv, seen_val[i].data(), bytes);\n"
             "    else if (seen < 64) { seen_key[seen] = key; seen_val[seen++].assign(static_cast<char*>(recv), bytes); }\n"
             "  }\n  return true;\n}", "issue 35"),
    Mutation("bf16_store_truncates", "every bf16 store truncates (round toward zero) instead of nearest even",
             "dtype.h", "  u += 0x7fffu + ((u >> 16) & 1u);\n", ""),
    Mutation("layer_norm_unbiased_variance", "layer_norm divides the squared deviations by n - 1", "kernels_norm.cc",
             "float var_r = static_cast<float>(s2 / cols)", "float var_r = static_cast<float>(s2 / (cols - 1))"),
    Mutation("gelu_grad_no_pdf_term", "exact GELU's gradient without its x * pdf(x) term", "kernels_math.cc",
             "  return 0.5f * (1.f + std::erf(x * float(M_SQRT1_2))) + x * std::exp(-0.5f * x * x) * 0.3989422804014327f;",
             "  return 0.5f * (1.f + std::erf(x * float(M_SQRT1_2)));"),
    Mutation("softmax_grad_fp32_dot_rounded", "softmax_grad rounds its inner sum to bf16 before use",
             "kernels_math.cc", "      for (int64_t k = 0; k < len; ++k) { int64_t i = (o * len + k) * inner + in; d[i] = y[i] * (g[i] - dot); }",
             "      dot = BF16BitsToFloat(FloatToBF16Bits(dot));\n"
             "      for (int64_t k = 0; k < len; ++k) { int64_t i = (o * len + k) * inner + in; d[i] = y[i] * (g[i] - dot); }"),
    Mutation("reduce_scatter_wrong_block", "reduce_scatter gives every rank block 0", "collectives.cc",
             "srcs[r] = Slot(c, r) + size_t(c->rank) * n * es;", "srcs[r] = Slot(c, r);"),
    Mutation("adamw_plain_no_weight_decay", "AdamW without master weights skips the decoupled weight decay",
             "kernels_inplace.cc", "      if (decay != 0.f) pi -= lr * decay * pi;",
             "      if (decay != 0.f && use_master) pi -= lr * decay * pi;"),
    Mutation("silu_grad_sign", "SiLU's gradient with (1 + x * s) instead of (1 + x * (1 - s))", "kernels_math.cc",
             "return g * s * (1.f + v * (1.f - s));", "return g * s * (1.f + v * s);"),
    # issue 43: kernels the models reach that had no independent case, special values, fp16, the same-kernel
    # blind spot, shapes the models use, collectives over one slot and on 3 ranks
    Mutation("triu_diagonal_off_by_one", "triu keeps c - r > diagonal (a causal mask one diagonal short)",
             "kernels_shape.cc", "(c - r >= diagonal)", "(c - r > diagonal)", "issue 43", KERNELS),
    Mutation("softmax_no_max_subtraction", "softmax exponentiates the raw logits (overflows past ~88)",
             "kernels_math.cc", "e = std::exp(e - mx); s += e;", "e = std::exp(e); s += e;", "issue 43", KERNELS),
    Mutation("embedding_grad_overwrites", "embedding_grad stores instead of accumulating repeated ids (fp32 and "
             "bf16 alike: the same-kernel blind spot)", "kernels_math.cc",
             "acc[id * dim + c] += g[i * dim + c];", "acc[id * dim + c] = g[i * dim + c];", "issue 43", KERNELS),
    Mutation("squared_l2_norm_skips_last", "bf16/fp16 squared_l2_norm (clipping without master weights) skips "
             "the last element", "kernels_norm.cc", "for (int64_t i = 0, n = x.numel(); i < n; ++i) s +=",
             "for (int64_t i = 0, n = x.numel(); i + 1 < n; ++i) s +=", "issue 43", KERNELS),
    Mutation("conv_same_extra_first", "SAME padding with an odd total puts the extra row/column first",
             "kernels_conv.cc", "    before = static_cast<int>(pad / 2);\n    after = static_cast<int>(pad - pad / 2);",
             "    before = static_cast<int>(pad - pad / 2);\n    after = static_cast<int>(pad / 2);", "issue 43", KERNELS),
    Mutation("fp16_double_rounding", "fp16 stores round through bf16 first", "kernels.h",
             "h.x = FloatToF16Bits(v); return h;", "h.x = FloatToF16Bits(BF16BitsToFloat(FloatToBF16Bits(v))); return h;",
             "issue 43", KERNELS),
    Mutation("bf16_overflow_saturates", "fp32 -> bf16 saturates at the largest finite value instead of inf",
             "dtype.h", "  u += 0x7fffu + ((u >> 16) & 1u);\n  return uint16_t(u >> 16);",
             "  u += 0x7fffu + ((u >> 16) & 1u);\n"
             "  if (((u >> 16) & 0x7f80u) == 0x7f80u) return uint16_t(((u >> 16) & 0x8000u) | 0x7f7fu);\n"
             "  return uint16_t(u >> 16);", "issue 43", KERNELS),
    Mutation("fp64_unary_in_fp32", "fp64 sqrt/square/exp (global-norm clipping) computed in fp32", "kernels_math.cc",
             "p[i] = St<T>(f(Ld(px[i])));", "p[i] = St<T>(f(static_cast<float>(Ld(px[i]))));", "issue 43", KERNELS),
    Mutation("add_grad_dx_stored_first", "add/subtract/multiply/divide_grad store dx before reading dout for dy "
             "(dx may share dout's memory; found by issue 43's cases and fixed)", "kernels_inplace.cc",
             "  std::vector<C<T>> ay = GradAcc<T>(x, y, dout, false, dy, gy, reads_inputs);\n"
             "  for (auto [d, self, acc] : {std::make_tuple(dx, &x, &ax), std::make_tuple(dy, &y, &ay)}) {",
             "  if (dx) { dx->Resize(x.dims()); T* q = ctx.Alloc<T>(dx); for (size_t i = 0; i < ax.size(); ++i) q[i] = St<T>(ax[i]); }\n"
             "  std::vector<C<T>> ay = GradAcc<T>(x, y, dout, false, dy, gy, reads_inputs);\n"
             "  for (auto [d, self, acc] : {std::make_tuple(dy, &y, &ay)}) {", "issue 43", KERNELS),
    Mutation("reduce_two_ranks_only", "reductions combine ranks 0 and 1 only (right on 2 ranks, wrong on 3)",
             "collectives.cc", "    for (int r = 1; r < n; ++r) {\n      auto v = ToAcc(",
             "    for (int r = 1; r < n && r < 2; ++r) {\n      auto v = ToAcc(", "issue 43", COLLECTIVES),
    Mutation("broadcast_no_closing_barrier", "broadcast without its closing barrier: the root may overwrite its "
             "slot (next chunk, next call) before peers read it", "collectives.cc",
             "    if (c->rank != root) std::memcpy(part, Slot(c, root), n * es);\n    Barrier(c);\n",
             "    if (c->rank != root) std::memcpy(part, Slot(c, root), n * es);\n", "issue 43", COLLECTIVES),
    Mutation("all_gather_chunk_offset", "all_gather writes every chunk of a rank's block at the block's start "
             "(right below one slot)", "collectives.cc", "(size_t(r) * count + done) * es", "(size_t(r) * count) * es",
             "issue 43", COLLECTIVES),
    Mutation("reduce_chunk_offset", "all_reduce/reduce write every chunk at the start of the output", "collectives.cc",
             "c->rank) ok = Reduce(t, static_cast<char*>(recv) + done * es,", "c->rank) ok = Reduce(t, static_cast<char*>(recv),",
             "issue 43",
             COLLECTIVES),

]


def run(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def tests_for(sharding: bool, files: tuple = ()) -> list[list[str]]:
    return [list(files) or FAST] + ([SHARDING] if sharding else [])


def try_source(src: Path, out: Path, sharding: bool, files: tuple = ()) -> dict:
    """Build ``src`` into ``out`` and run the tests against it: what failed, or the build's error."""
    env = {**os.environ, "XFW_TESTDEVICE_SRC": str(src), "XFW_TESTDEVICE_DIR": str(out)}
    start = time.monotonic()
    built = run(["bash", "scripts/build_testdevice.sh"], env, 900)
    if built.returncode != 0:
        return {"build": "failed", "error": built.stderr[-1500:], "seconds": round(time.monotonic() - start, 1)}
    failed, passed = [], 0
    for selection in tests_for(sharding, files):
        done = run([str(PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *selection], env, 3600)
        failed += sorted(set(re.findall(r"^FAILED (\S+)", done.stdout, re.M)))
        failed += sorted(set(re.findall(r"^ERROR (\S+)", done.stdout, re.M)))
        m = re.search(r"(\d+) passed", done.stdout)
        passed += int(m.group(1)) if m else 0
        if done.returncode not in (0, 1):  # 1: tests failed; anything else: pytest itself failed
            failed.append(f"pytest exit {done.returncode}: {done.stdout[-500:]}")
        if failed:
            break
    return {"build": "ok", "failed": failed, "passed": passed, "seconds": round(time.monotonic() - start, 1)}


def environment() -> dict:
    def first_line(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "unknown"
    return {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "paddle": first_line([str(ROOT / ".venv/paddle/bin/python"), "-c", "import paddle; print(paddle.__version__)"]),
            "torch": first_line([str(PY), "-c", "import torch; print(torch.__version__)"]),
            "compiler": first_line([os.environ.get("CXX", "g++"), "--version"]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def markdown(report: dict) -> str:
    lines = ["# Mutation check of the CPU test device's tests", "",
             f"Command: `{report['command']}`  ", f"Environment: {json.dumps(report['environment'])}  ",
             f"Tests run per mutation (stopping at the first failure): {', '.join(' '.join(s) for s in report['tests'])}",
             "", f"Unmutated copy: {report['baseline']['passed']} passed, "
             f"failed: {report['baseline']['failed'] or 'none'} ({report['baseline']['seconds']} s)", "",
             "| mutation | from | file | what | result | first failing test | s |", "|---|---|---|---|---|---|---:|"]
    for r in report["mutations"]:
        first = r["failed"][0] if r.get("failed") else (r.get("error", "")[:80] if r["build"] != "ok" else "")
        lines.append(f"| {r['name']} | {r['origin']} | {r['file']} | {r['what']} | **{r['result']}** | "
                     f"{first.replace('|', '/')} | {r['seconds']} |")
    killed = sum(r["result"] == "killed" for r in report["mutations"])
    lines += ["", f"{killed} of {len(report['mutations'])} killed."
              + (" (partial: the run was cut short after these)" if report.get("partial") else "")]
    return "\n".join(lines) + "\n"


def write(args, argv, union, baseline, results, partial: bool) -> dict:
    """The report so far (after every mutation, so a run cut short keeps what it measured), atomically."""
    report = {"command": " ".join([".venv/torch/bin/python", "benchmarks/testdevice_mutation.py", *argv]),
              "environment": environment(), "tests": tests_for(args.sharding, union), "baseline": baseline,
              "mutations": results, "partial": partial}
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("mutation.json", json.dumps(report, indent=1) + "\n"), ("mutation.md", markdown(report))):
        (out / (name + ".tmp")).write_text(text)
        (out / (name + ".tmp")).replace(out / name)
    return report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/cpu/testdevice-mutation")
    ap.add_argument("--only", nargs="*", help="mutation names (default: all)")
    ap.add_argument("--sharding", action="store_true", help="also run test_paddle_sharding.py's test-device tests")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or []) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutations: {sorted(unknown)}")
    for m in chosen:  # before anything is built: each text to mutate occurs exactly once
        count = (SRC / m.file).read_text().count(m.old)
        if count != 1:
            ap.error(f"{m.name}: the text to mutate occurs {count} times in {m.file}")
    with tempfile.TemporaryDirectory(prefix="xfw-mutation-") as scratch:
        scratch = Path(scratch)
        plugin = scratch / "plugin"  # one directory: unchanged objects are reused between mutants
        src = scratch / "src"
        shutil.copytree(SRC, src)
        print("unmutated copy ...", flush=True)
        # the unmutated copy runs every file any chosen mutation runs
        union = tuple(sorted({f for m in chosen for f in (m.tests or FAST)}))
        baseline = try_source(src, plugin, args.sharding, union)
        print(f"  {baseline}", flush=True)
        results = []
        if baseline["build"] == "ok" and not baseline["failed"]:
            for m in chosen:
                shutil.rmtree(src)
                shutil.copytree(SRC, src)
                path = src / m.file
                text = path.read_text()
                assert text.count(m.old) == 1, f"{m.name}: the text to mutate occurs {text.count(m.old)} times in {m.file}"
                path.write_text(text.replace(m.old, m.new))
                print(f"{m.name} ...", flush=True)
                got = try_source(src, plugin, args.sharding, m.tests)
                result = "killed" if got["build"] != "ok" or got["failed"] else "survived"
                if got["build"] != "ok":
                    result = "build failed (not a valid mutant)"
                results.append({"name": m.name, "origin": m.origin, "file": m.file, "what": m.what, "result": result,
                                "tests": list(m.tests) or FAST, **got})
                print(f"  {result}: {got.get('failed') or got.get('error', '')[:300]} ({got['seconds']} s)", flush=True)
                write(args, argv, union, baseline, results, partial=len(results) < len(chosen))
    report = write(args, argv, union, baseline, results, partial=False)
    print(markdown(report))
    ok = baseline["build"] == "ok" and not baseline["failed"] and all(r["result"] == "killed" for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
