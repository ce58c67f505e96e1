// How ember's streaming products (linear_f32.cpp, linear_bf16.cpp) share a matrix's strips among torch's OpenMP
// threads: one counter, each thread claiming the strip it computes next before it computes the one it holds, so that
// strip's passes can prefetch the next (a query's products are bound by that stream), and a core the host runs
// slower takes fewer strips instead of keeping the other waiting at the end. One strip is computed whole by one
// thread, so the sums do not depend on which.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace ember_strips {

// run(j, after) for every strip j < strips, on torch's pool; `after` is the strip the same thread computes next
// (strips when there is none). One thread per strip at most: a thread with no strip to claim would only be woken to
// find none.
template <typename Run>
inline void claim(int64_t strips, Run&& run) {
  alignas(64) std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(strips, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t j = next.fetch_add(1, std::memory_order_relaxed), after; j < strips; j = after) {
      after = next.fetch_add(1, std::memory_order_relaxed);
      run(j, after);
    }
  });
}

// The register blocks of M rows, `blocks` of them, as even as they can be (the larger first): run(b, m, n) for
// block b, rows m .. m + n - 1, in order.
template <typename Run>
inline void row_blocks(int64_t M, int64_t blocks, Run&& run) {
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t n = (M - m + (blocks - b) - 1) / (blocks - b);  // what is left, shared evenly
    run(b, m, n);
    m += n;
  }
}

}  // namespace ember_strips
