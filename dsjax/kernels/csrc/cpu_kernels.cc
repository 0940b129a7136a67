// XLA FFI custom calls for XLA:CPU (dsjax/kernels/cpu.py builds and registers them). The vocabulary
// head: logits [R, NT * 32] = x [R, D] @ W.T, W kept in tiles [NT, D, 32] of 32
// vocabulary rows (for each k the tile's 32 weights are contiguous: one sequential stream),
// fp32 or bf16 weights (bf16 widened exactly), fp32 products and sums.
//
// Why: XLA:CPU's products for 2..16 rows (its GEMM, or a fused multiply-reduce) run the
// [8, 256] x [256, 129280] head at ~70 GFLOP/s, twice the time of reading it; this reads each
// weight once for up to 8 rows held in 16 vector accumulators, so it runs at the memory or FMA
// rate. Each logit is the sequential multiply-add over k = 0..D-1 (fused where the CPU has
// FMA), so a row's logits do not depend on the other rows, the row count or the threads.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <functional>
#if defined(__AVX512F__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

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
#ifdef __AVX512F__  // one widening instruction (GCC splits the generic form into 256-bit halves and inserts)
  __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
#endif
  v16f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// How far ahead of its reads a weight stream asks for memory (bytes; software prefetch, one
// request a cache line): the hardware's prefetchers alone left one core reading cold weights at
// ~9-11 GB/s on an Intel Xeon VM (AVX512-BF16, AMX) where a plain sum read 13-15;
// benchmarks/rows_kernel.py times the library's kernels in programs.
constexpr int64_t kHeadAhead = 2048, kRowsAhead = 1024;
template <int64_t Bytes>
inline void ahead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + Bytes, 0, 3);
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// rows [RB] of x against one tile -> out[r, 0..31]
template <int RB, typename W>
inline void tile_rows(const float* x, int64_t d, const W* tile, float* out, int64_t stride) {
  v16f acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = v16f{};
  for (int64_t k = 0; k < d; ++k) {
    ahead<kHeadAhead>(tile + k * kTile);
    if (sizeof(W) == 4) ahead<kHeadAhead>(tile + k * kTile + 16);
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

#ifdef __AVX512F__
// bf16 tiles: each k's 32 weights as one 512-bit load, widened in place, with no shuffle: the
// low halves of its 16 words (vocabulary rows 0, 2, .., 30) shifted up, the high halves (1, 3,
// .., 31) masked; the two sums interleaved back once a tile. Each logit is the same sequence
// of multiply-adds as the generic form's.
template <int RB>
inline void tile_rows(const float* x, int64_t d, const uint16_t* tile, float* out, int64_t stride) {
  __m512 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t k = 0; k < d; ++k) {
    ahead<kHeadAhead>(tile + k * kTile);
    __m512i u = _mm512_loadu_si512(tile + k * kTile);
    __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)), odd = _mm512_castsi512_ps(_mm512_and_si512(u, high));
    for (int r = 0; r < RB; ++r) {
      __m512 s = _mm512_set1_ps(x[r * d + k]);
      acc[r][0] = _mm512_fmadd_ps(s, even, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(s, odd, acc[r][1]);
    }
  }
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int r = 0; r < RB; ++r) {
    _mm512_storeu_ps(out + r * stride, _mm512_permutex2var_ps(acc[r][0], lo, acc[r][1]));
    _mm512_storeu_ps(out + r * stride + 16, _mm512_permutex2var_ps(acc[r][0], hi, acc[r][1]));
  }
}
#endif

// f(std::integral_constant<int, RB>) with RB = min(n, kRows): a pass's row count as a constant
template <typename F>
inline void with_rows(int64_t n, F f) {
  switch (std::min<int64_t>(n, kRows)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
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
      with_rows(rows - r0, [&](auto rb) { tile_rows<decltype(rb)::value>(xr, d, tile, o, stride); });
    }
  }
}

struct Work {
  std::atomic<int64_t> next{0}, done{0};
  int64_t items = 0;
};

// item(i) for i in [0, items), claimed from a shared counter by this thread and by helpers
// scheduled on XLA's intra-op pool; this thread waits only for items already claimed (a helper
// that starts late finds nothing left and never calls `item`, whose references into the
// caller's frame may be gone by then), so a busy pool delays nothing.
template <typename F>
void parallel_items(ffi::ThreadPool& pool, int64_t items, F item) {
  auto work = std::make_shared<Work>();
  work->items = items;
  auto body = std::make_shared<std::function<void(int64_t)>>(item);
  auto drain = [work, body]() {
    for (int64_t i; (i = work->next.fetch_add(1)) < work->items;) {
      (*body)(i);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain]() { drain(); });
  drain();
  while (work->done.load(std::memory_order_acquire) < work->items) std::this_thread::yield();
}

