// conv2d and conv2d_grad (NCHW, groups, dilation, explicit/SAME/VALID padding) for every floating type:
// the tiny vision towers and UNets run it in bf16 under AMP, which the CPU build cannot. fp32 inside.
#include <string>

#include "kernels.h"

namespace xfw_testcpu {
namespace {

struct ConvShape {
  int64_t n, c, h, w, oc, kh, kw, oh, ow, g;
  int sh, sw, dh, dw, pt, pl;
};

ConvShape Shape(const Dims& in, const Dims& f, const std::vector<int>& strides, const std::vector<int>& paddings,
                const std::string& algo, const std::vector<int>& dilations, int groups, const std::string& layout) {
  PD_CHECK(layout == "NCHW" || layout == "AnyLayout", "xfw testcpu conv2d: only NCHW is implemented");
  PD_CHECK(in.size() == 4 && f.size() == 4, "xfw testcpu conv2d: 4-D input and filter expected");
  ConvShape s{in[0], in[1], in[2], in[3], f[0], f[2], f[3], 0, 0, groups, strides[0], strides[1],
              dilations[0], dilations[1], 0, 0};
  int pt = 0, pb = 0, pl = 0, pr = 0;
  if (paddings.size() == 4) { pt = paddings[0]; pb = paddings[1]; pl = paddings[2]; pr = paddings[3]; }
  else if (paddings.size() == 2) { pt = pb = paddings[0]; pl = pr = paddings[1]; }
  if (algo == "VALID") { pt = pb = pl = pr = 0; s.dh = s.dw = 1; }
  if (algo == "SAME") {
    s.dh = s.dw = 1;
    int64_t oh = (s.h + s.sh - 1) / s.sh, ow = (s.w + s.sw - 1) / s.sw;
    int64_t ph = std::max<int64_t>((oh - 1) * s.sh + s.kh - s.h, 0), pw = std::max<int64_t>((ow - 1) * s.sw + s.kw - s.w, 0);
    pt = static_cast<int>(ph / 2); pb = static_cast<int>(ph - ph / 2); pl = static_cast<int>(pw / 2); pr = static_cast<int>(pw - pw / 2);
  }
  s.pt = pt; s.pl = pl;
  s.oh = (s.h + pt + pb - (s.dh * (s.kh - 1) + 1)) / s.sh + 1;
  s.ow = (s.w + pl + pr - (s.dw * (s.kw - 1) + 1)) / s.sw + 1;
  return s;
}

// Calls f(out index, input index, filter index) for every multiply-add of the convolution.
template <typename F>
void Each(const ConvShape& s, F f) {
  int64_t cg = s.c / s.g, ocg = s.oc / s.g;
  for (int64_t b = 0; b < s.n; ++b)
    for (int64_t o = 0; o < s.oc; ++o) {
      int64_t grp = o / ocg;
      for (int64_t y = 0; y < s.oh; ++y)
        for (int64_t x = 0; x < s.ow; ++x) {
          int64_t oi = ((b * s.oc + o) * s.oh + y) * s.ow + x;
          for (int64_t ci = 0; ci < cg; ++ci) {
            int64_t c = grp * cg + ci;
            for (int64_t i = 0; i < s.kh; ++i) {
              int64_t iy = y * s.sh - s.pt + i * s.dh;
              if (iy < 0 || iy >= s.h) continue;
              for (int64_t j = 0; j < s.kw; ++j) {
                int64_t ix = x * s.sw - s.pl + j * s.dw;
                if (ix < 0 || ix >= s.w) continue;
                f(oi, ((b * s.c + c) * s.h + iy) * s.w + ix, ((o * cg + ci) * s.kh + i) * s.kw + j);
              }
            }
          }
        }
    }
}

}  // namespace

template <typename T>
void Conv2dKernel(const phi::Context& ctx, const phi::DenseTensor& input, const phi::DenseTensor& filter,
                  const std::vector<int>& strides, const std::vector<int>& paddings, const std::string& algo,
                  const std::vector<int>& dilations, int groups, const std::string& layout, phi::DenseTensor* out) {
  ConvShape s = Shape(input.dims(), filter.dims(), strides, paddings, algo, dilations, groups, layout);
  std::vector<float> in = ToF32(input), w = ToF32(filter), o(s.n * s.oc * s.oh * s.ow, 0.f);
  Each(s, [&](int64_t oi, int64_t ii, int64_t wi) { o[oi] += in[ii] * w[wi]; });
  out->Resize({s.n, s.oc, s.oh, s.ow});
  out->set_dtype(input.dtype());
  StoreF32(ctx, out, o.data(), static_cast<int64_t>(o.size()));
}

template <typename T>
void Conv2dGradKernel(const phi::Context& ctx, const phi::DenseTensor& input, const phi::DenseTensor& filter,
                      const phi::DenseTensor& dout, const std::vector<int>& strides, const std::vector<int>& paddings,
                      const std::string& algo, const std::vector<int>& dilations, int groups, const std::string& layout,
                      phi::DenseTensor* din, phi::DenseTensor* dfilter) {
  ConvShape s = Shape(input.dims(), filter.dims(), strides, paddings, algo, dilations, groups, layout);
  std::vector<float> in = ToF32(input), w = ToF32(filter), g = ToF32(dout);
  std::vector<float> gi(din ? in.size() : 0, 0.f), gw(dfilter ? w.size() : 0, 0.f);
  Each(s, [&](int64_t oi, int64_t ii, int64_t wi) {
    if (din) gi[ii] += g[oi] * w[wi];
    if (dfilter) gw[wi] += g[oi] * in[ii];
  });
  if (din) { din->Resize(input.dims()); din->set_dtype(input.dtype()); StoreF32(ctx, din, gi.data(), static_cast<int64_t>(gi.size())); }
  if (dfilter) { dfilter->Resize(filter.dims()); dfilter->set_dtype(filter.dtype()); StoreF32(ctx, dfilter, gw.data(), static_cast<int64_t>(gw.size())); }
}

}  // namespace xfw_testcpu

using namespace xfw_testcpu;  // NOLINT
PD_BUILD_PHI_KERNEL(conv2d, testcpu, ALL_LAYOUT, Conv2dKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(conv2d_grad, testcpu, ALL_LAYOUT, Conv2dGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
