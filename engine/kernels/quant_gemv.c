/* y[M, N] = x[M, K] @ W.T for GGUF 4-bit (Q4_0 / Q4_1) and 8-bit (Q8_0) weights, fp32 in, fp32 out
 * (prefixgate engine.native_linear).
 *
 * The weights are repacked at load (engine.native_linear.pack_int4 / pack_int8) into tiles of 16 output rows;
 * a tile is a run of blocks, one per group of 32 inputs, each block holding the 16 rows' scales (f16, exact:
 * the GGUF's own d and m) and codes interleaved so that lane j of a 16-lane vector is output row j:
 *
 *   int4 block (320 bytes): d[16] f16, m[16] f16, then for i = 0..15: 16 bytes, byte j = q[j][i] | q[j][i+16] << 4
 *   int8 block (544 bytes): d[16] f16, then for i = 0..31: 16 bytes, byte j = q[j][i] (int8)
 *
 * int4: w[j][k] = (q - 8) * d + zero, zero = m + 8 d (Q4_0: m = -8 d, zero 0), as engine.quantized's Int4Groups;
 * per group g the kernel computes, in fp32, acc = sum_i (q_i - 8) * x_i (four partial sums over i in a fixed
 * order, fused multiply-adds; q - 8 is exact) and y += d * acc + zero * S_g, S_g = sum of the group's 32 inputs.
 * int8: w = q * d, y += d * sum_i q_i x_i. Codes become floats by a table lookup (vpermps) or a widening
 * conversion; x[k] is broadcast.
 *
 * Every output element is computed by the same sequence of fp32 operations whatever M, the rows computed with
 * it, the tile range or the thread count: row i of an M-row call is bit-identical to the 1-row call of that
 * row (batch invariance). Rows are taken 4 at a time so one tile's decoded codes serve 4 rows; each row keeps
 * its own accumulators.
 *
 * Two builds (engine.native_linear picks one from the CPU's flags): AVX-512 F/BW/VL, a tile's 16 rows in one
 * 512-bit vector; AVX2, the same tile as two 8-lane halves (rows 0-7, then 8-15), taken 2 rows of x at a time
 * (16 ymm registers), or from PANEL_MIN_ROWS rows of x up each half's codes widened once into a panel of floats
 * that every row then runs against (the panel path, below: prompt rows). Each lane (output row) goes through
 * the same sequence of fp32 operations in both builds and paths: codes become the same exact floats (q - 8 by
 * a table or by integer subtraction and conversion), the same fused multiply-adds into the same four partial
 * sums, the same adds, and the group sums of x by one portable function that adds in _mm512_reduce_add_ps's
 * tree order.
 *
 * A third build (-mavx512vnni -mavx512vbmi, engine.native_linear.Int8ActivationKernel) adds q4_gemv_i8 and
 * q8_gemv_i8, the same weights with int8 activations (the end of the file).
 *
 * Built by engine.native_build (gcc -O3, -fopenmp for the tile split and the panel path's row packing; no
 * -ffast-math, -ffp-contract=off).
 * Returns 0, or -1 for bad arguments (nothing written), -2 out of memory.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define INLINE static inline __attribute__((always_inline))
#define TILE 16
#define QK 32
#define Q4_BLOCK 320
#define Q8_BLOCK 544
#define ROWS 4 /* x rows sharing one decode of a tile's codes */

/* Weight bytes ahead of the block being decoded that each block's loop prefetches (a tile's blocks, then the next
 * tiles', are one stream in memory). The hardware prefetchers stop at 4 KB pages; one GEMV row at one thread read
 * its weights from memory at ~30 GB/s without this, ~35 with it (Zen 4; 8-16 KB ahead measured alike, 2 KB and
 * 32 KB less). Prefetches only: never a fault, nothing computed differently. */
#ifndef GEMV_PREFETCH_BYTES
#define GEMV_PREFETCH_BYTES 8192
#endif

/* The prefetches' locality (__builtin_prefetch's third argument: 0 prefetchnta .. 3 prefetcht0), set per CPU
 * vendor by the build (engine.native_linear.prefetch_flags): prefetchnta on AMD, where it was measured (above);
 * prefetcht1 (into L2) elsewhere: on an AMX Xeon, whose weights stream from its L3, prefetchnta made the GEMVs 2-4x
 * slower than prefetcht1, and slower than no prefetch (docs/engine-step.md, "The weight stream's prefetch hint"). */
#ifndef GEMV_PREFETCH_LOCALITY
#define GEMV_PREFETCH_LOCALITY 2
#endif

/* the cache lines of the block_bytes bytes GEMV_PREFETCH_BYTES past b, for reading once */
INLINE void prefetch_ahead(const uint8_t *b, int64_t block_bytes) {
    for (int64_t o = 0; o < block_bytes; o += 64)
        __builtin_prefetch(b + GEMV_PREFETCH_BYTES + o, 0, GEMV_PREFETCH_LOCALITY);
}

/* The sum of p[0..31] in fp32, in a fixed order on every ISA: the two 16-element halves added lane by lane,
 * then the 16 lanes by the tree of GCC's _mm512_reduce_add_ps (upper 8 + lower 8, upper 4 + lower 4, lanes
 * {0, 1} + {2, 3}, then lane 0 + lane 1). fp32 addition is commutative, so the order of each pair's operands
 * does not matter; without -ffast-math nothing is reassociated. */
INLINE float sum32(const float *p) {
    float v[16], t3[8], t6[4];
    for (int j = 0; j < 16; j++) v[j] = p[j] + p[16 + j];
    for (int j = 0; j < 8; j++) t3[j] = v[8 + j] + v[j];
    for (int j = 0; j < 4; j++) t6[j] = t3[4 + j] + t3[j];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

/* S[r * G + g] = sum of x[r][32 g .. 32 g + 31] (sum32) */
static void group_sums(const float *x, int64_t m, int64_t k, float *s) {
    const int64_t G = k / QK;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < G; g++) s[r * G + g] = sum32(x + r * k + g * QK);
}

#ifdef __AVX512F__

INLINE void q4_tile(const uint8_t *w, int64_t G, const float *x, int64_t k, const float *s, int R, __m512 *out) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 eight = _mm512_set1_ps(8.0f);
    __m512 y[ROWS];
    for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q4_BLOCK;
        const uint8_t *q = b + 64;
        prefetch_ahead(b, Q4_BLOCK);
        __m512 a[ROWS][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) a[r][j] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(q + 16 * i)));
            const __m512 lo = _mm512_permutexvar_ps(v, table); /* low 4 bits of each lane: q[j][i] - 8 */
            const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            for (int r = 0; r < R; r++) {
                const float *xg = x + r * k + g * QK;
                a[r][i & 1] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xg[i]), a[r][i & 1]);
                a[r][2 + (i & 1)] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xg[i + 16]), a[r][2 + (i & 1)]);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)b));
        const __m512 zero = _mm512_fmadd_ps(eight, d, _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(b + 32))));
        for (int r = 0; r < R; r++) {
            const __m512 acc = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
            y[r] = _mm512_fmadd_ps(d, acc, y[r]);
            y[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(s[r * G + g]), y[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = y[r];
}

INLINE void q8_tile(const uint8_t *w, int64_t G, const float *x, int64_t k, int R, __m512 *out) {
    __m512 y[ROWS];
    for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q8_BLOCK;
        const uint8_t *q = b + 32;
        prefetch_ahead(b, Q8_BLOCK);
        __m512 a[ROWS][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) a[r][j] = _mm512_setzero_ps();
#pragma GCC unroll 32
        for (int i = 0; i < 32; i++) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(q + 16 * i))));
            for (int r = 0; r < R; r++)
                a[r][i & 3] = _mm512_fmadd_ps(f, _mm512_set1_ps(x[r * k + g * QK + i]), a[r][i & 3]);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)b));
        for (int r = 0; r < R; r++) {
            const __m512 acc = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
            y[r] = _mm512_fmadd_ps(d, acc, y[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = y[r];
}

/* one tile, rows [r0, r0 + R): R a constant after inlining, so the accumulators live in registers */
#define RUN_TILE(BITS, R, ...)                                                                                 \
    do {                                                                                                       \
        __m512 o[ROWS];                                                                                        \
        BITS##_tile(__VA_ARGS__, R, o);                                                                        \
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (r0 + r) * n + t * TILE, mask, o[r]);          \
    } while (0)

static void q4_tiles(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, const float *s,
                     int64_t t0, int64_t t1, float *panel, const float *xp) {
    (void)panel, (void)xp;
    const int64_t G = k / QK;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *wt = w + t * G * Q4_BLOCK;
        const int64_t valid = n - t * TILE < TILE ? n - t * TILE : TILE;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const float *xr = x + r0 * k;
            const float *sr = s + r0 * G;
            switch (m - r0 < ROWS ? m - r0 : ROWS) {
            case 1: RUN_TILE(q4, 1, wt, G, xr, k, sr); break;
            case 2: RUN_TILE(q4, 2, wt, G, xr, k, sr); break;
            case 3: RUN_TILE(q4, 3, wt, G, xr, k, sr); break;
            default: RUN_TILE(q4, 4, wt, G, xr, k, sr); break;
            }
        }
    }
}