template <typename W>
void run(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t d, const W* w, float* out, int64_t nt) {
  parallel_items(pool, (nt + kItem - 1) / kItem, [&](int64_t i) {
    tiles(x, rows, d, w, out, nt * kTile, i * kItem, std::min(nt, (i + 1) * kItem));
  });
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

// ---------------------------------------------------------------- few-row products
// out [R, O] = x [R, I] @ W[O, I]^T for a layer's weight as stored ([out, in], fp32 or bf16:
// widened exactly), fp32 products and sums: each output is 4 x 16 lane sums, lane l of sum a
// over k = 64 j + 16 a + l in ascending j (then the k past the last 64 in steps of 16 into sum
// 0), the four summed in order, a fixed pairwise sum of the lanes, and the k past the last 16 in
// order. The same for every row, so a row's outputs do not depend on the other rows, their
// number or the threads.
//
// Why: XLA:CPU's products of 2..16 rows by a 16-bit weight widen it in element loops or for
// its GEMM, and a decode step reads each weight once, cold: this reads each output's weight row
// once, in order, for up to 4 activation rows at a time (the row stays in cache for the next
// 4), with four independent sums a row so that one row's multiply-adds keep up with memory.
// Cold weights of [256, 256] .. [256, 1024] from scattered places, one row, one thread (AMD
// EPYC): 17-24 GB/s, a plain sum's rate, against 8-12 GB/s when 8 outputs' rows were read
// side by side (one sum each) with software prefetch; at 8 rows 1.0-1.35x slower than that
// (bound by multiply-adds there). benchmarks/rows_kernel.py times it in programs.
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline float lanes_sum(v16f v) {
  v8f a, b;
  std::memcpy(&a, &v, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof a, sizeof b);
  v8f s8 = a + b;
  v4f c, d;
  std::memcpy(&c, &s8, sizeof c);
  std::memcpy(&d, reinterpret_cast<const char*>(&s8) + sizeof c, sizeof d);
  v4f s4 = c + d;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

inline float widen(float v) { return v; }
inline float widen(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

constexpr int kSums = 4;      // independent sums an output row
constexpr int kPassRows = 4;  // activation rows a pass over an output's weight row (16 accumulators)

// rows [RB] of x against one output's weight row w -> out[r * stride]
template <int RB, typename W>
inline void row_outputs(const float* x, int64_t in, const W* w, float* out, int64_t stride) {
  v16f acc[RB][kSums];
  for (int r = 0; r < RB; ++r)
    for (int a = 0; a < kSums; ++a) acc[r][a] = v16f{};
  int64_t k = 0;
  for (; k + 16 * kSums <= in; k += 16 * kSums)
    for (int a = 0; a < kSums; ++a) {
      if (a % (64 / (16 * sizeof(W))) == 0) ahead<kRowsAhead>(w + k + 16 * a);
      v16f wv = load16(w + k + 16 * a);
      for (int r = 0; r < RB; ++r) acc[r][a] += load16(x + r * in + k + 16 * a) * wv;
    }
  for (; k + 16 <= in; k += 16) {
    v16f wv = load16(w + k);
    for (int r = 0; r < RB; ++r) acc[r][0] += load16(x + r * in + k) * wv;
  }
  for (int r = 0; r < RB; ++r) {
    for (int a = 1; a < kSums; ++a) acc[r][0] += acc[r][a];
    float s = lanes_sum(acc[r][0]);
    for (int64_t j = k; j < in; ++j) s = std::fma(x[r * in + j], widen(w[j]), s);  // fused, in every build
    out[r * stride] = s;
  }
}

// outputs [o0, o1) for every row: each output's weight row read once, in order
template <typename W>
void rows_product(const float* x, int64_t rows, int64_t in, const W* w, float* out, int64_t outs, int64_t o0,
                  int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const W* wo = w + o * in;
    int64_t r = 0;
    for (; r + kPassRows <= rows; r += kPassRows) row_outputs<kPassRows>(x + r * in, in, wo, out + r * outs + o, outs);
    switch (rows - r) {
      case 3: row_outputs<3>(x + r * in, in, wo, out + r * outs + o, outs); break;
      case 2: row_outputs<2>(x + r * in, in, wo, out + r * outs + o, outs); break;
      case 1: row_outputs<1>(x + r * in, in, wo, out + r * outs + o, outs); break;
      default: break;
    }
  }
}

// weight bytes a work item shared over the threads: a 128 KB weight read from memory in two
// items ran 1.3x faster than in one (32 against 24 GB/s, one row, 400 weights in turn)
constexpr int64_t kProductItemBytes = int64_t(1) << 16;

template <typename W>
void run_product(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t in, const W* w, float* out,
                 int64_t outs) {
  int64_t per = std::max<int64_t>(16, kProductItemBytes / std::max<int64_t>(1, in * int64_t(sizeof(W))));
  per = (per + 15) / 16 * 16;
  int64_t items = (outs + per - 1) / per;
  if (items <= 1) {  // one item: no helpers
    rows_product(x, rows, in, w, out, outs, 0, outs);
    return;
  }
  parallel_items(pool, items, [&](int64_t i) {
    rows_product(x, rows, in, w, out, outs, i * per, std::min(outs, (i + 1) * per));
  });
}

// Where w[at] begins in a stack w [*lead, ...] of weights `per` elements each (each index
// clamped into its axis, as XLA's dynamic slices clamp).
int64_t stack_offset(ffi::Span<const int64_t> wd, const int32_t* at, int64_t lead, int64_t per) {
  int64_t offset = 0;
  for (int64_t j = 0; j < lead; ++j) offset = offset * wd[j] + std::clamp<int64_t>(at[j], 0, wd[j] - 1);
  return offset * per;
}

// f(weights) with w's data from `offset` as fp32 or bf16 bits (a bf16 buffer or its uint16 bits)
template <typename F>
ffi::Error with_weights(ffi::AnyBuffer& w, int64_t offset, const std::string& name, F f) {
  auto type = w.element_type();
  if (type == ffi::DataType::F32)
    f(static_cast<const float*>(w.untyped_data()) + offset);
  else if (type == ffi::DataType::BF16 || type == ffi::DataType::U16)
    f(static_cast<const uint16_t*>(w.untyped_data()) + offset);
  else
    return ffi::Error::InvalidArgument(name + ": w must be float32, bfloat16 or its uint16 bits");
  return ffi::Error::Success();
}

// w: the weight, or a stack of them [*lead, O, I] and `at` [len(lead)] the weight's place in it
// (a scanned layer's weight: read where it lies, not copied out first).
ffi::Error RowsProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> at,
                       ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto ad = at.dimensions();
  int64_t lead = ad.size() == 1 ? ad[0] : -1;
  if (xd.size() != 2 || lead < 0 || int64_t(wd.size()) != lead + 2 || wd[lead + 1] != xd[1])
    return ffi::Error::InvalidArgument("dsjax_rows_product: x [R, I], w [*lead, O, I] and at [len(lead)] expected");
  int64_t rows = xd[0], in = xd[1], outs = wd[lead];
  return with_weights(w, stack_offset(wd, at.typed_data(), lead, outs * in), "dsjax_rows_product", [&](auto weights) {
    run_product(pool, x.typed_data(), rows, in, weights, out->typed_data(), outs);
  });
}

// Experts: out [A, O] = each assignment's row x[a] @ W[e_a]^T, W [E, O, I] (or one of a stack
// [*lead, E, O, I], `at` its place), e_a = experts[a] clamped into [0, E). The rows are grouped
// by expert and each group runs `rows_product` on its expert, so an expert is read once for all
// its rows (a decode step's assignments share experts); a row's outputs are bitwise those of
// `RowsProduct` on that row and expert alone.
// A decode step's assignments grouped by expert (experts clamped into [0, E)): `order` the
// assignments sorted by expert (stable), `starts` each group's first place in it, then the end.
struct ExpertGroups {
  ExpertGroups(const int32_t* experts, int64_t assignments, int64_t n_experts)
      : experts(experts), n_experts(n_experts), order(assignments) {
    for (int64_t a = 0; a < assignments; ++a) order[a] = a;
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return expert(p) < expert(q); });
    for (int64_t i = 0; i < assignments; ++i)
      if (i == 0 || expert(order[i]) != expert(order[i - 1])) starts.push_back(i);
    starts.push_back(assignments);
  }
  int64_t expert(int64_t a) const { return std::clamp<int64_t>(experts[a], 0, n_experts - 1); }
  int64_t size() const { return int64_t(starts.size()) - 1; }
  const int32_t* experts;
  int64_t n_experts;
  std::vector<int64_t> order, starts;
};

