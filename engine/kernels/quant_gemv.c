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
 * Built by engine.native_build (gcc -O3, AVX-512 F/BW/VL + F16C + FMA, -fopenmp for the tile split; no
 * -ffast-math, -ffp-contract=off). Returns 0, or -1 for bad arguments (nothing written), -2 out of memory.
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

/* S[r * G + g] = sum of x[r][32 g .. 32 g + 31] in fp32, a fixed order (two 16-lane halves added, then the
 * lanes by _mm512_reduce_add_ps's fixed tree) */
static void group_sums(const float *x, int64_t m, int64_t k, float *s) {
    const int64_t G = k / QK;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *p = x + r * k + g * QK;
            s[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)));
        }
}

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