static void q8_tiles(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int64_t t0,
                     int64_t t1, float *panel, const float *xp) {
    (void)panel, (void)xp;
    const int64_t G = k / QK;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *wt = w + t * G * Q8_BLOCK;
        const int64_t valid = n - t * TILE < TILE ? n - t * TILE : TILE;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const float *xr = x + r0 * k;
            switch (m - r0 < ROWS ? m - r0 : ROWS) {
            case 1: RUN_TILE(q8, 1, wt, G, xr, k); break;
            case 2: RUN_TILE(q8, 2, wt, G, xr, k); break;
            case 3: RUN_TILE(q8, 3, wt, G, xr, k); break;
            default: RUN_TILE(q8, 4, wt, G, xr, k); break;
            }
        }
    }
}

#define PANEL_FLOATS(G) 0 /* no panels: a 512-bit tile's decode is already cheap beside its 4 rows' FMAs */
#define PANEL_MIN_ROWS INT64_MAX
#define PANEL_ROWS 1
static void pack_rows(const float *x, int64_t m, int64_t k, int int4, float *xp, float *s, int64_t b0, int64_t b1) {
    (void)x, (void)m, (void)k, (void)int4, (void)xp, (void)s, (void)b0, (void)b1;
}
#define THREAD_PANEL(panel, G, id) ((void)(panel), (void)(G), (void)(id), (float *)0)

#else /* AVX2 + FMA + F16C */

#define ROWS2 2 /* x rows sharing one decode of a half tile's codes (16 ymm registers) */

/* rows 8 half .. 8 half + 7 of a tile: as q4_tile's lanes, the codes of byte j of each 16-byte row read 8 at a
 * time; q - 8 by masking / shifting, subtracting 8 and converting (exact, as the AVX-512 table) */
INLINE void q4_half(const uint8_t *w, int64_t G, const float *x, int64_t k, const float *s, int R, int half,
                    __m256 *out) {
    const __m256i low4 = _mm256_set1_epi32(15), eight_i = _mm256_set1_epi32(8);
    const __m256 eight = _mm256_set1_ps(8.0f);
    __m256 y[ROWS2];
    for (int r = 0; r < R; r++) y[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q4_BLOCK;
        const uint8_t *q = b + 64 + 8 * half;
        if (!half) prefetch_ahead(b, Q4_BLOCK); /* half 1 reads the tile half 0 brought in */
        __m256 a[ROWS2][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16 * i)));
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, low4), eight_i));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight_i));
            for (int r = 0; r < R; r++) {
                const float *xg = x + r * k + g * QK;
                a[r][i & 1] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xg[i]), a[r][i & 1]);
                a[r][2 + (i & 1)] = _mm256_fmadd_ps(hi, _mm256_set1_ps(xg[i + 16]), a[r][2 + (i & 1)]);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 16 * half)));
        const __m256 zero =
            _mm256_fmadd_ps(eight, d, _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 32 + 16 * half))));
        for (int r = 0; r < R; r++) {
            const __m256 acc = _mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3]));
            y[r] = _mm256_fmadd_ps(d, acc, y[r]);
            y[r] = _mm256_fmadd_ps(zero, _mm256_set1_ps(s[r * G + g]), y[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = y[r];
}

INLINE void q8_half(const uint8_t *w, int64_t G, const float *x, int64_t k, int R, int half, __m256 *out) {
    __m256 y[ROWS2];
    for (int r = 0; r < R; r++) y[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q8_BLOCK;
        const uint8_t *q = b + 32 + 8 * half;
        if (!half) prefetch_ahead(b, Q8_BLOCK);
        __m256 a[ROWS2][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
#pragma GCC unroll 32
        for (int i = 0; i < 32; i++) {
            const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16 * i))));
            for (int r = 0; r < R; r++)
                a[r][i & 3] = _mm256_fmadd_ps(f, _mm256_set1_ps(x[r * k + g * QK + i]), a[r][i & 3]);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 16 * half)));
        for (int r = 0; r < R; r++) {
            const __m256 acc = _mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3]));
            y[r] = _mm256_fmadd_ps(d, acc, y[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = y[r];
}

/* store o[0 .. R) of half tile (t, half) as rows r0 .. r0 + R of y, its `valid` (1..8) outputs */
#define STORE_HALF(R)                                                                                          \
    for (int r = 0; r < R; r++) {                                                                              \
        float *dst = y + (r0 + r) * n + t * TILE + 8 * half;                                                   \
        if (valid == 8) {                                                                                      \
            _mm256_storeu_ps(dst, o[r]);                                                                       \
        } else {                                                                                               \
            float lanes[8];                                                                                    \
            _mm256_storeu_ps(lanes, o[r]);                                                                     \
            for (int j = 0; j < valid; j++) dst[j] = lanes[j];                                                 \
        }                                                                                                      \
    }

/* one half tile, rows [r0, r0 + R), its `valid` (1..8) outputs stored */
#define RUN_HALF(BITS, R, ...)                                                                                 \
    do {                                                                                                       \
        __m256 o[ROWS2];                                                                                       \
        BITS##_half(__VA_ARGS__, R, half, o);                                                                  \
        STORE_HALF(R);                                                                                         \
    } while (0)

/* the halves of tiles [t0, t1) that hold output rows, each for every row of x, ROWS2 at a time */
#define EACH_HALF(BODY)                                                                                        \
    for (int64_t t = t0; t < t1; t++)                                                                          \
        for (int half = 0; half < 2; half++) {                                                                 \
            const int64_t left = n - t * TILE - 8 * half;                                                      \
            if (left <= 0) break;                                                                              \
            const int valid = left < 8 ? (int)left : 8;                                                        \
            for (int64_t r0 = 0; r0 < m; r0 += ROWS2) {                                                        \
                BODY;                                                                                          \
            }                                                                                                  \
        }

/* Many rows (PANEL_MIN_ROWS and up): a half tile's codes are widened once, for every group, into a panel of the
 * exact floats q - 8 (int4) or q (int8) that q4_half / q8_half compute from them, with the group's d and zero
 * beside them; then every row of x runs against the panel, PANEL_ROWS rows at a time.
 *
 * The panel pairs inputs: one vector holds 4 outputs x 2 inputs, lanes [o0 i, o0 i+1, o1 i, o1 i+1, .., o3 i+1],
 * so one 64-bit broadcast of x[i], x[i + 1] feeds 8 lanes. Each group is two passes over pairs: int4 the low
 * nibbles (inputs 0-15) then the high ones (16-31); int8 inputs i % 4 in {0, 1}, then {2, 3}. In a pass the lane
 * of input parity e accumulates exactly the inputs q4_half's (q8_half's) partial sum a[e] (a[2 + e] in the second
 * pass) accumulates, in the same order; at the pass's end adjacent lanes are added (a0 + a1, a2 + a3: one fp32
 * add each), then the two passes (one add), giving outputs in the order [o0 o1 o4 o5 o2 o3 o6 o7] (swap_mid),
 * which y, d and zero keep until the store swaps them back. So every output goes through q4_half's (q8_half's)
 * sequence of fp32 operations: the same bits. Per pair of inputs and PANEL_ROWS rows: 2 weight loads and
 * PANEL_ROWS broadcasts for 2 PANEL_ROWS fused multiply-adds (12 accumulators), where the decode-per-row path
 * takes a decode and 4 broadcasts per 4. x is packed once per call (pack_rows, each thread its share of the row
 * blocks before any tile runs) so that a block's broadcasts read one stream. Measured against the per-row path
 * and the fp32 GEMM in docs/engine-step.md, "Prompt rows on the native kernel". */
#define PANEL_ROWS 6
#define PANEL_MIN_ROWS 16 /* from this many rows of x (fewer: the widening is not paid back) */
#define PANEL_VECS 32     /* 8-float vectors per group: 2 passes x 8 pairs x outputs 0-3, 4-7 */

/* 64-bit elements 0 2 1 3: lanes [o0 o1 o2 o3 o4 o5 o6 o7] <-> [o0 o1 o4 o5 o2 o3 o6 o7] (its own inverse) */
INLINE __m256 swap_mid(__m256 v) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8)); }