template <typename W>
void run_experts(ffi::ThreadPool& pool, const float* x, int64_t assignments, int64_t in, const W* w, int64_t n_experts,
                 int64_t outs, const int32_t* experts, float* out) {
  ExpertGroups groups(experts, assignments, n_experts);
  const auto& order = groups.order;
  const auto& starts = groups.starts;
  auto expert = [&](int64_t a) { return groups.expert(a); };
  parallel_items(pool, groups.size(), [&](int64_t g) {
    int64_t first = starts[g], n = starts[g + 1] - first;
    std::vector<float> xs(n * in), ys(n * outs);
    for (int64_t i = 0; i < n; ++i) std::memcpy(&xs[i * in], x + order[first + i] * in, in * sizeof(float));
    rows_product(xs.data(), n, in, w + expert(order[first]) * outs * in, ys.data(), outs, 0, outs);
    for (int64_t i = 0; i < n; ++i) std::memcpy(out + order[first + i] * outs, &ys[i * outs], outs * sizeof(float));
  });
}

ffi::Error ExpertRowsProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> at,
                             ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto ad = at.dimensions();
  int64_t lead = ad.size() == 1 ? ad[0] : -1;
  if (xd.size() != 2 || lead < 0 || int64_t(wd.size()) != lead + 3 || wd[lead + 2] != xd[1] ||
      experts.dimensions().size() != 1 || experts.dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument(
        "dsjax_expert_rows_product: x [A, I], w [*lead, E, O, I], at [len(lead)] and experts [A] expected");
  int64_t assignments = xd[0], in = xd[1], n_experts = wd[lead], outs = wd[lead + 1];
  return with_weights(w, stack_offset(wd, at.typed_data(), lead, n_experts * outs * in), "dsjax_expert_rows_product",
                      [&](auto weights) {
                        run_experts(pool, x.typed_data(), assignments, in, weights, n_experts, outs,
                                    experts.typed_data(), out->typed_data());
                      });
}

