// conv2d/conv3d and their gradients (NCHW/NCDHW, groups, dilation, explicit/SAME/VALID padding) for every floating type:
// the tiny vision towers and UNets run it in bf16 under AMP, which the CPU build cannot. fp32 inside.
#include <string>

#include "kernels.h"

namespace xfw_testcpu {
namespace {

// A convolution over depth x height x width (conv2d: depth 1).
struct ConvShape {
  int64_t n, c, d, h, w, oc, kd, kh, kw, od, oh, ow, g;
  int sd, sh, sw, dd, dh, dw, pf, pt, pl;
};

// One spatial axis: stride, dilation, padding before, output size, from Paddle's padding rules.
void Axis(int64_t in, int64_t k, int stride, int dil, int before, int after, const std::string& algo,
          int* out_dil, int* out_pad, int64_t* out_size) {
  if (algo == "VALID") { before = after = 0; dil = 1; }
  if (algo == "SAME") {
    dil = 1;
    int64_t o = (in + stride - 1) / stride, pad = std::max<int64_t>((o - 1) * stride + k - in, 0);
    before = static_cast<int>(pad / 2);
    after = static_cast<int>(pad - pad / 2);
  }
  *out_dil = dil;
  *out_pad = before;
  *out_size = (in + before + after - (dil * (k - 1) + 1)) / stride + 1;
}

ConvShape Shape(const Dims& in, const Dims& f, const std::vector<int>& strides, const std::vector<int>& paddings,
                const std::string& algo, const std::vector<int>& dilations, int groups, const std::string& layout) {
  PD_CHECK(layout == "NCHW" || layout == "NCDHW" || layout == "AnyLayout",
           "xfw testcpu conv: only channel-first layouts are implemented (got %s)", layout.c_str());
  bool three = in.size() == 5;
  PD_CHECK((in.size() == 4 || three) && f.size() == in.size(), "xfw testcpu conv: 4-D or 5-D input and filter expected");
  int sp = three ? 3 : 2;
  std::vector<int> before(sp, 0), after(sp, 0);
  for (int i = 0; i < sp; ++i) {
    if (paddings.size() == size_t(2 * sp)) { before[i] = paddings[2 * i]; after[i] = paddings[2 * i + 1]; }
    else if (paddings.size() == size_t(sp)) { before[i] = after[i] = paddings[i]; }
  }
  ConvShape s{};
  s.n = in[0]; s.c = in[1]; s.oc = f[0]; s.g = groups;
  s.d = three ? in[2] : 1; s.h = in[sp]; s.w = in[sp + 1];
  s.kd = three ? f[2] : 1; s.kh = f[sp]; s.kw = f[sp + 1];
  s.sd = three ? strides[0] : 1; s.sh = strides[sp - 2]; s.sw = strides[sp - 1];
  if (three) Axis(s.d, s.kd, s.sd, dilations[0], before[0], after[0], algo, &s.dd, &s.pf, &s.od);
  else { s.dd = 1; s.pf = 0; s.od = 1; }
  Axis(s.h, s.kh, s.sh, dilations[sp - 2], before[sp - 2], after[sp - 2], algo, &s.dh, &s.pt, &s.oh);
  Axis(s.w, s.kw, s.sw, dilations[sp - 1], before[sp - 1], after[sp - 1], algo, &s.dw, &s.pl, &s.ow);
  return s;
}

Dims OutDims(const ConvShape& s, bool three) {
  return three ? Dims{s.n, s.oc, s.od, s.oh, s.ow} : Dims{s.n, s.oc, s.oh, s.ow};
}

// Calls f(out index, input index, filter index) for every multiply-add of the convolution.
template <typename F>
void Each(const ConvShape& s, F f) {
  int64_t cg = s.c / s.g, ocg = s.oc / s.g;
  for (int64_t b = 0; b < s.n; ++b)
    for (int64_t o = 0; o < s.oc; ++o) {
      int64_t grp = o / ocg;
      for (int64_t z = 0; z < s.od; ++z)
        for (int64_t y = 0; y < s.oh; ++y)
          for (int64_t x = 0; x < s.ow; ++x) {
            int64_t oi = (((b * s.oc + o) * s.od + z) * s.oh + y) * s.ow + x;
            for (int64_t ci = 0; ci < cg; ++ci) {
              int64_t c = grp * cg + ci;
              for (int64_t q = 0; q < s.kd; ++q) {
                int64_t iz = z * s.sd - s.pf + q * s.dd;
                if (iz < 0 || iz >= s.d) continue;
                for (int64_t i = 0; i < s.kh; ++i) {
                  int64_t iy = y * s.sh - s.pt + i * s.dh;
                  if (iy < 0 || iy >= s.h) continue;
                  for (int64_t j = 0; j < s.kw; ++j) {
                    int64_t ix = x * s.sw - s.pl + j * s.dw;
                    if (ix < 0 || ix >= s.w) continue;
                    f(oi, (((b * s.c + c) * s.d + iz) * s.h + iy) * s.w + ix,
                      (((o * cg + ci) * s.kd + q) * s.kh + i) * s.kw + j);
                  }
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
                  const std::vector<int>& dilations, int groups, const std::string& layout, phi::DenseTensor* out) { XFW_HIT();
  ConvShape s = Shape(input.dims(), filter.dims(), strides, paddings, algo, dilations, groups, layout);
  std::vector<float> in = ToF32(input), w = ToF32(filter), o(s.n * s.oc * s.od * s.oh * s.ow, 0.f);
  Each(s, [&](int64_t oi, int64_t ii, int64_t wi) { o[oi] += in[ii] * w[wi]; });
  out->Resize(OutDims(s, input.dims().size() == 5));
  out->set_dtype(input.dtype());
  StoreF32(ctx, out, o.data(), static_cast<int64_t>(o.size()));
}

template <typename T>
void Conv2dGradKernel(const phi::Context& ctx, const phi::DenseTensor& input, const phi::DenseTensor& filter,
                      const phi::DenseTensor& dout, const std::vector<int>& strides, const std::vector<int>& paddings,
                      const std::string& algo, const std::vector<int>& dilations, int groups, const std::string& layout,
                      phi::DenseTensor* din, phi::DenseTensor* dfilter) { XFW_HIT();
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

template <typename T>
void Conv3dKernel(const phi::Context& ctx, const phi::DenseTensor& input, const phi::DenseTensor& filter,
                  const std::vector<int>& strides, const std::vector<int>& paddings, const std::string& algo, int groups,
                  const std::vector<int>& dilations, const std::string& layout, phi::DenseTensor* out) { XFW_HIT();
  Conv2dKernel<T>(ctx, input, filter, strides, paddings, algo, dilations, groups, layout, out);
}

template <typename T>
void Conv3dGradKernel(const phi::Context& ctx, const phi::DenseTensor& input, const phi::DenseTensor& filter,
                      const phi::DenseTensor& dout, const std::vector<int>& strides, const std::vector<int>& paddings,
                      const std::string& algo, int groups, const std::vector<int>& dilations, const std::string& layout,
                      phi::DenseTensor* din, phi::DenseTensor* dfilter) { XFW_HIT();
  Conv2dGradKernel<T>(ctx, input, filter, dout, strides, paddings, algo, dilations, groups, layout, din, dfilter);
}

}  // namespace xfw_testcpu

using namespace xfw_testcpu;  // NOLINT
PD_BUILD_PHI_KERNEL(conv2d, testcpu, ALL_LAYOUT, Conv2dKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(conv2d_grad, testcpu, ALL_LAYOUT, Conv2dGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(conv3d, testcpu, ALL_LAYOUT, Conv3dKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(conv3d_grad, testcpu, ALL_LAYOUT, Conv3dGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