/* adjacent lanes added, as _mm256_hadd_ps: [a0+a1 a2+a3 b0+b1 b2+b3 | a4+a5 a6+a7 b4+b5 b6+b7] */
INLINE __m256 pair_sums(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
}

/* x[i], x[i + 1] in every lane pair */
INLINE __m256 pair(const float *x) { return _mm256_castpd_ps(_mm256_broadcast_sd((const double *)x)); }

/* the codes of inputs (i, i + 1) of the half tile's 8 outputs, interleaved: byte 2 j + e = output j, input i + e */
INLINE __m128i pair_codes(const uint8_t *q, int i) {
    return _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(q + 16 * i)),
                             _mm_loadl_epi64((const __m128i *)(q + 16 * (i + 1))));
}

/* the panel's d and zero (int8: d only), swap_mid-ordered: dz[16 g ..] */
INLINE void store_dz(float *dz, __m256 d, __m256 zero) {
    _mm256_store_ps(dz, swap_mid(d));
    _mm256_store_ps(dz + 8, swap_mid(zero));
}

/* panel of one int4 half tile: vector 16 pass + 2 j + h of group g (h: outputs 0-3, 4-7) holds inputs
 * 16 pass + 2 j and + 1, low nibbles in pass 0, high in pass 1 */
static void q4_widen(const uint8_t *w, int64_t G, int half, float *p, float *dz) {
    const __m256i low4 = _mm256_set1_epi32(15), eight_i = _mm256_set1_epi32(8);
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q4_BLOCK;
        const uint8_t *q = b + 64 + 8 * half;
        float *pg = p + g * PANEL_VECS * 8;
        for (int j = 0; j < 8; j++) {
            const __m128i c = pair_codes(q, 2 * j);
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_cvtepu8_epi32(h ? _mm_unpackhi_epi64(c, c) : c);
                _mm256_store_ps(pg + 8 * (2 * j + h),
                                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, low4), eight_i)));
                _mm256_store_ps(pg + 8 * (16 + 2 * j + h),
                                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight_i)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 16 * half)));
        store_dz(dz + 16 * g, d,
                 _mm256_fmadd_ps(eight, d, _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 32 + 16 * half)))));
    }
}

/* panel of one int8 half tile: vector 16 pass + 2 j + h of group g holds inputs 4 j + 2 pass and + 1 */
static void q8_widen(const uint8_t *w, int64_t G, int half, float *p, float *dz) {
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q8_BLOCK;
        const uint8_t *q = b + 32 + 8 * half;
        float *pg = p + g * PANEL_VECS * 8;
        for (int pass = 0; pass < 2; pass++)
            for (int j = 0; j < 8; j++) {
                const __m128i c = pair_codes(q, 4 * j + 2 * pass);
                for (int h = 0; h < 2; h++)
                    _mm256_store_ps(pg + 8 * (16 * pass + 2 * j + h),
                                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_unpackhi_epi64(c, c) : c)));
            }
        store_dz(dz + 16 * g, _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 16 * half))),
                 _mm256_setzero_ps());
    }
}

/* x packed for the panel path: rows in blocks of PANEL_ROWS (the last padded with zero rows), per block and
 * group the pairs in the order the kernel takes them, each pair's PANEL_ROWS rows side by side, so a block's
 * broadcasts read one stream: xp[(((b G + g) 2 + pass) 8 + j) PANEL_ROWS 2 + 2 r + e] = x[PANEL_ROWS b + r]
 * [32 g + XSTEP j + XPASS pass + e] (int4: XSTEP 2, XPASS 16; int8: 4, 2). Blocks [b0, b1) only; with s (int4),
 * their rows' group sums too, s[row G + g], zero for padding rows. */
static void pack_rows(const float *x, int64_t m, int64_t k, int int4, float *xp, float *s, int64_t b0, int64_t b1) {
    const int64_t G = k / QK;
    const int xstep = int4 ? 2 : 4, xpass = int4 ? 16 : 2;
    for (int64_t bl = b0; bl < b1; bl++) {
        for (int64_t g = 0; g < G; g++)
            for (int pass = 0; pass < 2; pass++)
                for (int j = 0; j < 8; j++) {
                    float *dst = xp + (((bl * G + g) * 2 + pass) * 8 + j) * PANEL_ROWS * 2;
                    for (int r = 0; r < PANEL_ROWS; r++) {
                        const int64_t row = bl * PANEL_ROWS + r;
                        const float *src = x + row * k + g * QK + xstep * j + xpass * pass;
                        dst[2 * r] = row < m ? src[0] : 0.0f;
                        dst[2 * r + 1] = row < m ? src[1] : 0.0f;
                    }
                }
        if (s == 0) continue;
        const int64_t row0 = bl * PANEL_ROWS, real = m - row0 < PANEL_ROWS ? m - row0 : PANEL_ROWS;
        group_sums(x + row0 * k, real, k, s + row0 * G);
        for (int64_t i = (row0 + real) * G; i < (row0 + PANEL_ROWS) * G; i++) s[i] = 0.0f;
    }
}

/* PANEL_ROWS rows of packed x (one block) against a panel; out swap_mid-ordered. ZERO: int4 (y += zero * S_g
 * after y += d * acc). */
INLINE void panel_rows(const float *p, const float *dz, int64_t G, const float *xp, const float *s, const int ZERO,
                       __m256 *out) {
    __m256 y[PANEL_ROWS];
    for (int r = 0; r < PANEL_ROWS; r++) y[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const float *pg = p + g * PANEL_VECS * 8;
        __m256 sums[2][PANEL_ROWS];
        for (int pass = 0; pass < 2; pass++) {
            const float *xg = xp + (g * 2 + pass) * 8 * PANEL_ROWS * 2;
            __m256 a[PANEL_ROWS][2]; /* outputs 0-3, 4-7 */
            for (int r = 0; r < PANEL_ROWS; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256 w0 = _mm256_load_ps(pg + 8 * (16 * pass + 2 * j));
                const __m256 w1 = _mm256_load_ps(pg + 8 * (16 * pass + 2 * j + 1));
                for (int r = 0; r < PANEL_ROWS; r++) {
                    const __m256 xb = pair(xg + (j * PANEL_ROWS + r) * 2);
                    a[r][0] = _mm256_fmadd_ps(w0, xb, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(w1, xb, a[r][1]);
                }
            }
            for (int r = 0; r < PANEL_ROWS; r++) sums[pass][r] = pair_sums(a[r][0], a[r][1]);
        }
        const __m256 d = _mm256_load_ps(dz + 16 * g);
        for (int r = 0; r < PANEL_ROWS; r++) {
            y[r] = _mm256_fmadd_ps(d, _mm256_add_ps(sums[0][r], sums[1][r]), y[r]);
            if (ZERO)
                y[r] = _mm256_fmadd_ps(_mm256_load_ps(dz + 16 * g + 8), _mm256_broadcast_ss(s + r * G + g), y[r]);
        }
    }
    for (int r = 0; r < PANEL_ROWS; r++) out[r] = y[r];
}

/* the panel path over tiles [t0, t1): per half tile, widen (BITS##_widen) then every block of packed rows,
 * storing the block's real rows */
#define PANEL_TILES(BITS, ZERO)                                                                                \
    do {                                                                                                       \
        float *dz = panel + G * PANEL_VECS * 8;                                                                \
        for (int64_t t = t0; t < t1; t++)                                                                      \
            for (int half = 0; half < 2; half++) {                                                             \
                const int64_t left = n - t * TILE - 8 * half;                                                  \
                if (left <= 0) break;                                                                          \
                const int valid = left < 8 ? (int)left : 8;                                                    \
                BITS##_widen(w + t * G * BITS##_BLOCK_BYTES, G, half, panel, dz);                              \
                for (int64_t r0 = 0; r0 < m; r0 += PANEL_ROWS) {                                               \
                    __m256 o[PANEL_ROWS];                                                                      \
                    panel_rows(panel, dz, G, xp + r0 * k, s + r0 * G, ZERO, o);                                \
                    const int rows = m - r0 < PANEL_ROWS ? (int)(m - r0) : PANEL_ROWS;                         \
                    for (int r = 0; r < rows; r++) o[r] = swap_mid(o[r]);                                      \
                    STORE_HALF(rows);                                                                          \
                }                                                                                              \
            }                                                                                                  \
    } while (0)
#define q4_BLOCK_BYTES Q4_BLOCK
#define q8_BLOCK_BYTES Q8_BLOCK

#define PANEL_FLOATS(G) ((G) * (PANEL_VECS * 8 + 16)) /* one half tile's panel, then its d and zero */
/* thread id's panel scratch in the call's buffer (NULL when the call takes no panels) */
#define THREAD_PANEL(panel, G, id) ((panel) ? (panel) + (id) * PANEL_FLOATS(G) : (float *)0)

/* panel: this thread's scratch of PANEL_FLOATS(G) floats (32-byte aligned); xp, s: the packed rows and their
 * padded group sums (pack_rows), xp NULL below PANEL_MIN_ROWS rows (then the per-row path) */
static void q4_tiles(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, const float *s,
                     int64_t t0, int64_t t1, float *panel, const float *xp) {
    const int64_t G = k / QK;
    if (xp != 0) {
        PANEL_TILES(q4, 1);
        return;
    }
    EACH_HALF({
        const uint8_t *wt = w + t * G * Q4_BLOCK;
        if (m - r0 < ROWS2)
            RUN_HALF(q4, 1, wt, G, x + r0 * k, k, s + r0 * G);
        else
            RUN_HALF(q4, 2, wt, G, x + r0 * k, k, s + r0 * G);
    })
}

static void q8_tiles(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int64_t t0,
                     int64_t t1, float *panel, const float *xp) {
    const int64_t G = k / QK;
    if (xp != 0) {
        const float *s = 0;
        PANEL_TILES(q8, 0);
        return;
    }
    EACH_HALF({
        const uint8_t *wt = w + t * G * Q8_BLOCK;
        if (m - r0 < ROWS2)
            RUN_HALF(q8, 1, wt, G, x + r0 * k, k);
        else
            RUN_HALF(q8, 2, wt, G, x + r0 * k, k);
    })
}

#endif

static int bad_args(const void *w, int64_t n, int64_t k, const void *x, int64_t m, const void *y, int threads) {
    return w == 0 || x == 0 || y == 0 || n <= 0 || k <= 0 || k % QK != 0 || m <= 0 || threads < 1 ||
           ((uintptr_t)w & 63) != 0;
}

/* the tiles of thread `id` of `threads`: a contiguous, static share (which thread computes a tile never
 * changes its arithmetic) */
#define SPLIT(T, threads, id, t0, t1)                                                                          \
    const int64_t t0 = (T) * (id) / (threads), t1 = (T) * ((id) + 1) / (threads)

#ifdef _OPENMP
extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);
#define THREAD_ID_AND_COUNT(id, nt) const int id = omp_get_thread_num(), nt = omp_get_num_threads()
#else
#define THREAD_ID_AND_COUNT(id, nt) const int id = 0, nt = 1
#endif