// ---------------------------------------------------------------- greedy tokens through a screen
// The first maximum of each row's fp32 logits (the logits `VocabHead` computes from the fp32
// tiles, bitwise) read mostly from a bf16 copy of the head (half the bytes); a bf16 head is
// its own screen (then the pass saves multiply-adds, not bytes: AVX512-BF16 only):
//  1. approx[r, j] = x_r . bf16(w_j) from the screen tiles (parallel, as `VocabHead`), with
//     AVX512-BF16 as bf16(x_r) . bf16(w_j) (`vdpbf16ps`: 32 products an instruction, twice the
//     fp32 multiply-adds', which bound the 8-row pass);
//  2. |approx[r, j] - logit[r, j]| <= e_r * n_j, n_j >= ||w_j||_2 (fp32 `norms`, rounded up on
//     the host) and e_r = c * ||x_r||_2: rounding x and w to bf16 moves each product by at most
//     (2^-7 + 2^-16) of |x_k w_jk| and each fp32 sum differs from the real sum by at most
//     gamma_2D * sum_k |x_k w_jk| (fused or not, in any order), so by Cauchy-Schwarz
//     c = 2^-7 + 2^-16 + (2 + 2^-6) gamma_2D, plus 2^-20 for the subnormal terms (values below
//     2^-126 read as zero, sums flushed, each at most 2^-126 |x_k| or |w_jk| or absolute: at most
//     2^-20 ||x|| n_j while ||x|| >= 2^-30 and a non-zero n_j >= 2^-30, which the host checks of
//     the head and this of each row); c is taken 2^-10 larger, which also covers rounding in
//     computing the bounds in fp32;
//  3. t_r = max_j (approx - bound) <= the row's largest logit; every column whose upper bound
//     approx + bound reaches t_r is a candidate, and every maximum is one (its logit >= t_r);
//  4. the candidates' tiles are computed exactly from the exact tiles (the same per-lane
//     multiply-add sequence as `VocabHead`), and the first maximum among them, columns in
//     ascending order, is the first maximum of the row.
// A row gets -1 (the caller computes all its logits instead) when x or an approx value is not
// finite, the threshold is not finite, a candidate's logit is not finite, or more than
// kMaxCandidateTiles tiles are candidates (near-equal rows: screening saves nothing).
constexpr int64_t kMaxCandidateTiles = 64;

#ifdef __AVX512BF16__
inline uint32_t bf16_bits(float v) {  // finite v -> bf16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
}

// rows [RB] of bf16(x) as k pairs [RB, d / 2] against one bf16 tile -> out[r, 0..31]: each
// instruction multiplies the pair (x_k, x_k+1) with the tile's rows k and k + 1, interleaved
template <int RB>
inline void dot_tile_rows(const uint32_t* xp, int64_t d, const uint16_t* tile, float* out, int64_t stride) {
  alignas(64) static const uint16_t lo_index[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_index[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_index), hi = _mm512_load_si512(hi_index);
  __m512 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t half = d / 2;
  for (int64_t p = 0; p < half; ++p) {
    ahead<kHeadAhead>(tile + 2 * p * kTile);
    ahead<kHeadAhead>(tile + (2 * p + 1) * kTile);
    __m512i a = _mm512_loadu_si512(tile + 2 * p * kTile), b = _mm512_loadu_si512(tile + (2 * p + 1) * kTile);
    __m512bh w0 = (__m512bh)_mm512_permutex2var_epi16(a, lo, b), w1 = (__m512bh)_mm512_permutex2var_epi16(a, hi, b);
    for (int r = 0; r < RB; ++r) {
      __m512bh s = (__m512bh)_mm512_set1_epi32(int(xp[r * half + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], s, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], s, w1);
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm512_storeu_ps(out + r * stride, acc[r][0]);
    _mm512_storeu_ps(out + r * stride + 16, acc[r][1]);
  }
}

void dot_tiles(const uint32_t* xp, int64_t rows, int64_t d, const uint16_t* w, float* out, int64_t stride, int64_t t0,
               int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* tile = w + t * d * kTile;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const uint32_t* xr = xp + r0 * (d / 2);
      float* o = out + r0 * stride + t * kTile;
      with_rows(rows - r0, [&](auto rb) { dot_tile_rows<decltype(rb)::value>(xr, d, tile, o, stride); });
    }
  }
}
#endif

struct Screen {
  std::vector<float> lo, hi;  // [items, rows]: the largest lower / upper bound in an item
  std::vector<uint8_t> finite;  // [items, rows]: all approx values finite
};

void screen_item(const float* approx, int64_t rows, int64_t stride, const float* norms, const float* e,
                 int64_t j0, int64_t j1, int64_t vocab, Screen& s, int64_t item) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = approx + r * stride;
    float lo = -INFINITY, hi = -INFINITY;
    bool finite = true;
    for (int64_t j = j0; j < std::min(j1, vocab); ++j) {
      float b = e[r] * norms[j];
      finite &= std::fabs(a[j]) <= FLT_MAX;
      lo = std::max(lo, a[j] - b);
      hi = std::max(hi, a[j] + b);
    }
    s.lo[item * rows + r] = lo;
    s.hi[item * rows + r] = hi;
    s.finite[item * rows + r] = finite;
  }
}

