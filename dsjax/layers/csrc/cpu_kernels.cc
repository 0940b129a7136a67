// The vocabulary head on XLA:CPU, as an XLA FFI custom call (dsjax/layers/cpu_kernels.py builds and
// registers it): logits [R, NT * 32] = x [R, D] @ W.T, W kept in tiles [NT, D, 32] of 32
// vocabulary rows (for each k the tile's 32 weights are contiguous: one sequential stream),
// fp32 or bf16 weights (bf16 widened exactly), fp32 products and sums.
//
// Why: XLA:CPU's products for 2..16 rows (its GEMM, or a fused multiply-reduce) run the
// [8, 256] x [256, 129280] head at ~70 GFLOP/s, twice the time of reading it; this reads each
// weight once for up to 8 rows held in 16 vector accumulators, so it runs at the memory or FMA
// rate. Each logit is the sequential multiply-add over k = 0..D-1 (fused where the CPU has
// FMA), so a row's logits do not depend on the other rows, the row count or the threads.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTile = 32;      // vocabulary rows a tile: two 16-float vectors
constexpr int kRows = 8;       // activation rows a pass over a tile (16 vector accumulators)
constexpr int64_t kItem = 32;  // tiles a work item shared out over the threads

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16f load16(const uint16_t* p) {  // bf16 bits -> fp32, exact
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// rows [RB] of x against one tile -> out[r, 0..31]
template <int RB, typename W>
inline void tile_rows(const float* x, int64_t d, const W* tile, float* out, int64_t stride) {
  v16f acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = v16f{};
  for (int64_t k = 0; k < d; ++k) {
    v16f w0 = load16(tile + k * kTile), w1 = load16(tile + k * kTile + 16);
    for (int r = 0; r < RB; ++r) {
      float s = x[r * d + k];
      acc[r][0] += s * w0;
      acc[r][1] += s * w1;
    }
  }
  for (int r = 0; r < RB; ++r) {
    store16(out + r * stride, acc[r][0]);
    store16(out + r * stride + 16, acc[r][1]);
  }
}

template <typename W>
void tiles(const float* x, int64_t rows, int64_t d, const W* w, float* out, int64_t stride, int64_t t0,
           int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const W* tile = w + t * d * kTile;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {  // the tile stays in cache for the next 8 rows
      const float* xr = x + r0 * d;
      float* o = out + r0 * stride + t * kTile;
      switch (std::min<int64_t>(rows - r0, kRows)) {
        case 1: tile_rows<1>(xr, d, tile, o, stride); break;
        case 2: tile_rows<2>(xr, d, tile, o, stride); break;
        case 3: tile_rows<3>(xr, d, tile, o, stride); break;
        case 4: tile_rows<4>(xr, d, tile, o, stride); break;
        case 5: tile_rows<5>(xr, d, tile, o, stride); break;
        case 6: tile_rows<6>(xr, d, tile, o, stride); break;
        case 7: tile_rows<7>(xr, d, tile, o, stride); break;
        default: tile_rows<8>(xr, d, tile, o, stride); break;
      }
    }
  }
}

struct Work {
  std::atomic<int64_t> next{0}, done{0};
  int64_t items = 0;
};

// Work items are claimed from a shared counter by this thread and by helpers scheduled on
// XLA's intra-op pool; this thread waits only for items already claimed (a helper that starts
// late finds nothing left), so a busy pool delays nothing.
template <typename W>
void run(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t d, const W* w, float* out, int64_t nt) {
  auto work = std::make_shared<Work>();
  work->items = (nt + kItem - 1) / kItem;
  auto drain = [=]() {
    for (int64_t i; (i = work->next.fetch_add(1)) < work->items;) {
      tiles(x, rows, d, w, out, nt * kTile, i * kItem, std::min(nt, (i + 1) * kItem));
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), work->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain]() { drain(); });
  drain();
  while (work->done.load(std::memory_order_acquire) < work->items) std::this_thread::yield();
}

ffi::Error VocabHead(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kTile || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("dsjax_vocab_head: x [R, D] and tiles [NT, D, 32] expected");
  int64_t rows = xd[0], d = xd[1], nt = wd[0];
  if (w.element_type() == ffi::DataType::F32)
    run(pool, x.typed_data(), rows, d, static_cast<const float*>(w.untyped_data()), out->typed_data(), nt);
  else if (w.element_type() == ffi::DataType::BF16)
    run(pool, x.typed_data(), rows, d, static_cast<const uint16_t*>(w.untyped_data()), out->typed_data(), nt);
  else
    return ffi::Error::InvalidArgument("dsjax_vocab_head: tiles must be float32 or bfloat16");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsjaxVocabHead, VocabHead,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
