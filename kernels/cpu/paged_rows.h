// Locating a request's cached K/V rows through its block table, 16 logical positions at a time.
//
// The attention kernels walk a context in chunks of 16 positions starting at multiples of 16.
// Position t lives at slot table[t / block_size] * block_size + t % block_size; a slot's row
// holds all KV heads ([KVH, D]), so a head's vector is row + head * D. With block_size a
// multiple of 16 a chunk never straddles two blocks and costs one division; other block sizes
// take the per-position path.
#pragma once

#include <cstdint>

namespace kvfleet {

// rows[j] = start of position c0 + j's row (all heads) for j < n; rows[n..16) are untouched.
template <typename T>
inline void chunk_rows(const T* cache, const int32_t* table, int64_t block_size, int64_t row,
                       int64_t c0, int n, const T** rows) {
  if (block_size % 16 == 0) {
    const T* base = cache + (static_cast<int64_t>(table[c0 / block_size]) * block_size +
                             c0 % block_size) * row;
    for (int j = 0; j < n; ++j) rows[j] = base + j * row;
    return;
  }
  for (int j = 0; j < n; ++j) {
    const int64_t t = c0 + j;
    rows[j] = cache + (static_cast<int64_t>(table[t / block_size]) * block_size +
                       t % block_size) * row;
  }
}

}  // namespace kvfleet