/* The panel path's buffers for an m-row call, or all NULL below PANEL_MIN_ROWS (or in the AVX-512 build): one
 * allocation holding `threads` panels, then room for x packed by pack_rows, then (int4) its group sums.
 * Returns 0, or -2 when it cannot be had. */
typedef struct {
    float *base, *panel, *xp, *s;
} panel_bufs;

static int panel_alloc(int64_t m, int64_t k, int threads, int int4, panel_bufs *b) {
    b->base = b->panel = b->xp = b->s = 0;
    const int64_t G = k / QK;
    if (m < PANEL_MIN_ROWS || PANEL_FLOATS(G) == 0) return 0;
    const int64_t padded = (m + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS;
    const size_t floats = (size_t)threads * (size_t)PANEL_FLOATS(G) + (size_t)(padded * k) + (size_t)(padded * G);
    b->base = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (b->base == 0) return -2;
    b->panel = b->base;
    b->xp = b->panel + (size_t)threads * (size_t)PANEL_FLOATS(G);
    b->s = b->xp + padded * k;
    if (!int4) b->s = 0;
    return 0;
}

/* CALL on `threads` threads, each over its share [t0, t1) of T tiles, after PACK, each over its share [t0, t1)
 * of B row blocks (pack_rows), has run on every thread */
#define PACK_THEN_TILES(B, PACK, T, CALL)                                                                      \
    do {                                                                                                       \
        if (threads == 1) {                                                                                    \
            const int id = 0;                                                                                  \
            (void)id;                                                                                          \
            {                                                                                                  \
                const int64_t t0 = 0, t1 = (B);                                                                \
                PACK;                                                                                          \
            }                                                                                                  \
            const int64_t t0 = 0, t1 = (T);                                                                    \
            CALL;                                                                                              \
        } else {                                                                                               \
            _Pragma("omp parallel num_threads(threads)") {                                                     \
                THREAD_ID_AND_COUNT(id, nt);                                                                   \
                {                                                                                              \
                    SPLIT(B, nt, id, t0, t1);                                                                  \
                    PACK;                                                                                      \
                }                                                                                              \
                _Pragma("omp barrier");                                                                        \
                SPLIT(T, nt, id, t0, t1);                                                                      \
                CALL;                                                                                          \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)

/* Q4_0 / Q4_1: w = pack_int4's tiles (64-byte aligned), x fp32 [m][k], y fp32 [m][n]; threads >= 1 */
int q4_gemv(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads) {
    if (bad_args(w, n, k, x, m, y, threads)) return -1;
    const int64_t G = k / QK, T = (n + TILE - 1) / TILE;
    panel_bufs b;
    if (panel_alloc(m, k, threads, 1, &b) != 0) return -2;
    float *s = b.s;
    if (s == 0) {
        s = malloc((size_t)(m * G) * sizeof(float));
        if (s == 0) return -2;
        group_sums(x, m, k, s);
    }
    const int64_t B = b.xp ? (m + PANEL_ROWS - 1) / PANEL_ROWS : 0;
    PACK_THEN_TILES(B, pack_rows(x, m, k, 1, b.xp, b.s, t0, t1), T,
                    q4_tiles(w, n, k, x, m, y, s, t0, t1, THREAD_PANEL(b.panel, G, id), b.xp));
    if (s != b.s) free(s);
    free(b.base);
    return 0;
}

/* Q8_0: w = pack_int8's tiles (64-byte aligned); as q4_gemv */
int q8_gemv(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads) {
    if (bad_args(w, n, k, x, m, y, threads)) return -1;
    const int64_t G = k / QK, T = (n + TILE - 1) / TILE;
    panel_bufs b;
    if (panel_alloc(m, k, threads, 0, &b) != 0) return -2;
    const int64_t B = b.xp ? (m + PANEL_ROWS - 1) / PANEL_ROWS : 0;
    PACK_THEN_TILES(B, pack_rows(x, m, k, 0, b.xp, 0, t0, t1), T,
                    q8_tiles(w, n, k, x, m, y, t0, t1, THREAD_PANEL(b.panel, G, id), b.xp));
    free(b.base);
    return 0;
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VBMI__)) || !defined(__AVX512F__)
/* ---- int8 activations, two planes (engine.linear_kernel: int8-activations; the build with -mavx512vnni
 * -mavx512vbmi, and the AVX2 build) ----------------------------------------------------------------------------
 *
 * The same weights and tiles; each row of x is cut per group of 32 inputs into two int8 planes, x ~ dx * xq +
 * dr * rq: Q(v) rounds v to v ~ dv * vq with dv = amax / 127 (amax = the group's largest |v|) and vq = v * (127
 * / amax) rounded to the nearest integer, ties to even (all 0 where amax < TINY_GROUP), the scheme of llama.cpp's Q8
 * activation blocks; (xq, dx) = Q(x) and (rq, dr) = Q(r) of the remainder r = x - dx * xq (fp32, not fused),
 * so about 15 bits of each group survive where one plane keeps 8 (one plane alone lost 7 % of SmolLM2's greedy
 * tokens against fp32: docs/engine-step.md, "int8 activations"). Per group the codes' dot products with both
 * planes are exact integer sums (vpdpbusd: unsigned weight bytes times signed activation bytes, four at a time
 * into 32-bit lanes), then, in fp32, in this order:
 *
 *   int4: y += (d * dx) * sum_i q_i xq_i;  y += (d * dr) * sum_i q_i rq_i;  y += m * S_g
 *         (q = 0..15 unsigned; S_g = the group's exact fp32 sum, sum32 above: the m term is not rounded)
 *   int8: the same without the m term, each sum taken as sum_i (q_i + 128) v_i - 128 sum_i v_i (the codes made
 *         unsigned)
 *
 * A tile block's code bytes are stored i-major (16 bytes per input i, byte j for output j); one vpermb turns 64
 * of them (inputs i..i+3) into 16 lanes of 4 consecutive inputs each, the operand vpdpbusd wants. Each output
 * element is one fixed sequence of operations whatever the call's rows, tiles or threads (batch invariance, as
 * the fp32 functions); 8 rows share one decode of a tile's codes, each with two integer accumulators and one
 * fp32 sum in registers.
 *
 * The AVX2 build (no VNNI) computes the same integer sums another way, so every output is the same bits as the
 * VNNI build's: a half tile (8 outputs) at a time, one unpack, one vpermq and one vpshufb turn 64 code bytes
 * into 8 lanes of 4 consecutive inputs; vpmaddubsw multiplies them by the activations (4 bytes broadcast) into
 * 16-bit pair sums, which add up in 16 bits over the group (each 16-bit element sums 16 products of a code
 * 0..15 and an activation of at most 128 in magnitude: |sum| <= 30,720 < 2^15, so nothing saturates or wraps),
 * and one vpmaddwd by ones makes each lane's 32-bit sum. The fp32 epilogue is the VNNI build's, lane for lane.
 * A one-row call (a decode step of one sequence) lays the activations out for the codes instead (i8_row_tiles:
 * no shuffle of the codes), and six or more rows widen each tile's codes once (the panel path).
 * Only int4 weights: for 8-bit codes a product pair can reach 2 * 255 * 127 (vpmaddubsw saturates), and the
 * ways around that (the sign trick, or codes split into nibbles) cost more instructions per product than the
 * fp32 kernel's fused multiply-adds, so the AVX2 build has no q8_gemv_i8 and int8 weights keep fp32 activations
 * there (engine.native_linear.Int8ActivationKernel). */

#define TINY_GROUP 1e-30f /* engine.native_linear.TINY_GROUP */

/* the activations of a call, group-major so that one block's rows lie together: for group g and row r, at
 * i = g m + r, the planes q[64 i ..]: xq (32 int8) then rq (32 int8); the scales dx[i], dr[i]; the planes' sums
 * sx[i], sr[i]; the group's exact fp32 sum S[i] (int4) */
typedef struct {
    int8_t *q;
    float *dx, *dr, *S;
    int32_t *sx, *sr;
} planes;

#ifdef __AVX512F__

#define ROWS_I8 8

/* Q(v) of one group of 32: the int8 codes to q, the scale to *dv, the codes' sum to *sv */
INLINE void quantize_group(__m512 a, __m512 b, int8_t *q, float *dv, int32_t *sv) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    /* a group below TINY_GROUP quantizes to zeros: 127 / amax would overflow for subnormal maxima */
    const __m512 id = _mm512_set1_ps(amax >= TINY_GROUP ? 127.0f / amax : 0.0f);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, id), rn);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, id), rn);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(q1));
    *dv = amax / 127.0f;
    *sv = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}

