// Shared helpers of the test device's kernels (kernels.h).
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "kernels.h"

namespace xfw_testcpu {

std::vector<float> ToF32(const phi::DenseTensor& t) {
  int64_t n = t.numel();
  std::vector<float> v(n);
  switch (t.dtype()) {
    case PD_DataType::FLOAT32: std::memcpy(v.data(), t.data<float>(), n * 4); break;
    case PD_DataType::FLOAT64: { auto p = t.data<double>(); for (int64_t i = 0; i < n; ++i) v[i] = float(p[i]); break; }
    case PD_DataType::BFLOAT16: { auto p = t.data<bfloat16>(); for (int64_t i = 0; i < n; ++i) v[i] = Ld(p[i]); break; }
    case PD_DataType::FLOAT16: { auto p = t.data<float16>(); for (int64_t i = 0; i < n; ++i) v[i] = Ld(p[i]); break; }
    default: PD_CHECK(false, "xfw testcpu: a floating tensor was expected (dtype %d)", int(t.dtype()));
  }
  return v;
}

void StoreF32(const phi::Context& ctx, phi::DenseTensor* t, const float* v, int64_t n) {
  switch (t->dtype()) {
    case PD_DataType::FLOAT32: { auto p = ctx.Alloc<float>(t); std::memmove(p, v, n * 4); break; }
    case PD_DataType::FLOAT64: { auto p = ctx.Alloc<double>(t); for (int64_t i = 0; i < n; ++i) p[i] = v[i]; break; }
    case PD_DataType::BFLOAT16: { auto p = ctx.Alloc<bfloat16>(t); for (int64_t i = 0; i < n; ++i) p[i] = St<bfloat16>(v[i]); break; }
    case PD_DataType::FLOAT16: { auto p = ctx.Alloc<float16>(t); for (int64_t i = 0; i < n; ++i) p[i] = St<float16>(v[i]); break; }
    default: PD_CHECK(false, "xfw testcpu: a floating tensor was expected (dtype %d)", int(t->dtype()));
  }
}

void LogHit(const char* function, const char* dtype) {
  static const char* path = std::getenv("XFW_TESTCPU_KERNEL_LOG");
  if (!path || !*path) return;
  static std::mutex lock;
  std::lock_guard<std::mutex> hold(lock);
  if (FILE* f = std::fopen(path, "a")) {  // one short line per append: ranks sharing the file do not interleave
    std::fprintf(f, "%s %s\n", function, dtype);
    std::fclose(f);
  }
}

Broadcast::Broadcast(const Dims& x, const Dims& y) {
  size_t r = std::max(x.size(), y.size());
  out.assign(r, 1);
  sx.assign(r, 0);
  sy.assign(r, 0);
  int64_t stx = 1, sty = 1;
  for (size_t k = 0; k < r; ++k) {
    size_t d = r - 1 - k;
    int64_t dx = k < x.size() ? x[x.size() - 1 - k] : 1;
    int64_t dy = k < y.size() ? y[y.size() - 1 - k] : 1;
    PD_CHECK(dx == dy || dx == 1 || dy == 1, "xfw testcpu: shapes do not broadcast");
    out[d] = std::max(dx, dy);
    sx[d] = dx == 1 ? 0 : stx;
    sy[d] = dy == 1 ? 0 : sty;
    stx *= dx;
    sty *= dy;
  }
}

}  // namespace xfw_testcpu
