// What ember's AMX kernels share: the tile configuration and the permission to use the tiles.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "vec.h"

namespace ember_amx {

using ember_vec::bf16;

// Every tile is 16 rows x 64 bytes: a 16 x 32 bf16 or 16 x 64 int8 operand, or a 16 x 16 fp32 / int32 result.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Called on each thread before its first tile instruction (and paired with _tile_release()).
inline void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// 1 when Linux grants this process the AMX tile state (asked once; later calls are no-ops).
inline int tiles_usable() {
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : 0;
}

}  // namespace ember_amx
