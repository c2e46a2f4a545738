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
 * conversion; x[k] is broadcast; no horizontal sums.
 *
 * Every output element is computed by the same sequence of fp32 operations whatever M, the rows computed with
 * it, the tile range or the thread count: row i of an M-row call is bit-identical to the 1-row call of that
 * row (batch invariance). Rows are taken 4 at a time so one tile's decoded codes serve 4 rows; each row keeps
 * its own accumulators.
 *
 * Two builds (engine.native_linear picks one from the CPU's flags): AVX-512 F/BW/VL, a tile's 16 rows in one
 * 512-bit vector; AVX2, the same tile as two 8-lane halves (rows 0-7, then 8-15), taken 2 rows of x at a time
 * (16 ymm registers). Each lane (output row) goes through the same sequence of fp32 operations in both builds:
 * codes become the same exact floats (q - 8 by a table or by integer subtraction and conversion), the same fused
 * multiply-adds into the same four partial sums, the same adds, and the group sums of x by one portable
 * function that adds in _mm512_reduce_add_ps's tree order.
 *
 * Built by engine.native_build (gcc -O3, -fopenmp for the tile split; no -ffast-math, -ffp-contract=off).
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
                     int64_t t0, int64_t t1) {
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
                     int64_t t1) {
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

/* one half tile, rows [r0, r0 + R), its `valid` (1..8) outputs stored */
#define RUN_HALF(BITS, R, ...)                                                                                 \
    do {                                                                                                       \
        __m256 o[ROWS2];                                                                                       \
        BITS##_half(__VA_ARGS__, R, half, o);                                                                  \
        for (int r = 0; r < R; r++) {                                                                          \
            float *dst = y + (r0 + r) * n + t * TILE + 8 * half;                                               \
            if (valid == 8) {                                                                                  \
                _mm256_storeu_ps(dst, o[r]);                                                                   \
            } else {                                                                                           \
                float lanes[8];                                                                                \
                _mm256_storeu_ps(lanes, o[r]);                                                                 \
                for (int j = 0; j < valid; j++) dst[j] = lanes[j];                                             \
            }                                                                                                  \
        }                                                                                                      \
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

static void q4_tiles(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, const float *s,
                     int64_t t0, int64_t t1) {
    const int64_t G = k / QK;
    EACH_HALF({
        const uint8_t *wt = w + t * G * Q4_BLOCK;
        if (m - r0 < ROWS2)
            RUN_HALF(q4, 1, wt, G, x + r0 * k, k, s + r0 * G);
        else
            RUN_HALF(q4, 2, wt, G, x + r0 * k, k, s + r0 * G);
    })
}

static void q8_tiles(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int64_t t0,
                     int64_t t1) {
    const int64_t G = k / QK;
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

/* CALL (which reads t0, t1) on each of `threads` OpenMP threads, over that thread's SPLIT share of T tiles */
#define EACH_THREAD(T, threads, CALL)                                                                          \
    _Pragma("omp parallel num_threads(threads)") {                                                             \
        THREAD_ID_AND_COUNT(id, nt);                                                                           \
        SPLIT(T, nt, id, t0, t1);                                                                              \
        CALL;                                                                                                  \
    }

/* Q4_0 / Q4_1: w = pack_int4's tiles (64-byte aligned), x fp32 [m][k], y fp32 [m][n]; threads >= 1 */
int q4_gemv(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads) {
    if (bad_args(w, n, k, x, m, y, threads)) return -1;
    float *s = malloc((size_t)(m * (k / QK)) * sizeof(float));
    if (s == 0) return -2;
    group_sums(x, m, k, s);
    const int64_t T = (n + TILE - 1) / TILE;
    if (threads == 1) {
        q4_tiles(w, n, k, x, m, y, s, 0, T);
    } else {
        EACH_THREAD(T, threads, q4_tiles(w, n, k, x, m, y, s, t0, t1));
    }
    free(s);
    return 0;
}

/* Q8_0: w = pack_int8's tiles (64-byte aligned); as q4_gemv */
int q8_gemv(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads) {
    if (bad_args(w, n, k, x, m, y, threads)) return -1;
    const int64_t T = (n + TILE - 1) / TILE;
    if (threads == 1) {
        q8_tiles(w, n, k, x, m, y, 0, T);
    } else {
        EACH_THREAD(T, threads, q8_tiles(w, n, k, x, m, y, t0, t1));
    }
    return 0;
}
