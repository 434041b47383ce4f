// The first-order linear recurrence over batch-major rows in one pass: the CPU
// kernel behind `reverse_linear_recurrence(..., method="auto")`.
//
// Per row of length T, with y_init the row's boundary value:
//
//   reverse: y_t = x_t + c_t y_{t+1},  t = T-1 .. 0,  y_T  = y_init
//   forward: y_t = x_t + c_t y_{t-1},  t = 0 .. T-1,  y_-1 = y_init
//
// XLA:CPU runs `lax.scan` as one small kernel per time step over time-major
// copies of the inputs; here eight rows advance together, so their eight
// independent chains hide the latency of one multiply-add each, and a large
// batch's rows are shared among XLA's CPU threads. Each step is
// one fused multiply-add where the CPU has them, as XLA:CPU compiles the scan's
// step, and a rounded product and sum where it has none, so both give the same
// float32 numbers.

#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using stepcredit::ByRows;

namespace {

constexpr int64_t kRows = 8;

template <int64_t N>
void Rows(const float* x, const float* c, const float* y_init, float* y, int64_t length,
          bool reverse) {
  float carry[N];
  for (int64_t j = 0; j < N; ++j) carry[j] = y_init[j];
  for (int64_t k = 0; k < length; ++k) {
    const int64_t t = reverse ? length - 1 - k : k;
    for (int64_t j = 0; j < N; ++j) {
      const int64_t i = j * length + t;
#ifdef __FMA__
      carry[j] = std::fma(c[i], carry[j], x[i]);
#else
      carry[j] = x[i] + c[i] * carry[j];
#endif
      y[i] = carry[j];
    }
  }
}

ffi::Error LinearRecurrence(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> c,
                            ffi::Buffer<ffi::F32> y_init, bool reverse,
                            ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  const auto dims = x.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("linear_recurrence: x must be [..., T]");
  const int64_t length = dims.back();
  const int64_t num_rows = y_init.element_count();
  if (x.element_count() != num_rows * length || c.element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("linear_recurrence: inputs disagree in shape");
  }
  const float* xs = x.typed_data();
  const float* cs = c.typed_data();
  const float* init = y_init.typed_data();
  float* ys = y->typed_data();
  ByRows<kRows>(pool, num_rows, length, [&](int64_t b, auto rows) {
    const int64_t offset = b * length;
    Rows<decltype(rows)::value>(xs + offset, cs + offset, init + b, ys + offset, length, reverse);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditLinearRecurrenceF32, LinearRecurrence,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // c [..., T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y_init [...]
                                  .Attr<bool>("reverse")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [..., T]
                                  .Ctx<ffi::ThreadPool>());
