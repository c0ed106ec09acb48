// Blocked (flash-attention style) attention of a tile of query rows of one sequence, for the
// prefill chunks of paged_attention (cpu_attn_tile.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu_math.h"

namespace vun {

// The element type of the K|V rows a tile reads: fp32 rows are read where they lie, 16-bit
// ones widened per key block.
enum class TileKV { kF32, kF16, kBF16 };

// One tile: `rows` query rows of one sequence x the `heads` query heads of one KV head.
// Row t attends to the keys [first[t], len[t]) (first < len); the key at position p has its
// key and value rows at keys[p - k0] and values[p - k0] (dim elements of `type` each), for p
// in [k0, k1) with k0 <= min(first) and k1 >= max(len). q: fp32 [rows, heads, dim]; out: fp32
// [rows, heads, dim]; opts: soft-capping and the heads' sinks (ScoreOpts).
struct AttendTile {
  const float* q;
  size_t rows, heads, dim;
  const int64_t* first;
  const int64_t* len;
  const void* const* keys;
  const void* const* values;
  int64_t k0, k1;
  TileKV type;
  float scale;
  ScoreOpts opts;
  float* out;
};

// Whether attend_tile runs here for this head size: 64, 128 or 256, on AVX-512 (F, DQ, BW,
// VL; an ISA cap of avx512 or amx) or AVX2 with FMA and F16C (a cap of avx2 or above).
bool attend_tile_usable(size_t dim);

// The instruction set attend_tile runs on here: "avx512", "avx2" or "" (none: the row kernel
// takes every row).
const char* attend_tile_isa();

// The most query rows a tile holds (paged_attention cuts prefill chunks into such tiles).
constexpr size_t kTileRows = 16;

// out[t, h] = softmax_j(scale * q[t, h] . K_j) . V_j over row t's keys, fp32, by key blocks of
// 32 positions aligned to multiples of 32 with an online softmax (running maximum and sum per
// row and head). Each row's arithmetic is a function of its own query and keys alone: the same
// operations in the same order whatever other rows the tile holds, its keys' blocks fixed by
// their absolute positions, keys outside the row's range contributing exactly nothing (a
// result's zero is always +0). Requires attend_tile_usable(dim).
void attend_tile(const AttendTile& t);

} // namespace vun