/* one group of 32 inputs at p cut into its planes at q (xq, then rq): (xq, *dx) = Q(x), then (rq, *dr) = Q(x - dx *
 * xq), the product then the difference, xq taken back from its int8 codes; *sx, *sr the codes' sums */
INLINE void cut_group(const float *p, int8_t *q, float *dx, int32_t *sx, float *dr, int32_t *sr) {
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    quantize_group(a, b, q, dx, sx);
    const __m512 d = _mm512_set1_ps(*dx);
    const __m512 xa = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 xb = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    quantize_group(_mm512_sub_ps(a, _mm512_mul_ps(d, xa)), _mm512_sub_ps(b, _mm512_mul_ps(d, xb)), q + 32, dr, sr);
}

/* vpermb index: out byte 4 j + t = in byte 16 t + j (inputs i..i+3 of output j in lane j) */
INLINE __m512i lanes_of_four(void) {
    return _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42,
                           26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52,
                           36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
}

/* acc + vpdpbusd(u, the 4 int8 at p in every lane): the activations as the instruction's broadcast memory
 * operand, so the load unit does the broadcast (GCC otherwise loads them into a register and spends a shuffle
 * on the vector pipes per broadcast: ~1.1x the fp32 kernel's time at 8 rows instead of ~0.7x) */
INLINE __m512i dot4(__m512i acc, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}

INLINE void q4i8_tile(const uint8_t *w, int64_t G, const planes *P, int64_t m, int64_t r0, int R, __m512 *out) {
    const __m512i perm = lanes_of_four(), low4 = _mm512_set1_epi8(15);
    __m512 y[ROWS_I8];
    for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q4_BLOCK;
        prefetch_ahead(b, Q4_BLOCK);
        __m512i ax[ROWS_I8], ar[ROWS_I8];
        for (int r = 0; r < R; r++) ax[r] = ar[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) {
            const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_load_si512((const void *)(b + 64 + 64 * a)));
            const __m512i lo = _mm512_and_si512(v, low4);                        /* inputs 4a .. 4a + 3 */
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4); /* inputs 16 + 4a .. */
            const int8_t *q = P->q + 64 * (g * m + r0) + 4 * a;
            for (int r = 0; r < R; r++) {
                ax[r] = dot4(ax[r], lo, q + 64 * r);
                ax[r] = dot4(ax[r], hi, q + 64 * r + 16);
                ar[r] = dot4(ar[r], lo, q + 64 * r + 32);
                ar[r] = dot4(ar[r], hi, q + 64 * r + 48);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)b));
        const __m512 mins = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(b + 32)));
        for (int r = 0; r < R; r++) {
            const int64_t at = g * m + r0 + r;
            y[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(P->dx[at])), _mm512_cvtepi32_ps(ax[r]), y[r]);
            y[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(P->dr[at])), _mm512_cvtepi32_ps(ar[r]), y[r]);
            y[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(P->S[at]), y[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = y[r];
}

INLINE void q8i8_tile(const uint8_t *w, int64_t G, const planes *P, int64_t m, int64_t r0, int R, __m512 *out) {
    const __m512i perm = lanes_of_four(), flip = _mm512_set1_epi8((char)0x80);
    __m512 y[ROWS_I8];
    for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q8_BLOCK;
        prefetch_ahead(b, Q8_BLOCK);
        __m512i ax[ROWS_I8], ar[ROWS_I8];
        for (int r = 0; r < R; r++) {
            ax[r] = _mm512_set1_epi32(-128 * P->sx[g * m + r0 + r]);
            ar[r] = _mm512_set1_epi32(-128 * P->sr[g * m + r0 + r]);
        }
#pragma GCC unroll 8
        for (int a = 0; a < 8; a++) {
            const __m512i v = _mm512_xor_si512(
                _mm512_permutexvar_epi8(perm, _mm512_loadu_si512((const void *)(b + 32 + 64 * a))), flip);
            const int8_t *q = P->q + 64 * (g * m + r0) + 4 * a;
            for (int r = 0; r < R; r++) {
                ax[r] = dot4(ax[r], v, q + 64 * r);
                ar[r] = dot4(ar[r], v, q + 64 * r + 32);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        for (int r = 0; r < R; r++) {
            const int64_t at = g * m + r0 + r;
            y[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(P->dx[at])), _mm512_cvtepi32_ps(ax[r]), y[r]);
            y[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(P->dr[at])), _mm512_cvtepi32_ps(ar[r]), y[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = y[r];
}

#define RUN_TILE_I8(BITS, R)                                                                                   \
    do {                                                                                                       \
        __m512 o[ROWS_I8];                                                                                     \
        BITS##i8_tile(wt, G, P, m, r0, R, o);                                                                   \
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (r0 + r) * n + t * TILE, mask, o[r]);          \
    } while (0)

#define ROW_CASES_I8(BITS)                                                                                     \
    switch (m - r0 < ROWS_I8 ? m - r0 : ROWS_I8) {                                                             \
    case 1: RUN_TILE_I8(BITS, 1); break;                                                                       \
    case 2: RUN_TILE_I8(BITS, 2); break;                                                                       \
    case 3: RUN_TILE_I8(BITS, 3); break;                                                                       \
    case 4: RUN_TILE_I8(BITS, 4); break;                                                                       \
    case 5: RUN_TILE_I8(BITS, 5); break;                                                                       \
    case 6: RUN_TILE_I8(BITS, 6); break;                                                                       \
    case 7: RUN_TILE_I8(BITS, 7); break;                                                                       \
    default: RUN_TILE_I8(BITS, 8); break;                                                                      \
    }

/* the tiles [t0, t1) of an int8-activation call, x already cut into planes */
static void i8_tiles(int bits, const uint8_t *w, int64_t n, int64_t k, int64_t m, float *y, const planes *P,
                     int64_t t0, int64_t t1) {
    const int64_t G = k / QK;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t valid = n - t * TILE < TILE ? n - t * TILE : TILE;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        for (int64_t r0 = 0; r0 < m; r0 += ROWS_I8) {
            if (bits == 4) {
                const uint8_t *wt = w + t * G * Q4_BLOCK;
                ROW_CASES_I8(q4)
            } else {
                const uint8_t *wt = w + t * G * Q8_BLOCK;
                ROW_CASES_I8(q8)
            }
        }
    }
}

#else /* AVX2 */

/* as EACH_HALF, rows of x taken `rows` at a time */
#define EACH_HALF_ROWS(rows, BODY)                                                                             \
    for (int64_t t = t0; t < t1; t++)                                                                          \
        for (int half = 0; half < 2; half++) {                                                                 \
            const int64_t left = n - t * TILE - 8 * half;                                                      \
            if (left <= 0) break;                                                                              \
            const int valid = left < 8 ? (int)left : 8;                                                        \
            for (int64_t r0 = 0; r0 < m; r0 += (rows)) {                                                       \
                BODY;                                                                                          \
            }                                                                                                  \
        }

#ifndef ROWS_I8
#define ROWS_I8 4 /* x rows sharing one decode of a half tile's codes (16 ymm registers) */
#endif

/* Q(v) of one group of 32 (v[0..3]: 8 inputs each), as the AVX-512 build's: the same amax, scale, rounding (to
 * nearest, ties to even), saturation to int8 and sum */
INLINE void quantize_group(const __m256 *v, int8_t *q, float *dv, int32_t *sv) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    /* a group below TINY_GROUP quantizes to zeros: 127 / amax would overflow for subnormal maxima */
    const __m256 id = _mm256_set1_ps(amax >= TINY_GROUP ? 127.0f / amax : 0.0f);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i qi[4];
    for (int j = 0; j < 4; j++) qi[j] = _mm256_cvttps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), rn));
    /* int32 -> int8 with saturation (as vpmovsdb); packs interleave the 128-bit lanes, vpermd restores order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *dv = amax / 127.0f;
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    *sv = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
}

/* cut_group of the AVX-512 build, the same operations on 8-lane vectors */
INLINE void cut_group(const float *p, int8_t *q, float *dx, int32_t *sx, float *dr, int32_t *sr) {
    __m256 v[4];
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(p + 8 * j);
    quantize_group(v, q, dx, sx);
    const __m256 d = _mm256_set1_ps(*dx);
    for (int j = 0; j < 4; j++) {
        const __m256 xq = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j))));
        v[j] = _mm256_sub_ps(v[j], _mm256_mul_ps(d, xq));
    }
    quantize_group(v, q + 32, dr, sr);
}