ffi::Error GreedyHead(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> screen,
                      ffi::AnyBuffer exact, ffi::Buffer<ffi::F32> norms, int64_t vocab,
                      ffi::ResultBuffer<ffi::S32> tokens, ffi::ResultBuffer<ffi::F32> approx) {
  auto xd = x.dimensions();
  auto sd = screen.dimensions();
  auto ed = exact.dimensions();
  if (xd.size() != 2 || sd.size() != 3 || sd[2] != kTile || sd[1] != xd[1] || ed.size() != 3 || ed[0] != sd[0] ||
      ed[1] != sd[1] || ed[2] != kTile || norms.element_count() != sd[0] * kTile || vocab > sd[0] * kTile)
    return ffi::Error::InvalidArgument(
        "dsjax_greedy_head: x [R, D], screen and exact tiles [NT, D, 32], norms [NT * 32], vocab <= NT * 32 expected");
  const int64_t rows = xd[0], d = xd[1], nt = sd[0], stride = nt * kTile;
  const float* xs = x.typed_data();
  const float* ns = norms.typed_data();
  const uint16_t* sw = reinterpret_cast<const uint16_t*>(screen.untyped_data());
  const bool exact_bf16 = exact.element_type() == ffi::DataType::BF16;  // a bf16 head: its own screen
  if (!exact_bf16 && exact.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("dsjax_greedy_head: exact tiles must be float32 or bfloat16");
  const float* ew = static_cast<const float*>(exact.untyped_data());
  const uint16_t* ehw = static_cast<const uint16_t*>(exact.untyped_data());
  float* ap = approx->typed_data();
  int32_t* out = tokens->typed_data();

  const double gamma = 2.0 * d * 0x1p-24 / (1.0 - 2.0 * d * 0x1p-24);
  const double c = (0x1p-7 + 0x1p-16 + (2.0 + 0x1p-6) * gamma + 0x1p-20) * (1.0 + 0x1p-10);
  std::vector<float> e(rows);
  std::vector<uint8_t> ok(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t k = 0; k < d; ++k) ss += double(xs[r * d + k]) * xs[r * d + k];
    double norm = std::sqrt(ss);
    double bound = c * norm * (1.0 + 0x1p-20);
    ok[r] = std::isfinite(norm) && norm >= 0x1p-30 && bound < 1e30;  // else the caller's path
    e[r] = ok[r] ? float(bound) * (1.0f + 0x1p-20f) : 0.0f;
  }
#ifdef __AVX512BF16__
  const bool dot = d % 2 == 0;
  std::vector<uint32_t> pairs(dot ? rows * d / 2 : 0);  // bf16(x) (round to nearest even), k pairs
  for (int64_t i = 0; i < int64_t(pairs.size()); ++i) pairs[i] = bf16_bits(xs[2 * i]) | bf16_bits(xs[2 * i + 1]) << 16;
#endif

  // 1-2: the screen's logits and each item's bounds, shared out over the threads as `run`
  Screen s;
  const int64_t items = (nt + kItem - 1) / kItem;
  s.lo.resize(items * rows);
  s.hi.resize(items * rows);
  s.finite.resize(items * rows);
  parallel_items(pool, items, [&](int64_t i) {
    int64_t t0 = i * kItem, t1 = std::min(nt, (i + 1) * kItem);
#ifdef __AVX512BF16__
    if (dot)
      dot_tiles(pairs.data(), rows, d, sw, ap, stride, t0, t1);
    else
#endif
      tiles(xs, rows, d, sw, ap, stride, t0, t1);
    screen_item(ap, rows, stride, ns, e.data(), t0 * kTile, t1 * kTile, vocab, s, i);
  });

  // 3-4: per row, the candidates' exact logits
  float exact_tile[kTile];
  for (int64_t r = 0; r < rows; ++r) {
    out[r] = -1;
    if (!ok[r]) continue;
    float t = -INFINITY;
    bool finite = true;
    for (int64_t i = 0; i < items; ++i) {
      t = std::max(t, s.lo[i * rows + r]);
      finite &= s.finite[i * rows + r] != 0;
    }
    if (!finite || !std::isfinite(t)) continue;
    const float* a = ap + r * stride;
    int64_t candidates = 0, best = -1;
    float best_value = -INFINITY;
    bool good = true;
    for (int64_t i = 0; i < items && good; ++i) {
      if (!(s.hi[i * rows + r] >= t)) continue;
      for (int64_t tile = i * kItem; tile < std::min(nt, (i + 1) * kItem) && good; ++tile) {
        int64_t j0 = tile * kTile, j1 = std::min(j0 + kTile, vocab);
        bool candidate = false;
        for (int64_t j = j0; j < j1; ++j) candidate |= a[j] + e[r] * ns[j] >= t;
        if (!candidate) continue;
        if (++candidates > kMaxCandidateTiles) { good = false; break; }
        if (exact_bf16)
          tile_rows<1>(xs + r * d, d, ehw + tile * d * kTile, exact_tile, kTile);
        else
          tile_rows<1>(xs + r * d, d, ew + tile * d * kTile, exact_tile, kTile);
        for (int64_t j = j0; j < j1; ++j) {
          float v = exact_tile[j - j0];
          if (!std::isfinite(v)) { good = false; break; }
          if (v > best_value) { best_value = v; best = j; }
        }
      }
    }
    if (good && best >= 0) out[r] = int32_t(best);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- a host function by number
// `dsjax_host_call`: the Python function registered under the attribute `key`
// (dsjax/kernels/cpu.py `register_host_function`) reads every argument buffer and fills every
// result buffer, on the host. Where `jax.pure_callback` ties a program to Python objects of the
// process that compiled it (JAX's persistent cache cannot keep such a program), this names the
// function by a number, so a program holding it is kept and runs in any process that
// registered a function under that number. Per buffer the function gets its address and
// (element type, rank, dims...) in `meta`; it returns 0, or non-zero after reporting an error.
typedef int (*HostFunction)(int64_t key, int64_t n_args, int64_t n_rets, void** buffers, const int64_t* meta);
std::atomic<HostFunction> host_function{nullptr};

void describe(const ffi::AnyBuffer& b, std::vector<void*>& buffers, std::vector<int64_t>& meta) {
  buffers.push_back(b.untyped_data());
  auto dims = b.dimensions();
  meta.push_back(static_cast<int64_t>(b.element_type()));
  meta.push_back(static_cast<int64_t>(dims.size()));
  for (int64_t d : dims) meta.push_back(d);
}

ffi::Error HostCall(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t key) {
  HostFunction f = host_function.load();
  if (f == nullptr) return ffi::Error::Internal("dsjax_host_call: no host function set (dsjax.kernels.cpu)");
  std::vector<void*> buffers;
  std::vector<int64_t> meta;
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    describe(*b, buffers, meta);
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) return r.error();
    describe(**r, buffers, meta);
  }
  if (f(key, int64_t(args.size()), int64_t(rets.size()), buffers.data(), meta.data()) != 0)
    return ffi::Error::Internal("dsjax_host_call: the host function " + std::to_string(key) +
                                " failed (its error is printed above)");
  return ffi::Error::Success();
}


