/* AMX tile configuration shared by the AMX kernels (amx_gemm.c; paged_decode.c's "amx" build).
 *
 * Every kernel here uses tiles 0-7 as 16 rows of 64 bytes: C 16 x 16 fp32, A 16 x 32 bf16, B 16 pair rows x 16
 * x 2 bf16 (the layout TDPBF16PS reads; Intel SDM, "LDTILECFG": palette 1, 64-byte configuration block).
 * Included by a source built with -mamx-tile; engine.native_build hashes this file into every build that
 * includes it. */
#ifndef PREFIXGATE_AMX_TILES_H
#define PREFIXGATE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* Load the configuration: tiles 0-7 each 16 rows x 64 bytes. Each thread runs it before its first tile
 * instruction (the process must hold Linux's permission for the tile data state). */
static inline void amx_load_tiles_16x64(void) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

#endif