/* The codes of inputs i .. i + 3 of half tile `half` (outputs 8 half .. 8 half + 7) from the 64 code bytes at c
 * (16 bytes per input, byte j = output j): lane j (32 bits) = bytes of output 8 half + j for inputs i, i + 1,
 * i + 2, i + 3. unpack{lo,hi} pairs inputs (i, i + 2) in the low 128-bit lane and (i + 1, i + 3) in the high
 * one, outputs 0-7 of the half in order; vpermq 0 2 1 3 brings outputs 0-3 of both pairs into the low lane and
 * 4-7 into the high one; vpshufb orders each output's 4 bytes by input. */
INLINE __m256i four_inputs(const uint8_t *c, int half) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)c), hi = _mm256_loadu_si256((const __m256i *)(c + 32));
    const __m256i u = half ? _mm256_unpackhi_epi8(lo, hi) : _mm256_unpacklo_epi8(lo, hi);
    const __m256i order = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10,
                                           3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    return _mm256_shuffle_epi8(_mm256_permute4x64_epi64(u, 0xD8), order);
}

/* the 4 activation bytes at p in every 32-bit lane (a broadcast load) */
INLINE __m256i four_acts(const int8_t *p) { return _mm256_castps_si256(_mm256_broadcast_ss((const float *)p)); }

/* rows r0 .. r0 + R of half tile `half` of one int4 tile (w: its first block), x in planes P */
INLINE void q4i8_half(const uint8_t *w, int64_t G, const planes *P, int64_t m, int64_t r0, int R, int half,
                      __m256 *out) {
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 y[ROWS_I8];
    for (int r = 0; r < R; r++) y[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q4_BLOCK;
        if (!half) prefetch_ahead(b, Q4_BLOCK); /* half 1 reads the tile half 0 brought in */
        __m256i ax[ROWS_I8], ar[ROWS_I8];       /* 16-bit pair sums (the bound above) */
        for (int r = 0; r < R; r++) ax[r] = ar[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) {
            const __m256i v = four_inputs(b + 64 + 64 * a, half);
            const __m256i lo = _mm256_and_si256(v, low4);                        /* inputs 4a .. 4a + 3 */
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4); /* inputs 16 + 4a .. */
            const int8_t *q = P->q + 64 * (g * m + r0) + 4 * a;
            for (int r = 0; r < R; r++) {
                const int8_t *qr = q + 64 * r;
                ax[r] = _mm256_add_epi16(ax[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, four_acts(qr)),
                                                                 _mm256_maddubs_epi16(hi, four_acts(qr + 16))));
                ar[r] = _mm256_add_epi16(ar[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, four_acts(qr + 32)),
                                                                 _mm256_maddubs_epi16(hi, four_acts(qr + 48))));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 16 * half)));
        const __m256 mins = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 32 + 16 * half)));
        for (int r = 0; r < R; r++) {
            const int64_t at = g * m + r0 + r;
            const __m256 dotx = _mm256_cvtepi32_ps(_mm256_madd_epi16(ax[r], ones));
            const __m256 dotr = _mm256_cvtepi32_ps(_mm256_madd_epi16(ar[r], ones));
            y[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(P->dx[at])), dotx, y[r]);
            y[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(P->dr[at])), dotr, y[r]);
            y[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(P->S[at]), y[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = y[r];
}

/* Several rows (I8_PANEL_MIN_ROWS and up): each tile's codes are turned once per call into a panel of the
 * operands q4i8_half builds in its loop (four_inputs' lanes, the low and the high nibbles as bytes, both halves of
 * the tile), with the tile's d and m as fp32 beside them; then every pair of rows runs against the panel, both
 * halves at once, so one broadcast of 4 activation bytes feeds two vpmaddubsw (one per half) where q4i8_half's
 * feeds one, and no row block decodes codes again. The integer sums are the same exact sums (int16 pair sums over
 * the group, then vpmaddwd by ones), the fp32 epilogue is q4i8_half's, lane for lane and in its order: every
 * output is the same bits as on the per-row path (and the VNNI build). Measured in docs/engine-step.md, "The
 * AVX2 int8 kernel on many rows". */
#ifndef I8_PANEL_MIN_ROWS
#define I8_PANEL_MIN_ROWS 6 /* from this many rows (fewer: the per-row path as fast or faster, bench.int8_panel) */
#endif
#define I8_PANEL_ROWS 2              /* rows per pass: 8 int16 accumulators + 4 code vectors of 16 ymm registers */
#define I8_PANEL_CODES 512           /* code bytes per group: 4 steps x 2 halves x (low, high) x 32 */
#define I8_PANEL_BYTES(G) ((G) * (I8_PANEL_CODES + 4 * 8 * 4)) /* then per group d, m of each half, fp32 */

/* the panel of one int4 tile (w: its first block): per group g at p + I8_PANEL_CODES g, for step a (inputs 4a ..
 * 4a + 3 and 16 + 4a ..) and half h, the low-nibble vector at 128 a + 64 h, the high one 32 bytes on; after the
 * codes, fp32 [G][4][8]: d of half 0, d of half 1, m of half 0, m of half 1 */
static void q4i8_widen(const uint8_t *w, int64_t G, uint8_t *p) {
    const __m256i low4 = _mm256_set1_epi8(15);
    float *dm = (float *)(p + G * I8_PANEL_CODES);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q4_BLOCK;
        prefetch_ahead(b, Q4_BLOCK);
        uint8_t *pg = p + g * I8_PANEL_CODES;
        for (int a = 0; a < 4; a++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = four_inputs(b + 64 + 64 * a, h);
                _mm256_store_si256((__m256i *)(pg + 128 * a + 64 * h), _mm256_and_si256(v, low4));
                _mm256_store_si256((__m256i *)(pg + 128 * a + 64 * h + 32),
                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
            }
        for (int h = 0; h < 2; h++) {
            _mm256_store_ps(dm + 32 * g + 8 * h, _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 16 * h))));
            _mm256_store_ps(dm + 32 * g + 16 + 8 * h,
                            _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 32 + 16 * h))));
        }
    }
}