// ---------------------------------------------------------------- a step's MoE FFN
// out [T, D] = sum_k weights[t, k] * expert_{idx[t, k]}(x[t]) + shared(x[t]), with
// expert(x) = W2 h, h = silu(min(W1 x, L)) * clip(W3 x, -L, L), every weight fp32 or every
// weight 16-bit ([out, in] as stored, each one of a stack at its `at`), in one call: each
// chosen expert's three products for up to kMoeItemRows of its rows, and the shared expert's,
// are one work item each (a decode step: an expert read once; a prompt chunk: an expert's
// rows in a few items that read it from cache), shared out over the threads, then each row's
// sum over its k in order. Every product is `rows_product`'s, so a row's outputs do not
// depend on the other rows or on how they were cut into items.
//
// Why: at decode the three expert products, the SwiGLU, the shared expert and the sums ran as
// ~15 XLA:CPU thunks a layer, each a fixed cost against its few microseconds of reading; in a
// prompt chunk XLA's tile loop copied each tile's expert out of the layer stack before its
// GEMM (a third of the MoE's time in a 128-token prefill on an Intel Xeon).
inline float swiglu(float gate, float up, float limit) {
  float g = std::min(gate, limit), u = std::clamp(up, -limit, limit);
  return g / (1.0f + std::exp(-g)) * u;
}

// rows [n] of x through one expert (w1 / w3 [I, D], w2 [D, I]) -> y [n, D]
template <typename W>
void ffn_rows(const float* x, int64_t n, int64_t d, int64_t inter, const W* w1, const W* w3, const W* w2, float limit,
              float* y) {
  std::vector<float> gate(n * inter), up(n * inter);
  rows_product(x, n, d, w1, gate.data(), inter, 0, inter);
  rows_product(x, n, d, w3, up.data(), inter, 0, inter);
  for (int64_t i = 0; i < n * inter; ++i) gate[i] = swiglu(gate[i], up[i], limit);
  rows_product(gate.data(), n, inter, w2, y, d, 0, d);
}

constexpr int64_t kMoeItemRows = 16;  // rows of one expert a work item

template <typename W>
void moe_rows(ffi::ThreadPool& pool, const float* xs, const float* wt, const int32_t* idx, int64_t t, int64_t d,
              int64_t k, const W* const* w, int64_t n_experts, int64_t inter, int64_t shared, float limit, float* o) {
  ExpertGroups groups(idx, t * k, n_experts);
  struct Item { int64_t group, first, n; };  // group -1: the shared expert's rows [first, first + n)
  std::vector<Item> items;
  for (int64_t r = 0; r < t; r += kMoeItemRows) items.push_back({-1, r, std::min(kMoeItemRows, t - r)});
  for (int64_t g = 0; g < groups.size(); ++g)
    for (int64_t i = groups.starts[g]; i < groups.starts[g + 1]; i += kMoeItemRows)
      items.push_back({g, i, std::min(kMoeItemRows, groups.starts[g + 1] - i)});
  std::vector<float> routed(t * k * d), own(t * d);
  parallel_items(pool, int64_t(items.size()), [&](int64_t j) {
    const Item& it = items[j];
    if (it.group < 0) {
      ffn_rows(xs + it.first * d, it.n, d, shared, w[3], w[4], w[5], limit, own.data() + it.first * d);
      return;
    }
    int64_t e = groups.expert(groups.order[it.first]);
    std::vector<float> rows(it.n * d), ys(it.n * d);
    for (int64_t i = 0; i < it.n; ++i)
      std::memcpy(&rows[i * d], xs + groups.order[it.first + i] / k * d, d * sizeof(float));
    ffn_rows(rows.data(), it.n, d, inter, w[0] + e * inter * d, w[1] + e * inter * d, w[2] + e * d * inter, limit,
             ys.data());
    for (int64_t i = 0; i < it.n; ++i)
      std::memcpy(&routed[groups.order[it.first + i] * d], &ys[i * d], d * sizeof(float));
  });
  for (int64_t r = 0; r < t; ++r)
    for (int64_t c = 0; c < d; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        volatile float term = routed[(r * k + j) * d + c] * wt[r * k + j];  // rounded, as XLA's product then sum
        sum += term;
      }
      o[r * d + c] = sum + own[r * d + c];
    }
}

