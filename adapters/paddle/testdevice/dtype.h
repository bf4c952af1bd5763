// Element types and conversions of the xfw CPU test device, free of Paddle's headers.
// bf16 and fp16 compute in fp32 and round once to nearest even, as CUDA's __float2bfloat16_rn does
// (Paddle's own host-side bfloat16 constructor truncates, so it is not used for results).
#pragma once
#include <cstdint>
#include <cstring>

namespace xfw_testcpu {

struct bf16 { uint16_t x; };
struct f16 { uint16_t x; };

inline float BF16BitsToFloat(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t FloatToBF16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float F16BitsToFloat(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}
inline uint16_t FloatToF16Bits(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// Accumulator of each element type, and the way back.
inline float ToAcc(float v) { return v; }
inline double ToAcc(double v) { return v; }
inline int32_t ToAcc(int32_t v) { return v; }
inline int64_t ToAcc(int64_t v) { return v; }
inline int32_t ToAcc(int8_t v) { return v; }
inline int32_t ToAcc(uint8_t v) { return v; }
inline float ToAcc(bf16 v) { return BF16BitsToFloat(v.x); }
inline float ToAcc(f16 v) { return F16BitsToFloat(v.x); }

template <typename T, typename A>
inline T FromAcc(A a) { return static_cast<T>(a); }
template <>
inline bf16 FromAcc<bf16, float>(float a) { return bf16{FloatToBF16Bits(a)}; }
template <>
inline f16 FromAcc<f16, float>(float a) { return f16{FloatToF16Bits(a)}; }

}  // namespace xfw_testcpu