/* acc + the 16-bit pair sums of codes u0, u1 times the activation bytes p0, p1; the empty asm keeps each sum in
 * its register as it is made (GCC otherwise computed a step's products first and parked them on the stack) */
#define PAIR_SUMS(acc, u0, p0, u1, p1)                                                                         \
    do {                                                                                                       \
        acc = _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(u0, p0), _mm256_maddubs_epi16(u1, p1))); \
        __asm__("" : "+x"(acc));                                                                               \
    } while (0)

/* one row's fp32 epilogue of group g for half h: q4i8_half's operations, in its order */
#define I8_EPILOGUE(yv, axv, arv, h)                                                                           \
    do {                                                                                                       \
        const __m256 d = _mm256_load_ps(dm + 32 * g + 8 * (h)), mins = _mm256_load_ps(dm + 32 * g + 16 + 8 * (h)); \
        yv = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(axv, ones)), yv);     \
        yv = _mm256_fmadd_ps(_mm256_mul_ps(d, dr), _mm256_cvtepi32_ps(_mm256_madd_epi16(arv, ones)), yv);     \
        yv = _mm256_fmadd_ps(mins, S, yv);                                                                     \
    } while (0)

/* rows r0 and r0 + 1 (TWO) or row r0 alone of one tile against its panel: out[2 r + h] = row r0 + r, half h */
INLINE void q4i8_panel_rows(const uint8_t *p, int64_t G, const planes *P, int64_t m, int64_t r0, const int TWO,
                            __m256 *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    const float *dm = (const float *)(p + G * I8_PANEL_CODES);
    __m256 y00 = _mm256_setzero_ps(), y01 = y00, y10 = y00, y11 = y00; /* y{row}{half} */
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *pg = p + g * I8_PANEL_CODES;
        const int8_t *q0 = P->q + 64 * (g * m + r0), *q1 = q0 + 64;
        /* 16-bit pair sums (q4i8_half's bound), a{x, r}{row}{half}: the x plane's, the remainder plane's */
        __m256i ax00 = _mm256_setzero_si256(), ax01 = ax00, ar00 = ax00, ar01 = ax00;
        __m256i ax10 = ax00, ax11 = ax00, ar10 = ax00, ar11 = ax00;
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) {
            const __m256i lo0 = _mm256_load_si256((const __m256i *)(pg + 128 * a));
            const __m256i hi0 = _mm256_load_si256((const __m256i *)(pg + 128 * a + 32));
            const __m256i lo1 = _mm256_load_si256((const __m256i *)(pg + 128 * a + 64));
            const __m256i hi1 = _mm256_load_si256((const __m256i *)(pg + 128 * a + 96));
            __m256i l = four_acts(q0 + 4 * a), h = four_acts(q0 + 4 * a + 16);
            PAIR_SUMS(ax00, lo0, l, hi0, h);
            PAIR_SUMS(ax01, lo1, l, hi1, h);
            l = four_acts(q0 + 4 * a + 32), h = four_acts(q0 + 4 * a + 48);
            PAIR_SUMS(ar00, lo0, l, hi0, h);
            PAIR_SUMS(ar01, lo1, l, hi1, h);
            if (TWO) {
                l = four_acts(q1 + 4 * a), h = four_acts(q1 + 4 * a + 16);
                PAIR_SUMS(ax10, lo0, l, hi0, h);
                PAIR_SUMS(ax11, lo1, l, hi1, h);
                l = four_acts(q1 + 4 * a + 32), h = four_acts(q1 + 4 * a + 48);
                PAIR_SUMS(ar10, lo0, l, hi0, h);
                PAIR_SUMS(ar11, lo1, l, hi1, h);
            }
        }
        {
            const int64_t at = g * m + r0;
            const __m256 dx = _mm256_set1_ps(P->dx[at]), dr = _mm256_set1_ps(P->dr[at]), S = _mm256_set1_ps(P->S[at]);
            I8_EPILOGUE(y00, ax00, ar00, 0);
            I8_EPILOGUE(y01, ax01, ar01, 1);
        }
        if (TWO) {
            const int64_t at = g * m + r0 + 1;
            const __m256 dx = _mm256_set1_ps(P->dx[at]), dr = _mm256_set1_ps(P->dr[at]), S = _mm256_set1_ps(P->S[at]);
            I8_EPILOGUE(y10, ax10, ar10, 0);
            I8_EPILOGUE(y11, ax11, ar11, 1);
        }
    }
    out[0] = y00, out[1] = y01, out[2] = y10, out[3] = y11;
}

/* the panel path over tiles [t0, t1) (panel: this thread's I8_PANEL_BYTES(G), 32-byte aligned): per tile, widen its
 * codes (q4i8_widen), then every pair of rows, storing the outputs the tile holds */
static void i8_panel_tiles(const uint8_t *w, int64_t n, int64_t k, int64_t m, float *y, const planes *P,
                           int64_t t0, int64_t t1, uint8_t *panel) {
    const int64_t G = k / QK;
    for (int64_t t = t0; t < t1; t++) {
        q4i8_widen(w + t * G * Q4_BLOCK, G, panel);
        for (int64_t r0 = 0; r0 < m; r0 += I8_PANEL_ROWS) {
            __m256 o[2 * I8_PANEL_ROWS];
            const int R = m - r0 < I8_PANEL_ROWS ? (int)(m - r0) : I8_PANEL_ROWS;
            if (R == 1)
                q4i8_panel_rows(panel, G, P, m, r0, 0, o);
            else
                q4i8_panel_rows(panel, G, P, m, r0, 1, o);
            for (int half = 0; half < 2; half++) {
                const int64_t left = n - t * TILE - 8 * half;
                if (left <= 0) break;
                const int valid = left < 8 ? (int)left : 8;
                for (int r = 0; r < R; r++) {
                    float *dst = y + (r0 + r) * n + t * TILE + 8 * half;
                    if (valid == 8) {
                        _mm256_storeu_ps(dst, o[2 * r + half]);
                    } else {
                        float lanes[8];
                        _mm256_storeu_ps(lanes, o[2 * r + half]);
                        for (int j = 0; j < valid; j++) dst[j] = lanes[j];
                    }
                }
            }
        }
    }
}

/* One row (m == 1, a decode step of one sequence): q4i8_half's integer sums without its shuffles. Per block the
 * per-row path turned each half's 256 code bytes into four_inputs' lanes (an unpack, a vpermq and a vpshufb per 4
 * inputs and half) for one row's 8 vpmaddubsw: the shuffles, not memory, bounded a one-row step's GEMVs (~60 % of
 * the machine's read rate on a Zen 3, one or two threads). Here the activations take the layout instead, once per
 * call: for step s (code rows 4 s .. 4 s + 3) and each plane half, a vector whose low 128-bit lane repeats the
 * activation pair of inputs (4 s, 4 s + 1) and whose high lane that of (4 s + 2, 4 s + 3) (I8_ROW_ACT_BYTES per
 * group). The code rows then only interleave: rows 4 s and 4 s + 2 in one register's lanes, 4 s + 1 and 4 s + 3 in
 * another, and one unpack gives each output's pair of codes in a 16-bit element, low lane (4 s, 4 s + 1), high
 * lane (4 s + 2, 4 s + 3); unpacklo holds outputs 0-7, unpackhi 8-15. Each 16-bit element sums 16 products over
 * the group, as q4i8_half's (the same bound), and each output's 32-bit sum is its two lanes' elements added: the
 * same exact integer sums, so the fp32 epilogue, q4i8_half's lane for lane, gives the same bits. */
#define I8_ROW_ACT_BYTES 512 /* per group: 4 steps x (xq low, xq high, rq low, rq high) x 32 bytes */