ffi::Error MoeRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weights,
                   ffi::Buffer<ffi::S32> idx, ffi::RemainingArgs stacks, ffi::ResultBuffer<ffi::F32> out,
                   float limit) {
  const char* name = "dsjax_moe_rows";
  auto xd = x.dimensions(), kd = idx.dimensions();
  if (xd.size() != 2 || kd.size() != 2 || kd[0] != xd[0] || weights.dimensions().size() != 2 ||
      weights.dimensions()[0] != kd[0] || weights.dimensions()[1] != kd[1] || stacks.size() != 12)
    return ffi::Error::InvalidArgument(std::string(name) + ": x [T, D], weights / idx [T, K] and six (stack, at) expected");
  int64_t t = xd[0], d = xd[1], k = kd[1];
  // (w1, w3, w2) routed [*lead, E, I, D] / [*lead, E, D, I], then shared [*lead, Is, D] / [*lead, D, Is]
  const void* base[6];
  int64_t offsets[6], dims[6][3];  // per weight: where it begins; experts (1 for shared), out, in
  auto kind = [](ffi::DataType type) {  // fp32, bf16 (or its uint16 bits), else none the kernels read
    return type == ffi::DataType::F32 ? 0 : type == ffi::DataType::BF16 || type == ffi::DataType::U16 ? 1 : -1;
  };
  for (int j = 0; j < 6; ++j) {
    auto stack = stacks.get<ffi::AnyBuffer>(2 * j);
    auto at = stacks.get<ffi::Buffer<ffi::S32>>(2 * j + 1);
    if (stack.has_error() || at.has_error()) return ffi::Error::InvalidArgument(std::string(name) + ": bad argument");
    auto sd = stack->dimensions();
    auto ad = at->dimensions();
    int64_t lead = ad.size() == 1 ? ad[0] : -1, rank = j < 3 ? 3 : 2;
    if (lead < 0 || int64_t(sd.size()) != lead + rank)
      return ffi::Error::InvalidArgument(std::string(name) +
                                         ": weights [*lead, (E,) O, I] and at [len(lead)] expected");
    if (kind(stack->element_type()) != kind(stacks.get<ffi::AnyBuffer>(0)->element_type()))
      return ffi::Error::InvalidArgument(std::string(name) + ": all fp32 or all 16-bit weights");
    dims[j][0] = rank == 3 ? sd[lead] : 1;
    dims[j][1] = sd[lead + rank - 2];
    dims[j][2] = sd[lead + rank - 1];
    base[j] = stack->untyped_data();
    offsets[j] = stack_offset(sd, at->typed_data(), lead, dims[j][0] * dims[j][1] * dims[j][2]);
  }
  int64_t n_experts = dims[0][0], inter = dims[0][1], shared = dims[3][1];
  for (int j = 0; j < 3; ++j)
    if (dims[j][0] != n_experts || dims[j][1] != (j == 2 ? d : inter) || dims[j][2] != (j == 2 ? inter : d) ||
        dims[j + 3][1] != (j == 2 ? d : shared) || dims[j + 3][2] != (j == 2 ? shared : d))
      return ffi::Error::InvalidArgument(std::string(name) + ": weight shapes do not match x");
  auto first = stacks.get<ffi::AnyBuffer>(0);
  return with_weights(*first, offsets[0], name, [&](auto w1) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(w1)>>;
    const W* ws[6];
    for (int j = 0; j < 6; ++j) ws[j] = static_cast<const W*>(base[j]) + offsets[j];
    moe_rows(pool, x.typed_data(), weights.typed_data(), idx.typed_data(), t, d, k, ws, n_experts, inter, shared,
             limit, out->typed_data());
  });
}



// ---------------------------------------------------------------- mHC: a sublayer's input
// For each row of streams X [R, N, D] (fp32), what dsjax/layers/hyper_connection.py computes
// before a sublayer: mix = (fn @ v) * rsqrt(mean(v^2) + eps), v = X flattened; pre = sigmoid(mix[:N]
// * s0 + b) + hc_eps; post = 2 sigmoid(mix[N:2N] * s1 + b); comb = Sinkhorn(mix[2N:] * s2 + b)
// (a row softmax plus hc_eps, a column normalisation, then `iters - 1` row / column passes, each
// sum plus hc_eps); h = norm * RMSNorm(sum_i w_i X_i), w = pre (or the given weights: DeepSeek-V4.1's
// lagged collapse). fn, base and scale may be one layer of stacks [*lead, ...] (`at` its place:
// read where they lie). The product is `rows_product`'s; the rest row by row, one thread.
//
// Why: ~20 XLA:CPU thunks a sublayer (the Sinkhorn a loop of small reductions) for a few
// thousand multiply-adds a row, a third of a batch-1 step's thunks.
inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

