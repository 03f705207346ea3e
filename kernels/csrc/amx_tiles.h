// What an AMX kernel needs before its first tile instruction: Linux's leave for the process to use
// the tile registers, and a tile configuration loaded on the calling thread.

#pragma once

#if defined(__AMX_TILE__)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace raypage {

// Linux lends a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); until then the first tile instruction faults. Asked once per process.
inline bool amx_permitted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
}

// Rows and bytes a row of each of the eight tiles (palette 1); loading it zeroes the tiles. Tile
// state is per thread: each thread of a call loads its own.
struct TileShapes {
  uint8_t rows[8];
  uint16_t bytes[8];
};

inline void configure_tiles(const TileShapes& shapes) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = shapes.bytes[t];
    config.rows[t] = shapes.rows[t];
  }
  asm volatile("" ::: "memory");  // GCC's configuration load (a builtin) does not say it reads memory
  _tile_loadconfig(&config);
}

}  // namespace raypage

#endif
