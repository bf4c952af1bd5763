// Helpers shared by the xfw test device's kernels (Paddle's custom-kernel C API, paddle/phi/capi).
// Every kernel computes in fp32 (fp64 for double, the type itself for integers) and stores once,
// rounding bf16/fp16 to nearest even. Outputs are written through the tensor's own data pointer,
// so an in-place op on a view (a tensor sharing a larger buffer at an offset) updates that buffer.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "paddle/phi/capi/all.h"

namespace xfw_testcpu {

using bfloat16 = phi::dtype::bfloat16;
using float16 = phi::dtype::float16;
using Dims = std::vector<int64_t>;

inline float Ld(bfloat16 v) { return BF16BitsToFloat(v.x); }
inline float Ld(float16 v) { return F16BitsToFloat(v.x); }
inline float Ld(float v) { return v; }
inline double Ld(double v) { return v; }
inline int64_t Ld(int64_t v) { return v; }
inline int32_t Ld(int32_t v) { return v; }
inline int32_t Ld(int16_t v) { return v; }
inline int32_t Ld(int8_t v) { return v; }
inline int32_t Ld(uint8_t v) { return v; }
inline int32_t Ld(bool v) { return v; }

template <typename T> struct Comp { using type = decltype(Ld(T())); };
template <typename T> using C = typename Comp<T>::type;

template <typename T, typename V>
inline T St(V v) { return static_cast<T>(v); }
template <>
inline bfloat16 St<bfloat16, float>(float v) { bfloat16 b; b.x = FloatToBF16Bits(v); return b; }
template <>
inline bfloat16 St<bfloat16, double>(double v) { return St<bfloat16, float>(static_cast<float>(v)); }
template <>
inline float16 St<float16, float>(float v) { float16 h; h.x = FloatToF16Bits(v); return h; }
template <>
inline float16 St<float16, double>(double v) { return St<float16, float>(static_cast<float>(v)); }
template <>
inline bool St<bool, float>(float v) { return v != 0.f; }
template <>
inline bool St<bool, double>(double v) { return v != 0.0; }

inline int64_t Numel(const Dims& d) {
  int64_t n = 1;
  for (auto v : d) n *= v;
  return n;
}

// Any floating tensor as fp32 values, and fp32 values into a floating tensor of its own dtype.
std::vector<float> ToF32(const phi::DenseTensor& t);
void StoreF32(const phi::Context& ctx, phi::DenseTensor* t, const float* v, int64_t n);

// numpy-style broadcast of x and y (right-aligned); strides are 0 along broadcast dimensions.
struct Broadcast {
  Dims out;
  std::vector<int64_t> sx, sy;  // element strides of x and y along out's dimensions
  Broadcast(const Dims& x, const Dims& y);
  template <typename F>
  void Each(F f) const {  // f(out index, x index, y index)
    int64_t n = Numel(out);
    int r = static_cast<int>(out.size());
    std::vector<int64_t> idx(r, 0);
    int64_t ix = 0, iy = 0;
    for (int64_t i = 0; i < n; ++i) {
      f(i, ix, iy);
      for (int d = r - 1; d >= 0; --d) {
        if (++idx[d] < out[d]) { ix += sx[d]; iy += sy[d]; break; }
        ix -= sx[d] * (out[d] - 1);
        iy -= sy[d] * (out[d] - 1);
        idx[d] = 0;
      }
    }
  }
};

// Coverage log (docs/testdevice.md, "Which kernels the models reach"): with XFW_TESTCPU_KERNEL_LOG=<file>
// in the environment, the first call of each kernel function per dtype in a process appends
// "<function> <dtype>" to that file (tests/contract/test_testdevice_coverage.py maps functions to
// registered names). Unset, each kernel pays one test of a static flag.
void LogHit(const char* function, const char* dtype);
template <typename T> inline const char* DtypeName() { return "other"; }
template <> inline const char* DtypeName<float>() { return "float32"; }
template <> inline const char* DtypeName<double>() { return "float64"; }
template <> inline const char* DtypeName<bfloat16>() { return "bfloat16"; }
template <> inline const char* DtypeName<float16>() { return "float16"; }
template <> inline const char* DtypeName<int64_t>() { return "int64"; }
template <> inline const char* DtypeName<int32_t>() { return "int32"; }
template <> inline const char* DtypeName<int16_t>() { return "int16"; }
template <> inline const char* DtypeName<int8_t>() { return "int8"; }
template <> inline const char* DtypeName<uint8_t>() { return "uint8"; }
template <> inline const char* DtypeName<bool>() { return "bool"; }

}  // namespace xfw_testcpu

#define XFW_HIT()                                                              \
  do {                                                                         \
    static bool xfw_hit_logged = false;                                        \
    if (!xfw_hit_logged) {                                                     \
      xfw_hit_logged = true;                                                   \
      ::xfw_testcpu::LogHit(__func__, ::xfw_testcpu::DtypeName<T>());          \
    }                                                                          \
  } while (0)

#define XFW_FLOATS float, double, phi::dtype::float16, phi::dtype::bfloat16
#define XFW_NUMBERS XFW_FLOATS, int32_t, int64_t
#define XFW_ALL XFW_NUMBERS, bool, uint8_t, int8_t, int16_t