ffi::Error HcInput(ffi::Buffer<ffi::F32> streams, ffi::Buffer<ffi::F32> fn, ffi::Buffer<ffi::F32> base,
                   ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> at, ffi::Buffer<ffi::F32> norm,
                   ffi::Buffer<ffi::F32> with, ffi::ResultBuffer<ffi::F32> h, ffi::ResultBuffer<ffi::F32> pre, ffi::ResultBuffer<ffi::F32> post,
                   ffi::ResultBuffer<ffi::F32> comb, float eps, float hc_eps, int64_t iters) {
  auto sd = streams.dimensions();
  if (sd.size() != 3) return ffi::Error::InvalidArgument("dsjax_hc_input: streams [R, N, D] expected");
  int64_t rows = sd[0], n = sd[1], d = sd[2], width = (2 + n) * n, flat = n * d;
  auto wd = with.dimensions();
  bool lagged = wd.size() == 2 && wd[0] == rows && wd[1] == n;
  auto fd = fn.dimensions(), bd = base.dimensions(), cd = scale.dimensions();
  int64_t lead = at.dimensions().size() == 1 ? at.dimensions()[0] : -1;
  if (lead < 0 || int64_t(fd.size()) != lead + 2 || int64_t(bd.size()) != lead + 1 || int64_t(cd.size()) != lead + 1 ||
      fd[lead] != width || fd[lead + 1] != flat || bd[lead] != width || cd[lead] != 3 || norm.element_count() != d ||
      !(lagged || with.element_count() == 0) || n > 16)
    return ffi::Error::InvalidArgument(
        "dsjax_hc_input: fn [*lead, (2+N)N, ND], base [*lead, (2+N)N], scale [*lead, 3], at [len(lead)], norm [D], "
        "with [R, N] or [0] expected (N <= 16)");
  const int32_t* place = at.typed_data();
  const float* x = streams.typed_data();
  std::vector<float> mix(rows * width);
  rows_product(x, rows, flat, fn.typed_data() + stack_offset(fd, place, lead, width * flat), mix.data(), width, 0,
               width);
  const float* b = base.typed_data() + stack_offset(bd, place, lead, width);
  const float* sc = scale.typed_data() + stack_offset(cd, place, lead, 3);
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * flat;
    float ss = 0.0f;
    for (int64_t j = 0; j < flat; ++j) ss += v[j] * v[j];
    float inv = 1.0f / std::sqrt(ss / float(flat) + eps);
    float* m = mix.data() + r * width;
    for (int64_t j = 0; j < width; ++j) m[j] *= inv;
    float* pr = pre->typed_data() + r * n;
    float* po = post->typed_data() + r * n;
    for (int64_t i = 0; i < n; ++i) {
      pr[i] = sigmoid(m[i] * sc[0] + b[i]) + hc_eps;
      po[i] = 2.0f * sigmoid(m[n + i] * sc[1] + b[n + i]);
    }
    float c[16][16];
    for (int64_t i = 0; i < n; ++i) {  // softmax over each row, plus hc_eps
      float top = -INFINITY, sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) top = std::max(top, c[i][j] = m[2 * n + i * n + j] * sc[2] + b[2 * n + i * n + j]);
      for (int64_t j = 0; j < n; ++j) sum += c[i][j] = std::exp(c[i][j] - top);
      for (int64_t j = 0; j < n; ++j) c[i][j] = c[i][j] / sum + hc_eps;
    }
    auto columns = [&] {
      for (int64_t j = 0; j < n; ++j) {
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += c[i][j];
        for (int64_t i = 0; i < n; ++i) c[i][j] = c[i][j] / (sum + hc_eps);
      }
    };
    columns();
    for (int64_t t = 1; t < iters; ++t) {
      for (int64_t i = 0; i < n; ++i) {
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) sum += c[i][j];
        for (int64_t j = 0; j < n; ++j) c[i][j] = c[i][j] / (sum + hc_eps);
      }
      columns();
    }
    float* co = comb->typed_data() + r * n * n;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) co[i * n + j] = c[i][j];
    const float* w = lagged ? with.typed_data() + r * n : pr;
    float* hr = h->typed_data() + r * d;
    float hs = 0.0f;
    for (int64_t k = 0; k < d; ++k) {
      float acc = 0.0f;
      for (int64_t i = 0; i < n; ++i) acc += w[i] * v[i * d + k];
      hr[k] = acc;
      hs += acc * acc;
    }
    float hinv = 1.0f / std::sqrt(hs / float(d) + eps);
    const float* nw = norm.typed_data();
    for (int64_t k = 0; k < d; ++k) hr[k] = nw[k] * (hr[k] * hinv);
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" void DsjaxSetHostFunction(HostFunction f) { host_function.store(f); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsjaxHostCall, HostCall,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int64_t>("key"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsjaxGreedyHead, GreedyHead,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("vocab")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsjaxRowsProduct, RowsProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsjaxExpertRowsProduct, ExpertRowsProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsjaxMoeRows, MoeRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("limit"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsjaxHcInput, HcInput,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<float>("hc_eps")
                                  .Attr<int64_t>("iters"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsjaxVocabHead, VocabHead,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether the greedy screen's pass multiplies in bf16 pairs (AVX512-BF16): the engine screens
// up to 16 rows with it, 4 without (dsjax/layers/cpu_kernels.py `screen_rows`).
extern "C" int DsjaxScreenDot() {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}