/* group g's activation operands of the one row (q: its 64 plane bytes, xq then rq) into out (32-byte aligned) */
INLINE void row_acts(const int8_t *q, uint8_t *out) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                          3, 2, 3, 2, 3, 2, 3);
    for (int st = 0; st < 4; st++)
        for (int v = 0; v < 4; v++) /* xq inputs 0-15 (low nibbles), 16-31 (high), rq the same */
            _mm256_store_si256((__m256i *)(out + 32 * (4 * st + v)),
                               _mm256_shuffle_epi8(four_acts(q + 16 * v + 4 * st), pick));
}

/* the 8 outputs' 32-bit sums of a 16-bit accumulator: element j of the low lane plus element j of the high one */
INLINE __m256 row_dot(__m256i acc) {
    const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc));
    const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc, 1));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}

/* the 16 outputs of one int4 tile (w: its first block) for the one row, acts: row_acts of each group; out[half] */
INLINE void q4i8_row(const uint8_t *w, int64_t G, const planes *P, const uint8_t *acts, __m256 out[2]) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 y[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = w + g * Q4_BLOCK, *c = b + 64, *a = acts + g * I8_ROW_ACT_BYTES;
        prefetch_ahead(b, Q4_BLOCK);
        __m256i ax[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, ar[2] = {ax[0], ax[1]};
#pragma GCC unroll 4
        for (int st = 0; st < 4; st++) {
            const __m128i *rows = (const __m128i *)(c + 64 * st);
            const __m256i A = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_load_si128(rows)),
                                                      _mm_load_si128(rows + 2), 1);
            const __m256i B = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_load_si128(rows + 1)),
                                                      _mm_load_si128(rows + 3), 1);
            const __m256i *av = (const __m256i *)(a + 128 * st);
            for (int h = 0; h < 2; h++) {
                const __m256i u = h ? _mm256_unpackhi_epi8(A, B) : _mm256_unpacklo_epi8(A, B);
                const __m256i lo = _mm256_and_si256(u, low4), hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), low4);
                ax[h] = _mm256_add_epi16(ax[h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_load_si256(av)),
                                                                 _mm256_maddubs_epi16(hi, _mm256_load_si256(av + 1))));
                ar[h] = _mm256_add_epi16(ar[h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_load_si256(av + 2)),
                                                                 _mm256_maddubs_epi16(hi, _mm256_load_si256(av + 3))));
            }
        }
        const __m256 dx = _mm256_set1_ps(P->dx[g]), dr = _mm256_set1_ps(P->dr[g]), S = _mm256_set1_ps(P->S[g]);
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 16 * h)));
            const __m256 mins = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(b + 32 + 16 * h)));
            y[h] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), row_dot(ax[h]), y[h]);
            y[h] = _mm256_fmadd_ps(_mm256_mul_ps(d, dr), row_dot(ar[h]), y[h]);
            y[h] = _mm256_fmadd_ps(mins, S, y[h]);
        }
    }
    out[0] = y[0];
    out[1] = y[1];
}

/* the tiles [t0, t1) of a one-row call: the row's activation operands (into acts), then each tile's 16 outputs */
static void i8_row_tiles(const uint8_t *w, int64_t n, int64_t k, float *y, const planes *P, int64_t t0,
                         int64_t t1, uint8_t *acts) {
    const int64_t G = k / QK;
    if (t0 >= t1) return;
    for (int64_t g = 0; g < G; g++) row_acts(P->q + 64 * g, acts + g * I8_ROW_ACT_BYTES);
    for (int64_t t = t0; t < t1; t++) {
        __m256 o[2];
        q4i8_row(w + t * G * Q4_BLOCK, G, P, acts, o);
        for (int half = 0; half < 2; half++) {
            const int64_t left = n - t * TILE - 8 * half;
            if (left <= 0) break;
            float *dst = y + t * TILE + 8 * half;
            if (left >= 8) {
                _mm256_storeu_ps(dst, o[half]);
            } else {
                float lanes[8];
                _mm256_storeu_ps(lanes, o[half]);
                for (int j = 0; j < left; j++) dst[j] = lanes[j];
            }
        }
    }
}

/* the tiles [t0, t1) of an int8-activation call (int4 weights), x already cut into planes */
static void i8_tiles(int bits, const uint8_t *w, int64_t n, int64_t k, int64_t m, float *y, const planes *P,
                     int64_t t0, int64_t t1) {
    (void)bits; /* int4 only (gemv_i8's callers) */
    const int64_t G = k / QK;
    EACH_HALF_ROWS(ROWS_I8, {
        const uint8_t *wt = w + t * G * Q4_BLOCK;
        __m256 o[ROWS_I8];
        const int R = m - r0 < ROWS_I8 ? (int)(m - r0) : ROWS_I8;
        switch (R) {
        case 1: q4i8_half(wt, G, P, m, r0, 1, half, o); break;
        case 2: q4i8_half(wt, G, P, m, r0, 2, half, o); break;
        case 3: q4i8_half(wt, G, P, m, r0, 3, half, o); break;
        default: q4i8_half(wt, G, P, m, r0, ROWS_I8, half, o); break;
        }
        STORE_HALF(R);
    })
}

#endif

/* rows [r0, r1) of x [m][k] cut into planes, group by group (cut_group), with each group's exact fp32 sum where
 * `sums` (int4); a row's planes do not depend on the other rows, so threads may cut disjoint rows */
static void cut_planes(const float *x, int64_t m, int64_t k, int sums, const planes *P, int64_t r0, int64_t r1) {
    const int64_t G = k / QK;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *p = x + r * k + g * QK;
            const int64_t i = g * m + r;
            cut_group(p, P->q + 64 * i, P->dx + i, P->sx + i, P->dr + i, P->sr + i);
            if (sums) P->S[i] = sum32(p);
        }
}

#ifndef I8_PANEL_BYTES /* the AVX-512 build: no panel path, no one-row path */
#define I8_PANEL_BYTES(G) 0
#define I8_PANEL_MIN_ROWS INT64_MAX
#define i8_panel_tiles(w, n, k, m, y, P, t0, t1, panel) ((void)(panel))
#define I8_ROW_ACT_BYTES 0
#define i8_row_tiles(w, n, k, y, P, t0, t1, acts) ((void)(acts))
#endif

/* as q4_gemv / q8_gemv (the same arguments, tiles and returns), with x in two int8 planes: each thread cuts its
 * share of the rows, then (after a barrier) runs its share of the tiles, on the panel path from
 * I8_PANEL_MIN_ROWS rows (AVX2) */
static int gemv_i8(int bits, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                   int threads) {
    if (bad_args(w, n, k, x, m, y, threads)) return -1;
    const int64_t G = k / QK, T = (n + TILE - 1) / TILE;
    const size_t mg = (size_t)(m * G);
    /* dx, dr, S [G][m] fp32; sx, sr [G][m] int32; the planes [G][m][64] int8 */
    float *base = malloc(mg * (3 * sizeof(float) + 2 * sizeof(int32_t) + 64));
    if (base == 0) return -2;
    const planes P = {(int8_t *)(base + 5 * mg), base, base + mg, base + 2 * mg, (int32_t *)(base + 3 * mg),
                      (int32_t *)(base + 4 * mg)};
    /* one scratch per thread (int4 only: the AVX2 build has no q8_gemv_i8): the panel path's panel from
     * I8_PANEL_MIN_ROWS rows, the one-row path's activation operands for one row, none between */
    const int panel = m >= I8_PANEL_MIN_ROWS, one_row = m == 1 && bits == 4;
    const size_t bytes = panel ? (size_t)I8_PANEL_BYTES(G) : one_row ? (size_t)G * I8_ROW_ACT_BYTES : 0;
    uint8_t *scratch = 0;
    if (bytes > 0) {
        scratch = aligned_alloc(64, ((size_t)threads * bytes + 63) / 64 * 64);
        if (scratch == 0) {
            free(base);
            return -2;
        }
    }
    PACK_THEN_TILES(m, cut_planes(x, m, k, bits == 4, &P, t0, t1), T, {
        if (scratch && panel)
            i8_panel_tiles(w, n, k, m, y, &P, t0, t1, scratch + (size_t)id * bytes);
        else if (scratch)
            i8_row_tiles(w, n, k, y, &P, t0, t1, scratch + (size_t)id * bytes);
        else
            i8_tiles(bits, w, n, k, m, y, &P, t0, t1);
    });
    free(scratch);
    free(base);
    return 0;
}

int q4_gemv_i8(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads) {
    return gemv_i8(4, w, n, k, x, m, y, threads);
}

#ifdef __AVX512F__
int q8_gemv_i8(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads) {
    return gemv_i8(8, w, n, k, x, m, y, threads);
}
#endif
#endif
