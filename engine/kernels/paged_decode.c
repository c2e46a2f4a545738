/* Decode attention over a paged KV cache, one query token per sequence (prefixgate engine.native_decode).
 *
 * For each sequence b and KV head h, the `group` query heads of h attend positions 0..lens[b]-1 of the
 * sequence's blocks (block_tables[b]) in one layer's cache [2][num_blocks][block_size][kv_heads][head_dim]
 * (K = 0, V = 1), bf16 or fp32, read in place: scores = scale * q.k in fp32, softmax with its maximum
 * subtracted, output = sum p v / sum p in fp32. Every sequence is computed alone, positions in order, so its
 * result depends only on its query, its blocks and its length: not on the other sequences of the step, the
 * thread count or which blocks other sequences share. Scaled dot-product attention (Vaswani et al. 2017),
 * grouped-query attention (Ainslie et al. 2023).
 *
 * Built once per machine by engine.native_decode (gcc -O3 -fopenmp, AVX-512 or AVX2). paged_decode_attention is
 * single-threaded (the caller decides what runs in parallel); paged_decode_attention_threads spreads a lone
 * sequence over OpenMP threads with the same bits; paged_prefill_attention (the end of the file: many query rows
 * of one sequence, each with exactly the decode arithmetic) spreads its work over OpenMP threads. The AMX and
 * AVX512-BF16 builds add prefills of their own arithmetic, and the AVX512-BF16 build a decode in its prefill's
 * arithmetic (paged_decode_attention_bf16, the last section).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);

#define INLINE static inline __attribute__((always_inline))
/* keeps a loaded vector in a register (no instruction): the compiler would otherwise fold the load into every
 * multiply-add that uses it, one load per query head */
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#define QREG_MAX 16 /* query vectors decode's scores keep in registers (of 32 on AVX-512) */
/* tiles of 16 positions ahead whose K (V) rows the scores (values) pass prefetches into L2, a row per position
 * and KV head as it goes (on a Zen 4 EPYC at ~1k positions 1-3 measured the same, 4 slower; prefetching into L1,
 * or a whole tile at once, was slower: docs/engine-step.md). Prefetches only: the arithmetic is untouched. */
#ifndef PD_PF
#define PD_PF 2
#endif
#define MAX_GROUP 8  /* query heads per KV head held in registers on the vector path */
/* how a lone sequence is spread over threads (paged_decode_attention_threads): SPLIT_POSITIONS, the scores by
 * positions, the softmax by query heads, the values by (KV head, half of D), with barriers between
 * (attend_one_part); SPLIT_HEADS, whole KV heads per thread, no barrier (attend_heads_part). The build's default:
 * positions on AVX2 (a 2-core Zen 3, session 22: one stream ~1.1x the heads split in the engine), heads on
 * AVX-512 (an AMX Xeon, session 26: 43-47 against 48-50 us a layer), unless the build says otherwise
 * (-DPD_ONE_SEQUENCE_SPLIT, by CPU vendor: engine.native_decode.ONE_SEQUENCE_SPLIT; positions on AMD, measured
 * faster on a Zen 4 in session 29). */
#define SPLIT_DEFAULT 0
#define SPLIT_HEADS 1
#define SPLIT_POSITIONS 2
#if defined(PD_ONE_SEQUENCE_SPLIT)
#define ONE_SEQUENCE_SPLIT PD_ONE_SEQUENCE_SPLIT /* a -D flag of the build (engine.native_decode) */
#elif defined(__AVX512F__)
#define ONE_SEQUENCE_SPLIT SPLIT_HEADS
#else
#define ONE_SEQUENCE_SPLIT SPLIT_POSITIONS
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 consecutive elements at src[index] (bf16 when is_bf16, else fp32) as fp32 */
INLINE v16 load16(const void *src, int64_t index, int is_bf16) {
    v16 r;
    if (is_bf16) {
#ifdef __AVX512F__ /* one widening load (GCC splits __builtin_convertvector's into 256-bit halves) */
        const __m512i w = _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + index))), 16);
#else
        u16x16 h;
        memcpy(&h, (const uint16_t *)src + index, sizeof h);
        u32x16 w = __builtin_convertvector(h, u32x16) << 16;
#endif
        memcpy(&r, &w, sizeof r);
    } else {
        memcpy(&r, (const float *)src + index, sizeof r);
    }
    return r;
}

INLINE float load1(const void *src, int64_t index, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)src)[index]) : ((const float *)src)[index];
}

/* 16 vectors -> one whose lane t is the sum of the lanes of p[t] (a transposing tree: 15 shuffle pairs) */
INLINE v16 hsum16(const v16 p[16]) {
    const i32x16 e1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const i32x16 o1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const i32x16 e2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i32x16 o2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i32x16 e3 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i32x16 o3 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i32x16 e4 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i32x16 o4 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    v16 c[8], d[4], e[2];
    for (int m = 0; m < 8; m++)
        c[m] = __builtin_shuffle(p[2 * m], p[2 * m + 1], e1) + __builtin_shuffle(p[2 * m], p[2 * m + 1], o1);
    for (int m = 0; m < 4; m++)
        d[m] = __builtin_shuffle(c[2 * m], c[2 * m + 1], e2) + __builtin_shuffle(c[2 * m], c[2 * m + 1], o2);
    for (int m = 0; m < 2; m++)
        e[m] = __builtin_shuffle(d[2 * m], d[2 * m + 1], e3) + __builtin_shuffle(d[2 * m], d[2 * m + 1], o3);
    return __builtin_shuffle(e[0], e[1], e4) + __builtin_shuffle(e[0], e[1], o4);
}

/* v[t][j] -> v[j][t] (16 x 16 fp32, exact moves): four rounds of the perfect shuffle, each row pair (m, m + 8)
 * interleaved into rows 2 m (their lanes 0-7) and 2 m + 1 (lanes 8-15) */
INLINE void transpose16(v16 v[16]) {
    const i32x16 lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const i32x16 hi = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    for (int round = 0; round < 4; round++) {
        v16 w[16];
        for (int m = 0; m < 8; m++) {
            w[2 * m] = __builtin_shuffle(v[m], v[m + 8], lo);
            w[2 * m + 1] = __builtin_shuffle(v[m], v[m + 8], hi);
        }
        for (int m = 0; m < 16; m++) v[m] = w[m];
    }
}

#ifdef __AVX512F__
/* the same 16 floats as an intrinsic's __m512 and back (exact moves) */
INLINE __m512 as_m512(v16 x) {
    __m512 v;
    memcpy(&v, &x, sizeof v);
    return v;
}
INLINE v16 as_v16(__m512 v) {
    v16 x;
    memcpy(&x, &v, sizeof x);
    return x;
}

/* e^x per lane for x <= 0 (softmax numerators): x = n ln2 + r, |r| <= ln2 / 2, e^r by the minimax polynomial of
 * Cephes' expf (S. L. Moshier), times 2^n by VSCALEFPS; ~2 ulp; lanes below -87 (-inf too) give ~1e-38, not 0. The
 * clamp, the rounding of n and the scaling are one instruction each (session 26; before: a compare and three
 * logic operations, two conversions, an integer add, a shift and a multiply), the same bits for every finite or
 * NaN x. */
INLINE v16 exp16(v16 x) {
    /* lanes below -87 -> -87: VMAXPS(-87, x) is -87 > x ? -87 : x, and x for a NaN x (Intel SDM, "MAXPS") */
    x = as_v16(_mm512_max_ps(_mm512_set1_ps(-87.0f), as_m512(x)));
    const v16 t = x * 1.44269504088896341f - 0.5f;
    /* t toward zero, an integer in [-126, 0]: round(x log2 e) for -87 <= x <= 0 */
    const v16 nf = as_v16(_mm512_roundscale_ps(as_m512(t), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
    const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* p 2^nf: VSCALEFPS, one rounding of the exact product as the multiply by 2^n's bits gave (Intel SDM,
     * "VSCALEFPS") */
    return as_v16(_mm512_scalef_ps(as_m512(p), as_m512(nf)));
}

/* per lane: x where x > m, else m: VMAXPS(x, m) exactly (it returns its second operand for NaNs and for two
 * zeros; Intel SDM, "MAXPS") */
INLINE v16 max16(v16 x, v16 m) { return as_v16(_mm512_max_ps(as_m512(x), as_m512(m))); }

/* the maximum of s[0 .. full) (full a multiple of 16, >= 16) and of m0: four running maxima (one maximum per
 * vector is a chain; four overlap), vector l0 / 16 on chain (l0 / 16) mod 4, each chain in a register (a run-time
 * chain index kept them on the stack); exact in any order */
INLINE float max_of(const float *restrict s, int64_t full, float m0) {
    v16 mx[4], x;
    for (int k = 0; k < 4; k++) memcpy(&mx[k], s, sizeof mx[k]);
    int64_t l0 = 16;
    for (; l0 + 64 <= full; l0 += 64) {
        memcpy(&x, s + l0, sizeof x);
        mx[1] = max16(x, mx[1]);
        memcpy(&x, s + l0 + 16, sizeof x);
        mx[2] = max16(x, mx[2]);
        memcpy(&x, s + l0 + 32, sizeof x);
        mx[3] = max16(x, mx[3]);
        memcpy(&x, s + l0 + 48, sizeof x);
        mx[0] = max16(x, mx[0]);
    }
    for (; l0 < full; l0 += 16) { /* at most three vectors: l0 / 16 mod 4 is 1, 2 or 3 */
        memcpy(&x, s + l0, sizeof x);
        if (((l0 / 16) & 3) == 1) mx[1] = max16(x, mx[1]);
        else if (((l0 / 16) & 3) == 2) mx[2] = max16(x, mx[2]);
        else mx[3] = max16(x, mx[3]);
    }
    mx[0] = max16(mx[1], mx[0]);
    mx[2] = max16(mx[3], mx[2]);
    mx[0] = max16(mx[2], mx[0]);
    float lanes[16], m = m0;
    memcpy(lanes, &mx[0], sizeof lanes);
    for (int t = 0; t < 16; t++) m = lanes[t] > m ? lanes[t] : m;
    return m;
}

/* s[0..len) -> e^(s - max s) in place; returns their sum (16 lanes at a time, summed in a fixed order: lane t
 * sums the positions l = t mod 16 in order, then the lanes are summed 0..15). The maximum is exact in any order. */
INLINE float softmax_numerators(float *restrict s, int64_t len) {
    const int64_t full = len / 16 * 16;
    float m = s[0];
    if (full) m = max_of(s, full, m);
    for (int64_t l = full; l < len; l++) m = s[l] > m ? s[l] : m;
    v16 acc = {0};
    for (int64_t l0 = 0; l0 < full; l0 += 16) {
        v16 e;
        memcpy(&e, s + l0, sizeof e);
        e = exp16(e - m);
        acc += e;
        memcpy(s + l0, &e, sizeof e);
    }
    if (full < len) {
        const int64_t l0 = full, n = len - full;
        float buf[16];
        for (int64_t t = 0; t < 16; t++) buf[t] = t < n ? s[l0 + t] - m : -100.0f;
        v16 e;
        memcpy(&e, buf, sizeof e);
        e = exp16(e);
        memcpy(buf, &e, sizeof buf);
        for (int64_t t = 0; t < 16; t++) buf[t] = t < n ? buf[t] : 0.0f;
        memcpy(&e, buf, sizeof e);
        acc += e;
        memcpy(s + l0, buf, (size_t)n * sizeof(float));
    }
    float lanes[16], sum = 0.0f;
    memcpy(lanes, &acc, sizeof lanes);
    for (int t = 0; t < 16; t++) sum += lanes[t];
    return sum;
}
#else
/* AVX2: exp16's lane arithmetic on 8 lanes (GCC kept 16-lane GNU C vectors on the stack here and moved them in
 * 64-bit pieces, ~20 % of a decode layer's attention), the fused multiply-adds written where GCC formed them from
 * exp16's expressions: t = x log2e - 1/2, r = (x - n a) + n b, p = p r + c, p r r + r as (p r) r + r. */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x); /* as exp16: -87 > x ? -87 : x */
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(-0.5f));
    const __m256i n = _mm256_cvttps_epi32(t); /* toward zero: round(x log2 e) for x <= 0 */
    const __m256 nf = _mm256_cvtepi32_ps(n);
    const __m256 r = _mm256_fmadd_ps(nf, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(1.9875691500e-4f), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* AVX2: the same softmax numerators and sum, lane for lane: each 16-lane vector of the AVX-512 build is a pair of
 * 8-lane registers (lanes 0-7, 8-15), the maxima are vmaxps (a > b ? a : b, as max16), the sum takes lanes 0..15
 * in order. */
INLINE float softmax_numerators(float *restrict s, int64_t len) {
    const int64_t full = len / 16 * 16;
    float m = s[0];
    if (full) {
        __m256 mx[4][2];
        for (int k = 0; k < 4; k++)
            for (int hf = 0; hf < 2; hf++) mx[k][hf] = _mm256_loadu_ps(s + 8 * hf);
        for (int64_t l0 = 16; l0 < full; l0 += 16) {
            const int k = (int)(l0 / 16) & 3;
            for (int hf = 0; hf < 2; hf++) mx[k][hf] = _mm256_max_ps(_mm256_loadu_ps(s + l0 + 8 * hf), mx[k][hf]);
        }
        float lanes[16];
        for (int hf = 0; hf < 2; hf++) {
            mx[0][hf] = _mm256_max_ps(mx[1][hf], mx[0][hf]);
            mx[2][hf] = _mm256_max_ps(mx[3][hf], mx[2][hf]);
            _mm256_storeu_ps(lanes + 8 * hf, _mm256_max_ps(mx[2][hf], mx[0][hf]));
        }
        for (int t = 0; t < 16; t++) m = lanes[t] > m ? lanes[t] : m;
    }
    for (int64_t l = full; l < len; l++) m = s[l] > m ? s[l] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t l0 = 0; l0 < full; l0 += 16)
        for (int hf = 0; hf < 2; hf++) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l0 + 8 * hf), mv));
            acc[hf] = _mm256_add_ps(acc[hf], e);
            _mm256_storeu_ps(s + l0 + 8 * hf, e);
        }
    if (full < len) {
        const int64_t l0 = full, n = len - full;
        float buf[16];
        for (int64_t t = 0; t < 16; t++) buf[t] = t < n ? s[l0 + t] - m : -100.0f;
        for (int hf = 0; hf < 2; hf++) _mm256_storeu_ps(buf + 8 * hf, exp8(_mm256_loadu_ps(buf + 8 * hf)));
        for (int64_t t = 0; t < 16; t++) buf[t] = t < n ? buf[t] : 0.0f;
        for (int hf = 0; hf < 2; hf++) acc[hf] = _mm256_add_ps(acc[hf], _mm256_loadu_ps(buf + 8 * hf));
        memcpy(s + l0, buf, (size_t)n * sizeof(float));
    }
    float lanes[16], sum = 0.0f;
    for (int hf = 0; hf < 2; hf++) _mm256_storeu_ps(lanes + 8 * hf, acc[hf]);
    for (int t = 0; t < 16; t++) sum += lanes[t];
    return sum;
}
#endif

/* position l's element offset in the cache (K; V adds v_offset), for KV head h */
INLINE int64_t position(const int32_t *table, int64_t l, int64_t block_size, int64_t block_elems,
                        int64_t pos_elems, int64_t h, int64_t D) {
    return (int64_t)table[l / block_size] * block_elems + (l % block_size) * pos_elems + h * D;
}

/* out[t] = offset + element offset of position l0 + t's row for t < n, else `past`: one division for the tile,
 * then block by block (a division per position, 32 a tile, was the kernel's hottest instruction: ~10 % of a layer's
 * time with the cache in L2) */
INLINE void rows_from(const int32_t *table, int64_t l0, int64_t n, int64_t block_size, int64_t block_elems,
                      int64_t pos_elems, int64_t offset, int64_t past, int64_t out[16]) {
    int64_t blk = l0 / block_size, off = l0 % block_size;
    for (int64_t t = 0; t < 16; t++) {
        if (t < n) {
            out[t] = offset + (int64_t)table[blk] * block_elems + off * pos_elems;
            if (++off == block_size) {
                off = 0;
                blk++;
            }
        } else {
            out[t] = past;
        }
    }
}

/* at[t] = offset + element offset of position l0 + t's row (t < n; 0 past n); ahead[t]: the same for position
 * l0 + 16 PD_PF + t (-1 past len), whose head rows the tile's loops prefetch into L2 as they go */
INLINE void tile_rows(const int32_t *table, int64_t len, int64_t l0, int64_t n, int64_t block_size,
                      int64_t block_elems, int64_t pos_elems, int64_t offset, int64_t at[16], int64_t ahead[16]) {
    rows_from(table, l0, n, block_size, block_elems, pos_elems, offset, 0, at);
    const int64_t la = l0 + 16 * PD_PF;
    const int64_t na = len - la < 0 ? 0 : len - la;
    rows_from(table, la, na, block_size, block_elems, pos_elems, offset, -1, ahead);
}

/* count elements from ahead + first prefetched into L2 (a cache line at a time), if ahead >= 0 */
INLINE void prefetch_span(const void *cache, int cache_bf16, int64_t ahead, int64_t first, int64_t count) {
    if (ahead < 0) return;
    const int64_t esize = cache_bf16 ? 2 : 4;
    const char *row = (const char *)cache + (ahead + first) * esize;
    for (int64_t off = 0; off < count * esize; off += 64) __builtin_prefetch(row + off, 0, 2); /* prefetcht1: L2 */
}

/* head h's row (ahead + h D, D elements) prefetched into L2, if ahead >= 0 */
INLINE void prefetch_row(const void *cache, int cache_bf16, int64_t ahead, int64_t h, int64_t D) {
    prefetch_span(cache, cache_bf16, ahead, h * D, D);
}

/* a tile's n <= 16 scores to dst: a whole tile as one fixed-size copy (a vector store; a copy of a run-time size
 * compiled to `rep movsq`, ~7 % of a layer's time) */
INLINE void store_scores(float *restrict dst, const float sc[16], int64_t n) {
    if (n == 16)
        memcpy(dst, sc, 16 * sizeof(float));
    else
        memcpy(dst, sc, (size_t)n * sizeof(float));
}

/* Tile (16 positions from l0) of one sequence's scores, every KV head, D % 16 == 0, group <= MAX_GROUP:
 * scores[i * len + l] = scale * q_i . k(l), the 16 row sums of a query head at once (hsum16). The tile's rows
 * (one block of 16 is 16 consecutive rows of all KV heads) are read once and stay in L1 for the heads' turns;
 * the rows PD_PF tiles ahead are prefetched into L2, one (position, KV head) row per turn. */
INLINE void scores_tile16(const float *restrict q, const void *cache, int cache_bf16, const int32_t *table,
                        int64_t len, int64_t l0, int64_t KVH, int64_t group, int64_t D, int64_t block_size,
                        int64_t block_elems, int64_t pos_elems, float scale, float *restrict scores) {
    const int64_t chunks = D / 16;
    const int64_t n = len - l0 < 16 ? len - l0 : 16;
    int64_t at[16], ahead[16];
    tile_rows(table, len, l0, n, block_size, block_elems, pos_elems, 0, at, ahead);
    for (int64_t h = 0; h < KVH; h++) {
        v16 part[MAX_GROUP][16];
        /* the KV head's queries, loaded once per tile and kept in registers where they fit (the model's shape,
         * group * chunks <= QREG_MAX vectors): each K vector loaded then feeds group multiply-adds, no query loads */
        v16 qr[QREG_MAX];
        const int qreg = group * chunks <= QREG_MAX;
        if (qreg)
            for (int64_t g = 0; g < group; g++)
                for (int64_t c = 0; c < chunks; c++) {
                    memcpy(&qr[g * chunks + c], q + (h * group + g) * D + 16 * c, sizeof(v16));
                    IN_REGISTER(qr[g * chunks + c]);
                }
        for (int64_t t = 0; t < 16; t++) {
            prefetch_row(cache, cache_bf16, ahead[t], h, D);
            v16 acc[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) acc[g] = (v16){0};
            if (t < n) {
                for (int64_t c = 0; c < chunks; c++) {
                    const v16 k = load16(cache, at[t] + h * D + 16 * c, cache_bf16);
                    for (int64_t g = 0; g < group; g++) {
                        v16 qv;
                        if (qreg)
                            qv = qr[g * chunks + c];
                        else
                            memcpy(&qv, q + (h * group + g) * D + 16 * c, sizeof qv);
                        acc[g] += qv * k;
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) part[g][t] = acc[g];
        }
        for (int64_t g = 0; g < group; g++) {
            float sc[16];
            const v16 r = hsum16(part[g]) * scale;
            memcpy(sc, &r, sizeof sc);
            store_scores(scores + (h * group + g) * len + l0, sc, n);
        }
    }
}

#ifdef __AVX512F__
#define scores_tile scores_tile16
#else
/* 8 vectors -> lane t = the balanced tree sum of v[t]'s lanes ((0+1)+(2+3))+((4+5)+(6+7)) */
INLINE __m256 hsum8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* AVX2 over a bf16 cache: scores_tile16's arithmetic with each 16-element chunk of a K row as one 32-byte load.
 * Its bf16 pairs give two fp32 vectors, E = elements 16 c + 2 i (the pair's low half shifted up) and O = 16 c +
 * 2 i + 1 (the high half masked); the queries are in the same order (pair_order, once per call), so lane i of E's
 * (O's) accumulator is decode's lane j = 2 i (2 i + 1), the same fused multiply-add chain over c. E + O is the
 * first level of hsum16's tree (lane pairs (0, 1), (2, 3), ...: lanes 0-3 of j < 8, 4-7 of j >= 8), so hsum8 of
 * 8 positions' E + O is tree(j < 8) + tree(j >= 8), scores_tile's sums in its order. Per position 4 loads and 8
 * integer operations widen K (were 8 widening loads and 8 shifts) and 3 vectors wait for the sums (were 6). */
INLINE void scores_tile_pairs(const float *restrict q, const uint16_t *cache, const int32_t *table, int64_t len,
                              int64_t l0, int64_t KVH, int64_t group, int64_t D, int64_t block_size,
                              int64_t block_elems, int64_t pos_elems, float scale, float *restrict scores) {
    const int64_t chunks = D / 16;
    const int64_t n = len - l0 < 16 ? len - l0 : 16;
    int64_t at[16], ahead[16];
    tile_rows(table, len, l0, n, block_size, block_elems, pos_elems, 0, at, ahead);
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t h = 0; h < KVH; h++) {
        __m256 pair[MAX_GROUP][16];
        const float *qh = q + h * group * D; /* chunk c of query head g: E at qh + g D + 16 c, O 8 further */
        for (int64_t t = 0; t < 16; t++) {
            prefetch_row(cache, 1, ahead[t], h, D);
            __m256 e[MAX_GROUP], o[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) e[g] = o[g] = _mm256_setzero_ps();
            if (t < n) {
                for (int64_t c = 0; c < chunks; c++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(cache + at[t] + h * D + 16 * c));
                    const __m256 ke = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                    const __m256 ko = _mm256_castsi256_ps(_mm256_and_si256(w, high));
                    for (int64_t g = 0; g < group; g++) {
                        e[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + 16 * c), ke, e[g]);
                        o[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + 16 * c + 8), ko, o[g]);
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) pair[g][t] = _mm256_add_ps(e[g], o[g]);
        }
        for (int64_t g = 0; g < group; g++) {
            float sc[16];
            _mm256_storeu_ps(sc, _mm256_mul_ps(hsum8(pair[g]), _mm256_set1_ps(scale)));
            _mm256_storeu_ps(sc + 8, _mm256_mul_ps(hsum8(pair[g] + 8), _mm256_set1_ps(scale)));
            store_scores(scores + (h * group + g) * len + l0, sc, n);
        }
    }
}

/* q's 16-element chunks (n of them) in place in scores_tile_pairs' order: elements 0, 2, ..., 14, then 1, 3, ...,
 * 15 (exact moves) */
INLINE void pair_order(float *q, int64_t n) {
    for (int64_t c = 0; c < n; c++) {
        float even[8], odd[8];
        for (int i = 0; i < 8; i++) {
            even[i] = q[16 * c + 2 * i];
            odd[i] = q[16 * c + 2 * i + 1];
        }
        memcpy(q + 16 * c, even, sizeof even);
        memcpy(q + 16 * c + 8, odd, sizeof odd);
    }
}

/* AVX2 over an fp32 cache: scores_tile16's arithmetic in 8-lane halves: lane j of a position's dot product sums
 * q[16 c + j] k[16 c + j] over c in order (lo: j < 8, hi: j >= 8), and hsum16's tree is tree(lo) + tree(hi) */
INLINE void scores_tile_halves(const float *restrict q, const float *cache, const int32_t *table, int64_t len,
                               int64_t l0, int64_t KVH, int64_t group, int64_t D, int64_t block_size,
                               int64_t block_elems, int64_t pos_elems, float scale, float *restrict scores) {
    const int64_t chunks = D / 16;
    const int64_t n = len - l0 < 16 ? len - l0 : 16;
    int64_t at[16], ahead[16];
    tile_rows(table, len, l0, n, block_size, block_elems, pos_elems, 0, at, ahead);
    for (int64_t h = 0; h < KVH; h++) {
        __m256 plo[MAX_GROUP][16], phi[MAX_GROUP][16];
        const float *qh = q + h * group * D;
        for (int64_t t = 0; t < 16; t++) {
            prefetch_row(cache, 0, ahead[t], h, D);
            /* in registers (as GNU C vectors GCC kept them on the stack, copied 16 bytes at a time) */
            __m256 lo[MAX_GROUP], hi[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) lo[g] = hi[g] = _mm256_setzero_ps();
            if (t < n) {
                for (int64_t c = 0; c < chunks; c++) {
                    const __m256 klo = _mm256_loadu_ps(cache + at[t] + h * D + 16 * c);
                    const __m256 khi = _mm256_loadu_ps(cache + at[t] + h * D + 16 * c + 8);
                    for (int64_t g = 0; g < group; g++) { /* q k + acc, fused: what GCC made of acc += q * k */
                        lo[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + 16 * c), klo, lo[g]);
                        hi[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + 16 * c + 8), khi, hi[g]);
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                plo[g][t] = lo[g];
                phi[g][t] = hi[g];
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float sc[16];
            const __m256 s0 = _mm256_mul_ps(_mm256_add_ps(hsum8(plo[g]), hsum8(phi[g])), _mm256_set1_ps(scale));
            const __m256 s1 =
                _mm256_mul_ps(_mm256_add_ps(hsum8(plo[g] + 8), hsum8(phi[g] + 8)), _mm256_set1_ps(scale));
            _mm256_storeu_ps(sc, s0);
            _mm256_storeu_ps(sc + 8, s1);
            store_scores(scores + (h * group + g) * len + l0, sc, n);
        }
    }
}

/* the AVX2 scores of a tile: a bf16 cache with q in pair_order, an fp32 one with q as it is */
INLINE void scores_tile(const float *restrict q, const void *cache, int cache_bf16, const int32_t *table,
                        int64_t len, int64_t l0, int64_t KVH, int64_t group, int64_t D, int64_t block_size,
                        int64_t block_elems, int64_t pos_elems, float scale, float *restrict scores) {
    if (cache_bf16)
        scores_tile_pairs(q, (const uint16_t *)cache, table, len, l0, KVH, group, D, block_size, block_elems,
                          pos_elems, scale, scores);
    else
        scores_tile_halves(q, (const float *)cache, table, len, l0, KVH, group, D, block_size, block_elems,
                           pos_elems, scale, scores);
}
#endif

/* A tile's weighted values for KV heads [h_lo, h_hi): o[i] += sum over the tile's n positions of p_i(l) v(l),
 * per KV head its query heads' accumulators loaded, updated in registers, stored; only the 16-element chunks
 * [c_lo, c_hi) of each head's D (attend_one_part's items: a KV head and half of D). p: the softmax numerators
 * [H][len]; at / ahead: tile_rows' rows of the tile's positions (v_offset included) and of those PD_PF tiles on
 * (each head's chunks prefetched into L2 as the positions go). */
INLINE void values_heads16(const float *restrict p, const void *cache, int cache_bf16, const int64_t at[16],
                           const int64_t ahead[16], int64_t n, int64_t len, int64_t l0, int64_t h_lo, int64_t h_hi,
                           int64_t group, int64_t D, float *restrict o, int64_t c_lo, int64_t c_hi) {
    /* the item's chunks indexed from 0: a constant count where the caller's is (the whole D, or half of it in
     * attend_one_part), so the accumulators stay in registers; indexed from c_lo, GCC kept them on the stack and
     * copied them with libc's memcpy (the positions split's values pass ~1.2x slower, session 25) */
    const int64_t cw = c_hi - c_lo;
    for (int64_t h = h_lo; h < h_hi; h++) {
        float *restrict oh = o + h * group * D + 16 * c_lo;
        const int64_t vh = h * D + 16 * c_lo;
        v16 acc[MAX_GROUP][8];
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < cw; c++) memcpy(&acc[g][c], oh + g * D + 16 * c, 64);
        for (int64_t t = 0; t < n; t++) {
            prefetch_span(cache, cache_bf16, ahead[t], vh, 16 * cw);
            for (int64_t c = 0; c < cw; c++) {
                const v16 v = load16(cache, at[t] + vh + 16 * c, cache_bf16);
                for (int64_t g = 0; g < group; g++) acc[g][c] += p[(h * group + g) * len + l0 + t] * v;
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < cw; c++) memcpy(oh + g * D + 16 * c, &acc[g][c], 64);
    }
}

#ifdef __AVX512F__
#define values_heads values_heads16
#else
#ifndef PD_VALUE_CHUNKS
#define PD_VALUE_CHUNKS 1
#endif
/* AVX2 over a bf16 cache: values_heads16's lane arithmetic (per output element, the tile's positions in order,
 * one multiply-add each) with V's 16-element chunks widened as scores_tile_pairs widens K: the accumulators
 * (o, across tiles) hold each chunk's even elements then its odd ones (pair_order's order; finish_heads puts
 * them back). VALUE_CHUNKS chunks of every query head per pass, where group * 2 VALUE_CHUNKS accumulators and
 * the group's numerators leave room. 1: with 2 (3 heads: 12 accumulators, 3 numerators, the widened V and its
 * odd half) GCC kept one accumulator on the stack, and its store and reload sat on every position's chain; one
 * chunk a pass (twice the numerators' broadcasts) took 0.93-0.94x the time of a lone sequence's attention at
 * 1,084 positions on a Zen 3, the same bits (docs/engine-step.md, session 40). */
INLINE void values_heads_pairs(const float *restrict p, const uint16_t *cache, const int64_t at[16],
                               const int64_t ahead[16], int64_t n, int64_t len, int64_t l0, int64_t h_lo,
                               int64_t h_hi, int64_t group, int64_t D, float *restrict o, int64_t c_lo,
                               int64_t c_hi) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t vc =
        group * (2 * PD_VALUE_CHUNKS + 1) + 1 <= 16 && (c_hi - c_lo) % PD_VALUE_CHUNKS == 0 ? PD_VALUE_CHUNKS : 1;
    for (int64_t h = h_lo; h < h_hi; h++) {
        for (int64_t t = 0; t < 16; t++) prefetch_span(cache, 1, ahead[t], h * D + 16 * c_lo, 16 * (c_hi - c_lo));
        for (int64_t c0 = c_lo; c0 < c_hi; c0 += vc) {
            __m256 acc[MAX_GROUP][2 * PD_VALUE_CHUNKS];
            for (int64_t g = 0; g < group; g++)
                for (int64_t i = 0; i < 2 * vc; i++)
                    acc[g][i] = _mm256_loadu_ps(o + (h * group + g) * D + 16 * c0 + 8 * i);
            for (int64_t t = 0; t < n; t++) {
                __m256 pg[MAX_GROUP];
                for (int64_t g = 0; g < group; g++) pg[g] = _mm256_set1_ps(p[(h * group + g) * len + l0 + t]);
                for (int64_t c = 0; c < vc; c++) {
                    const __m256i *src = (const __m256i *)(cache + at[t] + h * D + 16 * (c0 + c));
                    const __m256 ve = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(src), 16));
                    for (int64_t g = 0; g < group; g++) acc[g][2 * c] = _mm256_fmadd_ps(pg[g], ve, acc[g][2 * c]);
                    const __m256 vo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(src), high));
                    for (int64_t g = 0; g < group; g++)
                        acc[g][2 * c + 1] = _mm256_fmadd_ps(pg[g], vo, acc[g][2 * c + 1]);
                }
            }
            for (int64_t g = 0; g < group; g++)
                for (int64_t i = 0; i < 2 * vc; i++)
                    _mm256_storeu_ps(o + (h * group + g) * D + 16 * c0 + 8 * i, acc[g][i]);
        }
    }
}

/* AVX2 over an fp32 cache: values_heads16's lane arithmetic (per output element, the tile's positions in order,
 * one multiply-add each), 8 lanes of every query head of a KV head at a time, so the accumulators fit 16
 * registers */
INLINE void values_heads_halves(const float *restrict p, const float *cache, const int64_t at[16],
                                const int64_t ahead[16], int64_t n, int64_t len, int64_t l0, int64_t h_lo,
                                int64_t h_hi, int64_t group, int64_t D, float *restrict o, int64_t c_lo,
                                int64_t c_hi) {
    /* VALUE_CHUNKS 8-lane chunks of every query head per pass: group * VALUE_CHUNKS accumulators and the group's
     * numerators of a position fit the 16 ymm registers (3 heads: 4 chunks), so each numerator is broadcast once
     * per pass, not once per chunk */
    const int64_t chunks = 2 * (c_hi - c_lo); /* of 8 elements, from 2 c_lo: even */
    const int64_t vc = group * 5 + 1 <= 16 && chunks % 4 == 0 ? 4 : group * 3 + 1 <= 16 ? 2 : 1;
    for (int64_t h = h_lo; h < h_hi; h++) {
        for (int64_t t = 0; t < 16; t++) prefetch_span(cache, 0, ahead[t], h * D + 16 * c_lo, 16 * (c_hi - c_lo));
        for (int64_t c0 = 2 * c_lo; c0 < 2 * c_hi; c0 += vc) {
            __m256 acc[MAX_GROUP][4];
            for (int64_t g = 0; g < group; g++)
                for (int64_t c = 0; c < vc; c++) acc[g][c] = _mm256_loadu_ps(o + (h * group + g) * D + 8 * (c0 + c));
            for (int64_t t = 0; t < n; t++) {
                __m256 pg[MAX_GROUP];
                for (int64_t g = 0; g < group; g++) pg[g] = _mm256_set1_ps(p[(h * group + g) * len + l0 + t]);
                for (int64_t c = 0; c < vc; c++) {
                    const __m256 v = _mm256_loadu_ps(cache + at[t] + h * D + 8 * (c0 + c));
                    /* p v + acc, fused: what GCC made of acc += p * v */
                    for (int64_t g = 0; g < group; g++) acc[g][c] = _mm256_fmadd_ps(pg[g], v, acc[g][c]);
                }
            }
            for (int64_t g = 0; g < group; g++)
                for (int64_t c = 0; c < vc; c++) _mm256_storeu_ps(o + (h * group + g) * D + 8 * (c0 + c), acc[g][c]);
        }
    }
}

/* the AVX2 values: a bf16 cache into pair-ordered accumulators, an fp32 one in order */
INLINE void values_heads(const float *restrict p, const void *cache, int cache_bf16, const int64_t at[16],
                         const int64_t ahead[16], int64_t n, int64_t len, int64_t l0, int64_t h_lo, int64_t h_hi,
                         int64_t group, int64_t D, float *restrict o, int64_t c_lo, int64_t c_hi) {
    if (cache_bf16)
        values_heads_pairs(p, (const uint16_t *)cache, at, ahead, n, len, l0, h_lo, h_hi, group, D, o, c_lo, c_hi);
    else
        values_heads_halves(p, (const float *)cache, at, ahead, n, len, l0, h_lo, h_hi, group, D, o, c_lo, c_hi);
}
#endif

/* Tile (16 positions from l0) of one sequence's weighted values, every KV head and all of D (values_heads) */
INLINE void values_tile(const float *restrict p, const void *cache, int cache_bf16, const int32_t *table,
                        int64_t len, int64_t l0, int64_t KVH, int64_t group, int64_t D, int64_t block_size,
                        int64_t block_elems, int64_t pos_elems, int64_t v_offset, float *restrict o) {
    const int64_t n = len - l0 < 16 ? len - l0 : 16;
    int64_t at[16], ahead[16];
    tile_rows(table, len, l0, n, block_size, block_elems, pos_elems, v_offset, at, ahead);
    values_heads(p, cache, cache_bf16, at, ahead, n, len, l0, 0, KVH, group, D, o, 0, D / 16);
}

/* o's H query heads (D values each), 16-element chunks [c_lo, c_hi): times 1 / sums[i] (values_heads_pairs'
 * accumulators put back in order on the way: AVX2 over a bf16 cache) */
INLINE void finish_heads(float *restrict o, const float *restrict sums, int64_t H, int64_t D, int64_t c_lo,
                         int64_t c_hi, int cache_bf16) {
    for (int64_t i = 0; i < H; i++) {
        const float inv = 1.0f / sums[i];
#ifndef __AVX512F__
        if (cache_bf16) {
            for (int64_t c = c_lo; c < c_hi; c++) {
                float *chunk = o + i * D + 16 * c, even[8], odd[8];
                memcpy(even, chunk, sizeof even);
                memcpy(odd, chunk + 8, sizeof odd);
                for (int j = 0; j < 8; j++) {
                    chunk[2 * j] = even[j] * inv;
                    chunk[2 * j + 1] = odd[j] * inv;
                }
            }
            continue;
        }
#endif
        (void)cache_bf16;
        for (int64_t d = 16 * c_lo; d < 16 * c_hi; d++) o[i * D + d] *= inv;
    }
}

/* B sequences, D % 16 == 0, D <= 128, group <= MAX_GROUP. q: fp32 [B][H][D]; scores: [B][H * max_len];
 * sums: [B][H]. shared_len (a multiple of 16, at most every length): leading positions whose blocks all the
 * sequences share (one cached system prompt): walked tile by tile across the sequences, so each shared block
 * comes from memory once and from cache for the others; the rest sequence by sequence. Either order sums each
 * sequence's terms in the same order: the same bits. */
INLINE void attend_vec(const float *restrict q, const void *cache, int cache_bf16, const int32_t *tables,
                       int64_t table_stride, const int32_t *lens, int64_t B, int64_t KVH, int64_t group,
                       int64_t D, int64_t block_size, int64_t block_elems, int64_t pos_elems, int64_t v_offset,
                       float scale, float *restrict scores, float *restrict sums, int64_t max_len,
                       float *restrict out, int64_t shared_len) {
    const int64_t H = KVH * group;
    const int64_t sstride = H * max_len;
#define SEQ_ARGS(b) tables + (b) * table_stride, lens[b]
    for (int64_t l0 = 0; l0 < shared_len; l0 += 16)
        for (int64_t b = 0; b < B; b++)
            scores_tile(q + b * H * D, cache, cache_bf16, SEQ_ARGS(b), l0, KVH, group, D, block_size,
                        block_elems, pos_elems, scale, scores + b * sstride);
    for (int64_t b = 0; b < B; b++)
        for (int64_t l0 = shared_len; l0 < lens[b]; l0 += 16)
            scores_tile(q + b * H * D, cache, cache_bf16, SEQ_ARGS(b), l0, KVH, group, D, block_size,
                        block_elems, pos_elems, scale, scores + b * sstride);
    for (int64_t b = 0; b < B; b++) {
        float *o = out + b * H * D;
        for (int64_t i = 0; i < H * D; i++) o[i] = 0.0f;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < H; i++)
            sums[b * H + i] = softmax_numerators(scores + b * sstride + i * lens[b], lens[b]);
    for (int64_t l0 = 0; l0 < shared_len; l0 += 16)
        for (int64_t b = 0; b < B; b++)
            values_tile(scores + b * sstride, cache, cache_bf16, SEQ_ARGS(b), l0, KVH, group, D, block_size,
                        block_elems, pos_elems, v_offset, out + b * H * D);
    for (int64_t b = 0; b < B; b++)
        for (int64_t l0 = shared_len; l0 < lens[b]; l0 += 16)
            values_tile(scores + b * sstride, cache, cache_bf16, SEQ_ARGS(b), l0, KVH, group, D, block_size,
                        block_elems, pos_elems, v_offset, out + b * H * D);
#undef SEQ_ARGS
    for (int64_t b = 0; b < B; b++) finish_heads(out + b * H * D, sums + b * H, H, D, 0, D / 16, cache_bf16);
}

/* Thread p's share of one sequence (attend_vec's B = 1, no shared part) whose P threads all call this inside
 * one OpenMP parallel region, each share of each pass a fixed function of the length and P: the scores by
 * 16-position tiles (a position's score is its own), the softmax numerators by query heads, the values by (KV
 * head, half of D) items (each output element's chain over the positions stays on one thread, in order).
 * Between the passes the team waits at a barrier. Every number is computed by the same operations as
 * attend_vec's: the same bits for any team size, which spreads one long sequence over the threads (the KV-head
 * split it replaced left one of 2 threads 2 of SmolLM2's 3 heads). Called from the region (through
 * one_part_model / one_part_any) rather than opening it: GCC outlines a region's body into a function that
 * reads every captured variable through a pointer, before constants reach it (the model's shape as runtime
 * sizes, loop bounds reloaded: 1.6-2.6x the passes' time on one thread). */
INLINE void attend_one_part(const float *restrict q, const void *cache, int cache_bf16, const int32_t *table,
                            int64_t len, int64_t KVH, int64_t group, int64_t D, int64_t block_size,
                            int64_t block_elems, int64_t pos_elems, int64_t v_offset, float scale,
                            float *restrict scores, float *restrict sums, float *restrict out, int64_t p,
                            int64_t P) {
    const int64_t H = KVH * group, tiles = (len + 15) / 16, chunks = D / 16;
    const int64_t halves = chunks % 2 == 0 ? 2 : 1, items = KVH * halves;
    for (int64_t t = tiles * p / P; t < tiles * (p + 1) / P; t++)
        scores_tile(q, cache, cache_bf16, table, len, 16 * t, KVH, group, D, block_size, block_elems, pos_elems,
                    scale, scores);
#pragma omp barrier
    for (int64_t i = H * p / P; i < H * (p + 1) / P; i++) sums[i] = softmax_numerators(scores + i * len, len);
#pragma omp barrier
    const int64_t it_lo = items * p / P, it_hi = items * (p + 1) / P;
#define ITEM(it) const int64_t h = (it) / halves, c_lo = chunks / halves * ((it) % halves), \
                               c_hi = c_lo + chunks / halves
    for (int64_t it = it_lo; it < it_hi; it++) {
        ITEM(it);
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 16 * c_lo; d < 16 * c_hi; d++) out[(h * group + g) * D + d] = 0.0f;
    }
    /* tile by tile, the rows found once per tile for all of the thread's items */
    for (int64_t l0 = 0; l0 < len; l0 += 16) {
        const int64_t n = len - l0 < 16 ? len - l0 : 16;
        int64_t at[16], ahead[16];
        tile_rows(table, len, l0, n, block_size, block_elems, pos_elems, v_offset, at, ahead);
        for (int64_t it = it_lo; it < it_hi; it++) {
            ITEM(it);
            values_heads(scores, cache, cache_bf16, at, ahead, n, len, l0, h, h + 1, group, D, out, c_lo, c_hi);
        }
    }
    for (int64_t it = it_lo; it < it_hi; it++) {
        ITEM(it);
        finish_heads(out + h * group * D, sums + h * group, group, D, c_lo, c_hi, cache_bf16);
    }
#undef ITEM
}

/* Thread p's share of one sequence split by KV heads instead: heads [KVH p / P, KVH (p + 1) / P), each
 * attended whole (scores, softmax, values) on its thread, no barrier; the same operations per number as
 * attend_vec, so the same bits. With fewer heads than threads some threads idle, and SmolLM2's 3 over 2 leave
 * one thread a third of the work (SPLIT_HEADS). */
INLINE void attend_heads_part(const float *restrict q, const void *cache, int cache_bf16, const int32_t *table,
                              int64_t len, int64_t KVH, int64_t group, int64_t D, int64_t block_size,
                              int64_t block_elems, int64_t pos_elems, int64_t v_offset, float scale,
                              float *restrict scores, float *restrict sums, float *restrict out, int64_t p,
                              int64_t P) {
    const int64_t h0 = KVH * p / P, h1 = KVH * (p + 1) / P, esize = cache_bf16 ? 2 : 4;
    if (h0 == h1) return;
    /* heads h0 .. h1 - 1 as a cache of h1 - h0 heads: q, the cache, scores and out from their first element on */
    const float *qh = q + h0 * group * D;
    const void *ch = (const char *)cache + h0 * D * esize;
    float *sh = scores + h0 * group * len, *oh = out + h0 * group * D;
    for (int64_t l0 = 0; l0 < len; l0 += 16)
        scores_tile(qh, ch, cache_bf16, table, len, l0, h1 - h0, group, D, block_size, block_elems, pos_elems, scale,
                    sh);
    for (int64_t i = 0; i < (h1 - h0) * group; i++) sums[h0 * group + i] = softmax_numerators(sh + i * len, len);
    for (int64_t i = 0; i < (h1 - h0) * group * D; i++) oh[i] = 0.0f;
    for (int64_t l0 = 0; l0 < len; l0 += 16)
        values_tile(sh, ch, cache_bf16, table, len, l0, h1 - h0, group, D, block_size, block_elems, pos_elems,
                    v_offset, oh);
    finish_heads(oh, sums + h0 * group, (h1 - h0) * group, D, 0, D / 16, cache_bf16);
}

/* attend_one_part behind a call, its arguments plain parameters: the model's compiled shape, and any shape */
#if defined(PD_GROUP) && defined(PD_HEAD_DIM)
static __attribute__((noinline)) void one_part_model(const float *restrict q, const void *cache, int cache_bf16,
                                                     const int32_t *table, int64_t len, int64_t KVH,
                                                     int64_t block_size, int64_t block_elems, int64_t pos_elems,
                                                     int64_t v_offset, float scale, float *restrict scores,
                                                     float *restrict sums, float *restrict out, int64_t p, int64_t P,
                                                     int heads) {
    if (heads)
        attend_heads_part(q, cache, cache_bf16, table, len, KVH, PD_GROUP, PD_HEAD_DIM, block_size, block_elems,
                          pos_elems, v_offset, scale, scores, sums, out, p, P);
    else
        attend_one_part(q, cache, cache_bf16, table, len, KVH, PD_GROUP, PD_HEAD_DIM, block_size, block_elems,
                        pos_elems, v_offset, scale, scores, sums, out, p, P);
}
#endif

static __attribute__((noinline)) void one_part_any(const float *restrict q, const void *cache, int cache_bf16,
                                                   const int32_t *table, int64_t len, int64_t KVH, int64_t group,
                                                   int64_t D, int64_t block_size, int64_t block_elems,
                                                   int64_t pos_elems, int64_t v_offset, float scale,
                                                   float *restrict scores, float *restrict sums, float *restrict out,
                                                   int64_t p, int64_t P, int heads) {
    if (heads)
        attend_heads_part(q, cache, cache_bf16, table, len, KVH, group, D, block_size, block_elems, pos_elems,
                          v_offset, scale, scores, sums, out, p, P);
    else
        attend_one_part(q, cache, cache_bf16, table, len, KVH, group, D, block_size, block_elems, pos_elems,
                        v_offset, scale, scores, sums, out, p, P);
}

/* The same for any D and group (scalar loops). */
INLINE void attend_any(const float *restrict q, const void *cache, int cache_bf16, const int32_t *table,
                       int64_t len, int64_t group, int64_t D, int64_t block_size, int64_t block_elems,
                       int64_t pos_elems, int64_t v_offset, int64_t h, float scale, float *restrict scores,
                       float *restrict o) {
    for (int64_t g = 0; g < group; g++) {
        float *restrict sg = scores + g * len;
        const float *restrict qg = q + g * D;
        for (int64_t l = 0; l < len; l++) {
            const int64_t at = position(table, l, block_size, block_elems, pos_elems, h, D);
            float s = 0.0f;
            for (int64_t d = 0; d < D; d++) s += qg[d] * load1(cache, at + d, cache_bf16);
            sg[l] = s * scale;
        }
        const float sum = softmax_numerators(sg, len);
        float *restrict og = o + g * D;
        for (int64_t d = 0; d < D; d++) og[d] = 0.0f;
        for (int64_t l = 0; l < len; l++) {
            const int64_t at = v_offset + position(table, l, block_size, block_elems, pos_elems, h, D);
            for (int64_t d = 0; d < D; d++) og[d] += sg[l] * load1(cache, at + d, cache_bf16);
        }
        for (int64_t d = 0; d < D; d++) og[d] /= sum;
    }
}

/* Decode attention of B sequences (see the top of the file). scratch: at least B * H * (max_len + D + 1)
 * floats (engine.native_decode.scratch_size gives more: the bf16 decode's), max_len >= every lens[b].
 * shared_len: leading positions all sequences share (attend_vec; 0: none).
 * threads: a lone sequence (B == 1) on the vector path is spread over that many OpenMP threads as `split` says
 * (SPLIT_*: attend_one_part or attend_heads_part, the same bits); otherwise the call runs on the calling thread.
 * Returns 0; -1 when an argument is out of range (a length, a block id, a table too short, a shape, threads < 1,
 * an unknown split): checked for every sequence before anything is read or written. */
/* 0 when decode attention's arguments are in range (decode_attention's list), else -1 */
static int decode_args_ok(const int32_t *block_tables, int64_t table_stride, const int32_t *lens, int64_t B,
                          int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks, int64_t max_len,
                          int64_t shared_len, int threads, int split) {
    if (B < 0 || H <= 0 || KVH <= 0 || H % KVH || D <= 0 || block_size <= 0 || max_len <= 0) return -1;
    if (threads < 1 || split < SPLIT_DEFAULT || split > SPLIT_POSITIONS) return -1;
    if (shared_len < 0 || shared_len % 16) return -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = lens[b];
        if (len <= 0 || len > max_len || len < shared_len) return -1;
        const int32_t *table = block_tables + b * table_stride;
        for (int64_t t = 0; t * block_size < len; t++)
            if (t >= table_stride || table[t] < 0 || table[t] >= num_blocks) return -1;
    }
    return 0;
}

static int decode_attention(const void *q, int q_bf16, const void *cache, int cache_bf16,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *lens, int64_t B,
                            int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                            float *out, float *scratch, int64_t max_len, int64_t shared_len, int threads,
                            int split) {
    if (decode_args_ok(block_tables, table_stride, lens, B, H, KVH, D, block_size, num_blocks, max_len, shared_len,
                       threads, split))
        return -1;
    const int64_t group = H / KVH;
    const int64_t pos_elems = KVH * D;
    const int64_t block_elems = block_size * pos_elems;
    const int64_t v_offset = num_blocks * block_elems;
    float *scores = scratch;                /* [B][H * max_len] */
    float *qf = scratch + B * H * max_len;  /* [B][H][D] */
    float *sums = qf + B * H * D;           /* [B][H] */
    for (int64_t i = 0; i < B * H * D; i++) qf[i] = load1(q, i, q_bf16);
    const int vec = D % 16 == 0 && D <= 128 && group <= MAX_GROUP && KVH <= 64;
#ifndef __AVX512F__
    if (vec && cache_bf16) pair_order(qf, B * H * D / 16); /* scores_tile_pairs' query order */
#endif
    if (!vec) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                attend_any(qf + (b * H + h * group) * D, cache, cache_bf16, block_tables + b * table_stride,
                           lens[b], group, D, block_size, block_elems, pos_elems, v_offset, h, scale, scores,
                           out + (b * H + h * group) * D);
        return 0;
    }
    if (B == 1 && threads > 1) {
        const int heads = split == SPLIT_HEADS || (split == SPLIT_DEFAULT && ONE_SEQUENCE_SPLIT == SPLIT_HEADS);
#pragma omp parallel num_threads(heads && threads > KVH ? (int)KVH : threads)
        {
            const int64_t p = omp_get_thread_num(), P = omp_get_num_threads();
#if defined(PD_GROUP) && defined(PD_HEAD_DIM)
            if (group == PD_GROUP && D == PD_HEAD_DIM)
                one_part_model(qf, cache, cache_bf16, block_tables, lens[0], KVH, block_size, block_elems, pos_elems,
                               v_offset, scale, scores, sums, out, p, P, heads);
            else
#endif
                one_part_any(qf, cache, cache_bf16, block_tables, lens[0], KVH, group, D, block_size, block_elems,
                             pos_elems, v_offset, scale, scores, sums, out, p, P, heads);
        }
        return 0;
    }
#define ATTEND(G, DD)                                                                                          \
    attend_vec(qf, cache, cache_bf16, block_tables, table_stride, lens, B, KVH, G, DD, block_size, block_elems, \
               pos_elems, v_offset, scale, scores, sums, max_len, out, shared_len)
    /* the model's shape (PD_GROUP, PD_HEAD_DIM: -D flags of the build) with constants, so accumulators stay in
     * registers; any other shape with runtime sizes */
#if defined(PD_GROUP) && defined(PD_HEAD_DIM)
    if (group == PD_GROUP && D == PD_HEAD_DIM)
        ATTEND(PD_GROUP, PD_HEAD_DIM);
    else
#endif
        ATTEND(group, D);
#undef ATTEND
    return 0;
}

int paged_decode_attention(const void *q, int q_bf16,         /* [B][H][D] */
                           const void *cache, int cache_bf16, /* [2][num_blocks][block_size][KVH][D] */
                           const int32_t *block_tables, int64_t table_stride, /* [B][table_stride] */
                           const int32_t *lens,                               /* [B] */
                           int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                           int64_t num_blocks, float scale, float *out, /* [B][H][D] fp32 */
                           float *scratch, int64_t max_len, int64_t shared_len) {
    return decode_attention(q, q_bf16, cache, cache_bf16, block_tables, table_stride, lens, B, H, KVH, D,
                            block_size, num_blocks, scale, out, scratch, max_len, shared_len, 1, SPLIT_DEFAULT);
}

/* The same, a lone sequence (B == 1) spread over `threads` OpenMP threads, split as `split` says
 * (SPLIT_DEFAULT: the build's ONE_SEQUENCE_SPLIT): the same bits as paged_decode_attention for any thread
 * count and split. engine/kernels/decode_step.c calls it for one-sequence steps (SPLIT_DEFAULT). */
int paged_decode_attention_threads(const void *q, int q_bf16, const void *cache, int cache_bf16,
                                   const int32_t *block_tables, int64_t table_stride, const int32_t *lens, int64_t B,
                                   int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks,
                                   float scale, float *out, float *scratch, int64_t max_len, int64_t shared_len,
                                   int threads, int split) {
    return decode_attention(q, q_bf16, cache, cache_bf16, block_tables, table_stride, lens, B, H, KVH, D,
                            block_size, num_blocks, scale, out, scratch, max_len, shared_len, threads, split);
}

/* ---- Prefill: many query rows of one sequence, each exactly as paged_decode_attention attends it alone ----
 *
 * Rows at positions start .. start + L - 1 of one sequence (its K/V already in the cache); row r attends
 * positions 0 .. start + r (causal), i.e. it is a decode of length start + r + 1. Rows are taken ROWS at a time
 * (a row tile; the last tile's missing rows repeat its last row and are dropped) per KV head, so each K and V
 * vector read from the cache serves ROWS x group queries; every (row, query head) keeps the decode kernel's
 * operation sequence: the same scores (q . k by fused multiply-adds over the 16-lane chunks in order, the
 * transposing sum hsum16, times scale), the same softmax_numerators over exactly its own positions, the same
 * values accumulation (positions in order, one fused multiply-add each), the same final 1 / sum. So a row's
 * result equals the decode kernel's for that position, bit for bit, whatever tile, chunk or thread computes it.
 * (KV head, row tile) pairs are independent and spread over OpenMP threads. */

#ifndef PD_ROWS
#define PD_ROWS 16
#endif
#define ROWS PD_ROWS /* query rows per tile (a -D flag of the build) */
#ifndef PD_LANES
#define PD_LANES 16
#endif
/* positions per vector in prefill's scores: 16 (a 512-bit register); 8 where registers are 256-bit (-DPD_LANES=8,
 * the avx2 build). The per-position arithmetic is the same either way. */
typedef float vl __attribute__((vector_size(PD_LANES * 4)));
/* vl at any float's address (loads and stores that GCC keeps as single moves where memcpy of an array element
 * became a byte-copy loop) */
typedef float vl_any __attribute__((vector_size(PD_LANES * 4), aligned(4), may_alias));
typedef uint16_t u16l __attribute__((vector_size(PD_LANES * 2)));
typedef uint32_t u32l __attribute__((vector_size(PD_LANES * 4)));

/* load16's PD_LANES-wide twin: PD_LANES consecutive elements at src[index] as fp32 (the same values) */
INLINE vl loadl(const void *src, int64_t index, int is_bf16) {
    vl r;
    if (is_bf16) {
#if PD_LANES == 16
        const v16 w = load16(src, index, 1); /* its one widening load on AVX-512 */
#else
        u16l h;
        memcpy(&h, (const uint16_t *)src + index, sizeof h);
        u32l w = __builtin_convertvector(h, u32l) << 16;
#endif
        memcpy(&r, &w, sizeof r);
    } else {
        memcpy(&r, (const float *)src + index, sizeof r);
    }
    return r;
}

/* query heads of one KV head that share each K (V) vector a prefill tile loads, sized so that SmolLM2's
 * accumulators (group 3, D 64; scores: 8 vectors per head, values: D / PD_LANES) stay in the 32 registers of a
 * 512-bit build; 256-bit builds (16 registers) take one head at a time. Any group and D run correctly; larger
 * ones spill. */
#if PD_LANES == 16
#define SCORE_HEADS 3
#define VALUE_HEADS 4
#else
#define SCORE_HEADS 1
#define VALUE_HEADS 1
#endif

#if PD_LANES == 8
/* 256-bit build: the 16 scores of one tile for two query rows a and b (the same query head of consecutive rows),
 * each KT vector loaded feeding both rows' fused multiply-adds (two queries' broadcasts and two KT loads feed four,
 * where one query's broadcast and two loads fed two: the loads, not the multiply-adds, bounded the one-row loop).
 * Each row's lanes go through the one-row loop's operations: per lane a chain over the chunks c of
 * q[j] k[j][lane] fused multiply-adds from zero, j = 16 c + 8 hf + 4 iq + i, then the tree
 * ((a0 + a1) + (a2 + a3)) over i, + over iq, + over hf, times scale (decode's hsum16 order): the same bits. */
INLINE void scores_two_rows(const float *restrict qa, const float *restrict qb, const float *restrict KT,
                            int64_t chunks, float scale, float *restrict sa, float *restrict sb) {
    __m256 half[2][2][2]; /* [row][position half u][hf] */
    for (int64_t hf = 0; hf < 2; hf++) {
        __m256 quarter[2][2][2]; /* [row][u][iq] */
        for (int64_t iq = 0; iq < 2; iq++) {
            __m256 pair[2][2][2]; /* [row][u][ip]: a[2 ip] + a[2 ip + 1] */
            for (int64_t ip = 0; ip < 2; ip++) {
                __m256 a[2][2][2]; /* [row][u][i - 2 ip] */
                for (int64_t w = 0; w < 2; w++)
                    for (int64_t u = 0; u < 2; u++)
                        for (int64_t i = 0; i < 2; i++) a[w][u][i] = _mm256_setzero_ps();
                for (int64_t c = 0; c < chunks; c++)
                    for (int64_t i = 0; i < 2; i++) {
                        const int64_t j = 16 * c + 8 * hf + 4 * iq + 2 * ip + i;
                        __m256 k0 = _mm256_loadu_ps(KT + j * 16), k1 = _mm256_loadu_ps(KT + j * 16 + 8);
                        IN_REGISTER(k0); /* loaded once for both rows, not folded into each multiply-add */
                        IN_REGISTER(k1);
                        const __m256 xa = _mm256_broadcast_ss(qa + j), xb = _mm256_broadcast_ss(qb + j);
                        a[0][0][i] = _mm256_fmadd_ps(xa, k0, a[0][0][i]);
                        a[0][1][i] = _mm256_fmadd_ps(xa, k1, a[0][1][i]);
                        a[1][0][i] = _mm256_fmadd_ps(xb, k0, a[1][0][i]);
                        a[1][1][i] = _mm256_fmadd_ps(xb, k1, a[1][1][i]);
                    }
                for (int64_t w = 0; w < 2; w++)
                    for (int64_t u = 0; u < 2; u++) pair[w][u][ip] = _mm256_add_ps(a[w][u][0], a[w][u][1]);
            }
            for (int64_t w = 0; w < 2; w++)
                for (int64_t u = 0; u < 2; u++) quarter[w][u][iq] = _mm256_add_ps(pair[w][u][0], pair[w][u][1]);
        }
        for (int64_t w = 0; w < 2; w++)
            for (int64_t u = 0; u < 2; u++) half[w][u][hf] = _mm256_add_ps(quarter[w][u][0], quarter[w][u][1]);
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t u = 0; u < 2; u++) {
        _mm256_storeu_ps(sa + 8 * u, _mm256_mul_ps(_mm256_add_ps(half[0][u][0], half[0][u][1]), sc));
        _mm256_storeu_ps(sb + 8 * u, _mm256_mul_ps(_mm256_add_ps(half[1][u][0], half[1][u][1]), sc));
    }
}
#endif

/* One row tile (rows row0 .. row0 + nrows - 1 at positions pos0 ..) and KV head h: out[row][h group + g][D].
 * Positions are walked 16 at a time; each tile of 16 K (then V) rows of head h is read from memory once and
 * stays in L1 while every (row, query head) of the tile takes its turn, as decode's scores_tile / values_tile
 * (only the query, or the accumulators, change between turns). S: ROWS * group * sstride scores of this
 * thread; sums: ROWS * group; O: ROWS * group * D accumulators. offs[l]: position l's element offset. */
INLINE void prefill_tile(const float *restrict qf, int64_t H, int64_t row0, int64_t nrows, int64_t pos0,
                         const void *cache, int cache_bf16, const int64_t *offs, int64_t h, int64_t group,
                         int64_t D, int64_t v_offset, float scale, float *restrict S, int64_t sstride,
                         float *restrict sums, float *restrict O, float *restrict KT, float *restrict out) {
    const int64_t chunks = D / 16;
    const int64_t last_len = pos0 + nrows;
    const int64_t esize = cache_bf16 ? 2 : 4;
    for (int64_t l0 = 0; l0 < last_len; l0 += 16) {
        const int64_t nt = last_len - l0 < 16 ? last_len - l0 : 16;
        for (int64_t t = 0; t < 16 && l0 + 16 + t < last_len; t++)
            __builtin_prefetch((const char *)cache + (offs[l0 + 16 + t] + h * D) * esize);
        /* the tile's keys transposed, KT[d][t] (zero past the tile's last position): position t in lane t */
        for (int64_t c = 0; c < chunks; c++) {
            v16 kv[16];
            for (int64_t t = 0; t < 16; t++)
                kv[t] = t < nt ? load16(cache, offs[l0 + t] + h * D + 16 * c, cache_bf16) : (v16){0};
            transpose16(kv);
            memcpy(KT + 16 * c * 16, kv, sizeof kv);
        }
        int64_t r_first = 0; /* rows before this one were scored in pairs (the 256-bit build) */
#if PD_LANES == 8
        /* rows r and r + 1 together where row r + 1 reaches this tile (row r's scores past its length, if it does
         * not, lie inside its sstride and are never read); an odd last row alone, below */
        for (; r_first + 1 < nrows; r_first += 2)
            if (pos0 + r_first + 2 > l0)
                for (int64_t g = 0; g < group; g++) {
                    const float *qa = qf + ((row0 + r_first) * H + h * group + g) * D;
                    scores_two_rows(qa, qa + H * D, KT, chunks, scale, S + (r_first * group + g) * sstride + l0,
                                    S + ((r_first + 1) * group + g) * sstride + l0);
                }
#endif
        for (int64_t r = r_first; r < nrows; r++) {
            const int64_t len = pos0 + r + 1;
            const int64_t n = len - l0 < 16 ? len - l0 : 16;
            if (n <= 0) continue;
            const float *q0 = qf + ((row0 + r) * H + h * group) * D; /* query head g's at q0 + g D */
#if PD_LANES == 8
            /* 256-bit build: one query head at a time, both 8-position halves of the tile together, so each
             * broadcast of q[j] feeds two fused multiply-adds (one per half) where it fed one. Each lane's chain
             * over the chunks and the tree over j are the #else branch's (decode's hsum16 order), taken four
             * accumulators at a time ((a0 + a1) + (a2 + a3), then (a4 + a5) + (a6 + a7), then their sum), so 8
             * accumulators and the broadcast fit 16 registers: the same bits. All 16 lanes are computed whatever
             * n (a lane past the row's length holds a score inside its sstride that is never read; KT is zero past
             * the tile's last position). */
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q0 + g * D;
                vl half[2][2]; /* [position half u][hf] */
                for (int64_t hf = 0; hf < 2; hf++) {
                    vl quarter[2][2]; /* [u][which four accumulators] */
                    for (int64_t iq = 0; iq < 2; iq++) {
                        vl a[2][4];
                        for (int64_t u = 0; u < 2; u++)
                            for (int64_t i = 0; i < 4; i++) a[u][i] = (vl){0};
                        for (int64_t c = 0; c < chunks; c++)
                            for (int64_t i = 0; i < 4; i++) {
                                const int64_t j = 16 * c + 8 * hf + 4 * iq + i;
                                vl k0, k1;
                                memcpy(&k0, KT + j * 16, sizeof k0);
                                memcpy(&k1, KT + j * 16 + 8, sizeof k1);
                                IN_REGISTER(k0);
                                IN_REGISTER(k1);
                                const float qj = qg[j];
                                a[0][i] += qj * k0;
                                a[1][i] += qj * k1;
                            }
                        for (int64_t u = 0; u < 2; u++) quarter[u][iq] = (a[u][0] + a[u][1]) + (a[u][2] + a[u][3]);
                    }
                    for (int64_t u = 0; u < 2; u++) half[u][hf] = quarter[u][0] + quarter[u][1];
                }
                for (int64_t u = 0; u < 2; u++) {
                    const vl res = (half[u][0] + half[u][1]) * scale;
                    memcpy(S + (r * group + g) * sstride + l0 + 8 * u, &res, sizeof res);
                }
            }
#else
            for (int64_t g0 = 0; g0 < group; g0 += SCORE_HEADS) {
                const int64_t ng = group - g0 < SCORE_HEADS ? group - g0 : SCORE_HEADS;
                /* lane j of decode's 16-lane dot product (a fused multiply-add chain over the chunks c of
                 * q[16 c + j] k[16 c + j]) is a[g][j] here, one position per lane; hsum16's tree over j becomes
                 * the same tree of vector adds. Each KT vector loaded serves the ng query heads in turn (their
                 * chains stay apart: the same operations per query head as one at a time). */
                for (int64_t u0 = 0; u0 < n; u0 += PD_LANES) {
                    vl half[SCORE_HEADS][2];
                    for (int64_t hf = 0; hf < 2; hf++) {
                        vl a[SCORE_HEADS][8];
                        for (int64_t g = 0; g < ng; g++)
                            for (int64_t i = 0; i < 8; i++) a[g][i] = (vl){0};
                        for (int64_t c = 0; c < chunks; c++)
                            for (int64_t i = 0; i < 8; i++) {
                                const int64_t j = 16 * c + 8 * hf + i;
                                vl kt;
                                memcpy(&kt, KT + j * 16 + u0, sizeof kt);
                                IN_REGISTER(kt);
                                for (int64_t g = 0; g < ng; g++) a[g][i] += q0[(g0 + g) * D + j] * kt;
                            }
                        for (int64_t g = 0; g < ng; g++)
                            half[g][hf] = ((a[g][0] + a[g][1]) + (a[g][2] + a[g][3])) +
                                          ((a[g][4] + a[g][5]) + (a[g][6] + a[g][7]));
                    }
                    /* all PD_LANES lanes stored: a row's scores past its length lie inside its sstride (a
                     * multiple of 16) and are never read */
                    for (int64_t g = 0; g < ng; g++) {
                        const vl res = (half[g][0] + half[g][1]) * scale;
                        memcpy(S + (r * group + g0 + g) * sstride + l0 + u0, &res, sizeof res);
                    }
                }
            }
#endif
        }
    }
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t g = 0; g < group; g++) {
            sums[r * group + g] = softmax_numerators(S + (r * group + g) * sstride, pos0 + r + 1);
            for (int64_t d = 0; d < D; d++) O[(r * group + g) * D + d] = 0.0f;
        }
    const int64_t vo = v_offset + h * D;
    float *restrict VT = KT; /* the tile's values as fp32, VT[t][d] (KT's room: the keys are done) */
    for (int64_t l0 = 0; l0 < last_len; l0 += 16) {
        for (int64_t t = 0; t < 16 && l0 + 16 + t < last_len; t++)
            __builtin_prefetch((const char *)cache + (offs[l0 + 16 + t] + vo) * esize);
        /* each V row widened (exactly) once per tile rather than once per (row, query head) that reads it */
        const int64_t nt = last_len - l0 < 16 ? last_len - l0 : 16;
        for (int64_t t = 0; t < nt; t++)
            for (int64_t c = 0; c < D / PD_LANES; c++) {
                const vl v = loadl(cache, offs[l0 + t] + vo + PD_LANES * c, cache_bf16);
                memcpy(VT + t * D + PD_LANES * c, &v, sizeof v);
            }
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t len = pos0 + r + 1;
            const int64_t n = len - l0 < 16 ? len - l0 : 16;
            if (n <= 0) continue;
            for (int64_t g0 = 0; g0 < group; g0 += VALUE_HEADS) {
                /* decode's values_tile per element (lane-wise: vectors of PD_LANES, so a 256-bit build
                 * broadcasts p[t] with one instruction); each V vector loaded serves VALUE_HEADS query heads,
                 * every accumulator still taking the tile's positions in order */
                const int64_t ng = group - g0 < VALUE_HEADS ? group - g0 : VALUE_HEADS;
                const int64_t parts = D / PD_LANES;
                vl acc[VALUE_HEADS][128 / PD_LANES];
                for (int64_t g = 0; g < ng; g++)
                    for (int64_t c = 0; c < parts; c++)
                        acc[g][c] = *(const vl_any *)(O + (r * group + g0 + g) * D + PD_LANES * c);
                const float *p = S + (r * group + g0) * sstride + l0;
                for (int64_t t = 0; t < n; t++)
                    for (int64_t c = 0; c < parts; c++) {
                        vl v;
                        memcpy(&v, VT + t * D + PD_LANES * c, sizeof v);
                        IN_REGISTER(v);
                        for (int64_t g = 0; g < ng; g++) acc[g][c] += p[g * sstride + t] * v;
                    }
                for (int64_t g = 0; g < ng; g++)
                    for (int64_t c = 0; c < parts; c++)
                        *(vl_any *)(O + (r * group + g0 + g) * D + PD_LANES * c) = acc[g][c];
            }
        }
    }
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t g = 0; g < group; g++) {
            const float inv = 1.0f / sums[r * group + g];
            const float *o = O + (r * group + g) * D;
            float *dst = out + ((row0 + r) * H + h * group + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
        }
}

/* scratch floats per thread: the row tile's scores, sums and accumulators */
static int64_t prefill_thread_floats(int64_t group, int64_t D, int64_t seq_len) {
    return ROWS * group * ((seq_len + 15) / 16 * 16) + ROWS * group + ROWS * group * D + 16 * D + 16;
}

/* Prefill attention of L rows of one sequence at positions start .. start + L - 1 (see above).
 * q: [L][H][D] (bf16 when q_bf16, else fp32); table: the sequence's block ids, table_len of them, covering
 * positions 0 .. start + L - 1; out: fp32 [L][H][D]; scratch: at least
 * paged_prefill_scratch_floats(L, H, KVH, D, start + L, threads) floats; threads >= 1 (OpenMP).
 * Returns 0; -1 when an argument is out of range (a shape, start, a block id, a table too short), checked
 * before anything is read or written. */
int64_t paged_prefill_scratch_floats(int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t seq_len, int64_t threads) {
    if (L <= 0 || H <= 0 || KVH <= 0 || H % KVH || D <= 0 || seq_len <= 0 || threads <= 0) return -1;
    return (L * H * D + 1) / 2 * 2 + 2 * seq_len + threads * prefill_thread_floats(H / KVH, D, seq_len);
}

int paged_prefill_attention(const void *q, int q_bf16, const void *cache, int cache_bf16, const int32_t *table,
                            int64_t table_len, int64_t start, int64_t L, int64_t H, int64_t KVH, int64_t D,
                            int64_t block_size, int64_t num_blocks, float scale, float *out, float *scratch,
                            int64_t scratch_floats, int threads) {
    if (start < 0 || L <= 0 || H <= 0 || KVH <= 0 || H % KVH || D <= 0 || block_size <= 0 || num_blocks <= 0 ||
        threads <= 0)
        return -1;
    const int64_t seq_len = start + L;
    if (scratch_floats < paged_prefill_scratch_floats(L, H, KVH, D, seq_len, threads)) return -1;
    for (int64_t t = 0; t * block_size < seq_len; t++)
        if (t >= table_len || table[t] < 0 || table[t] >= num_blocks) return -1;
    const int64_t group = H / KVH;
    const int64_t pos_elems = KVH * D;
    const int64_t block_elems = block_size * pos_elems;
    const int64_t v_offset = num_blocks * block_elems;
    float *qf = scratch;                             /* [L][H][D] */
    int64_t *offs = (int64_t *)(qf + (L * H * D + 1) / 2 * 2); /* [seq_len]: 8-byte aligned when scratch is */
    float *per_thread = (float *)(offs + seq_len);
    const int64_t tf = prefill_thread_floats(group, D, seq_len);
    const int64_t sstride = (seq_len + 15) / 16 * 16;
    for (int64_t i = 0; i < L * H * D; i++) qf[i] = load1(q, i, q_bf16);
    for (int64_t l = 0; l < seq_len; l++) offs[l] = position(table, l, block_size, block_elems, pos_elems, 0, D);
    const int vec = D % 16 == 0 && D <= 128 && group <= MAX_GROUP && KVH <= 64;
    if (!vec) { /* the decode kernel's scalar loops, row by row (its own bits) */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t w = 0; w < L * KVH; w++) {
            const int64_t r = L - 1 - w / KVH, h = w % KVH;
            float *S = per_thread + omp_get_thread_num() * tf;
            attend_any(qf + (r * H + h * group) * D, cache, cache_bf16, table, start + r + 1, group, D, block_size,
                       block_elems, pos_elems, v_offset, h, scale, S, out + (r * H + h * group) * D);
        }
        return 0;
    }
    const int64_t tiles = (L + ROWS - 1) / ROWS;
#define PREFILL(G, DD)                                                                                        \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)") for (int64_t w = 0; w < tiles * KVH; \
                                                                               w++) {                         \
        const int64_t tile = tiles - 1 - w / KVH, h = w % KVH; /* longest rows first */                       \
        const int64_t row0 = tile * ROWS, nrows = L - row0 < ROWS ? L - row0 : ROWS;                          \
        float *S = per_thread + omp_get_thread_num() * tf;                                                    \
        prefill_tile(qf, H, row0, nrows, start + row0, cache, cache_bf16, offs, h, G, DD, v_offset, scale, S, \
                     sstride, S + ROWS * (G) * sstride, S + ROWS * (G) * (sstride + 1),                       \
                     S + ROWS * (G) * (sstride + 1 + (DD)), out);                                             \
    }
#if defined(PD_GROUP) && defined(PD_HEAD_DIM)
    if (group == PD_GROUP && D == PD_HEAD_DIM) {
        PREFILL(PD_GROUP, PD_HEAD_DIM);
    } else
#endif
    {
        PREFILL(group, D);
    }
#undef PREFILL
    return 0;
}

#if defined(PD_AMX) || defined(PD_BF16DOT)
/* ---------------------------------------------------------------------------------------------------------------
 * One call's K and V of a bf16 cache laid out as bf16 pairs, the B operands of TDPBF16PS (the amx build) and of
 * VDPBF16PS (the bf16 build): built once per call for every KV head, shared by every row tile. D a multiple of 32.
 *   KB[h][16-position tile][D / 32 chunk c][16 rows r][16 positions t]: 32-bit words; word (r, t) holds the pair
 *     of dims 32 c + 2 r, + 1 of position t (the even dim in the low half);
 *   VB[h][32-position chunk p][D / 16 dim block][16 rows r][16 dims d]: 32-bit words; word (r, d) holds the pair
 *     of positions 32 p + 2 r, + 1 of dim d (the even position in the low half).
 * Zero past the sequence; every other word is the cache's bits moved. */
INLINE int64_t pair_kb_elems(int64_t seq_len, int64_t D) { return (seq_len + 31) / 32 * 32 * D; }
INLINE int64_t pair_vb_elems(int64_t seq_len, int64_t D) { return (seq_len + 31) / 32 * 32 * D; }

/* KB and VB of KV head h (bf16 elements from KB, VB: this head's part), 32 positions from l0. offs[l]: position
 * l's K offset in the cache. */
static void pair_relayout(const uint16_t *cache, const int64_t *offs, int64_t seq_len, int64_t h, int64_t D,
                          int64_t v_offset, int64_t l0, uint16_t *KB, uint16_t *VB) {
    for (int64_t t0 = l0; t0 < l0 + 32; t0 += 16) {
        uint16_t *kb = KB + t0 * D; /* tile t0 / 16: D / 32 chunks of 16 x 32 */
        for (int64_t c = 0; c < D / 32; c++) {
            v16 kv[16]; /* kv[t] = the 16 dim pairs (as 32-bit words) of position t0 + t, chunk c */
            for (int64_t t = 0; t < 16; t++) {
                if (t0 + t < seq_len)
                    memcpy(&kv[t], cache + offs[t0 + t] + h * D + 32 * c, sizeof kv[t]);
                else
                    kv[t] = (v16){0};
            }
            transpose16(kv); /* kv[r] lane t = pair r of position t: B row r (exact moves) */
            memcpy(kb + c * 512, kv, sizeof kv);
        }
    }
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    uint16_t *vb = VB + l0 * D; /* chunk l0 / 32: D / 16 dim blocks of 16 x 32 */
    for (int64_t r = 0; r < 16; r++) {
        const int64_t la = l0 + 2 * r, lb = la + 1;
        for (int64_t db = 0; db < D / 16; db++) {
            const __m256i a = la < seq_len
                                  ? _mm256_loadu_si256((const __m256i *)(cache + v_offset + offs[la] + h * D + 16 * db))
                                  : _mm256_setzero_si256();
            const __m256i b = lb < seq_len
                                  ? _mm256_loadu_si256((const __m256i *)(cache + v_offset + offs[lb] + h * D + 16 * db))
                                  : _mm256_setzero_si256();
            const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
            _mm512_storeu_si512(vb + db * 512 + r * 32, _mm512_permutexvar_epi16(inter, ab));
        }
    }
}
#endif

#ifdef PD_AMX
/* ---------------------------------------------------------------------------------------------------------------
 * Prefill attention on AMX tiles (the "amx" build: -DPD_AMX with AVX512-BF16 and AMX; engine.native_decode's
 * NativeDecodeKernel.prefill on that build). Same arguments and result as paged_prefill_attention, a bf16 cache
 * and D == 64 only; not the decode kernel's arithmetic, but each row's result is still one fixed function of
 * its own query and positions 0 .. its own, whatever row tile, chunk, offset or thread computes it:
 *   - scores: the fp32 query split into two bf16 parts (hi = RNE(q), lo = RNE(q - hi): ~16 bits of q kept)
 *     against the bf16 keys, C = 0, then TDPBF16PS with hi and lo of dims 0-31, then of dims 32-63, in that
 *     order; each score is computed from its own query row and key column only (Intel SDM, TDPBF16PS);
 *   - times the scale, then softmax_numerators over exactly the row's own positions (decode's function);
 *   - values: each numerator split the same way (exact zeros past the row's own positions), C = 0, then per
 *     32-position chunk in order TDPBF16PS with hi then lo against the bf16 values. A row tile takes chunks up
 *     to its last row's length; a row's chunks past its own length add products of exact zeros (C + 0 = C), so
 *     its sums do not depend on the tile;
 *   - times 1 / sum.
 * Layouts in scratch: pair_relayout's KB and VB (D = 64), each 16 x 32 block of them a B tile. */
#define AMX_ROWS 16
#define AMX_D 64

#include "amx_tiles.h"

/* 16 floats (lanes past n: 0) -> bf16 hi = RNE(x) and lo = RNE(x - hi) (x - hi is exact) */
INLINE void split16(const float *x, int64_t n, uint16_t *hi, uint16_t *lo) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(m, x);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf));
    _mm256_storeu_si256((__m256i *)hi, h);
    _mm256_storeu_si256((__m256i *)lo, l);
}

/* One row tile (rows row0 .. row0 + nrows - 1 at positions pos0 ..) and KV head h, query head by query head.
 * S: AMX_ROWS x sstride floats; QA: 4 A tiles (hi / lo of dims 0-31, 32-63); PA: 2 A tiles per 32-position
 * chunk; O: AMX_ROWS x AMX_D floats; sums: AMX_ROWS. */
static void amx_prefill_tile(const float *restrict qf, int64_t H, int64_t row0, int64_t nrows, int64_t pos0,
                             int64_t h, int64_t group, const uint16_t *KB, const uint16_t *VB, float scale,
                             float *restrict S, int64_t sstride, uint16_t *restrict QA, uint16_t *restrict PA,
                             float *restrict O, float *restrict sums, float *restrict out) {
    const int64_t last_len = pos0 + nrows;
    const int64_t ptiles = (last_len + 15) / 16, pchunks = (last_len + 31) / 32;
    for (int64_t g = 0; g < group; g++) {
        /* QA: [c][hi, lo][16 rows][32] */
        for (int64_t r = 0; r < AMX_ROWS; r++) {
            const float *q = qf + ((row0 + r) * H + h * group + g) * AMX_D;
            for (int64_t c = 0; c < 2; c++)
                for (int64_t half = 0; half < 2; half++) {
                    uint16_t *hi = QA + (c * 2 + 0) * 512 + r * 32 + 16 * half;
                    uint16_t *lo = QA + (c * 2 + 1) * 512 + r * 32 + 16 * half;
                    split16(q + 32 * c + 16 * half, r < nrows ? 16 : 0, hi, lo);
                }
        }
        _tile_loadd(1, QA, 64);
        _tile_loadd(2, QA + 512, 64);
        _tile_loadd(3, QA + 1024, 64);
        _tile_loadd(4, QA + 1536, 64);
        for (int64_t pt = 0; pt < ptiles; pt++) {
            const uint16_t *kb = KB + pt * 16 * AMX_D;
            _tile_zero(0);
            _tile_loadd(5, kb, 64);
            _tile_loadd(6, kb + 512, 64);
            _tile_dpbf16ps(0, 1, 5);
            _tile_dpbf16ps(0, 2, 5);
            _tile_dpbf16ps(0, 3, 6);
            _tile_dpbf16ps(0, 4, 6);
            _tile_stored(0, S + pt * 16, sstride * 4);
        }
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t len = pos0 + r + 1;
            float *s = S + r * sstride;
            for (int64_t l0 = 0; l0 < len; l0 += 16) {
                const __mmask16 m = len - l0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - l0)) - 1u);
                _mm512_mask_storeu_ps(s + l0, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + l0), _mm512_set1_ps(scale)));
            }
            sums[r] = softmax_numerators(s, len);
        }
        /* PA: [chunk][hi, lo][16 rows][32], exact zeros past each row's length and for rows past nrows */
        for (int64_t p = 0; p < pchunks; p++)
            for (int64_t r = 0; r < AMX_ROWS; r++) {
                const int64_t len = r < nrows ? pos0 + r + 1 : 0;
                for (int64_t half = 0; half < 2; half++) {
                    const int64_t l0 = 32 * p + 16 * half;
                    const int64_t n = len - l0 < 0 ? 0 : len - l0;
                    split16(S + r * sstride + l0, n, PA + (p * 2 + 0) * 512 + r * 32 + 16 * half,
                            PA + (p * 2 + 1) * 512 + r * 32 + 16 * half);
                }
            }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t p = 0; p < pchunks; p++) {
            const uint16_t *vb = VB + p * 32 * AMX_D;
            _tile_loadd(4, PA + p * 1024, 64);
            _tile_loadd(5, PA + p * 1024 + 512, 64);
            _tile_loadd(6, vb, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(0, 5, 6);
            _tile_loadd(7, vb + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(1, 5, 7);
            _tile_loadd(6, vb + 1024, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            _tile_loadd(7, vb + 1536, 64);
            _tile_dpbf16ps(3, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, O, AMX_D * 4);
        _tile_stored(1, O + 16, AMX_D * 4);
        _tile_stored(2, O + 32, AMX_D * 4);
        _tile_stored(3, O + 48, AMX_D * 4);
        for (int64_t r = 0; r < nrows; r++) {
            const float inv = 1.0f / sums[r];
            float *dst = out + ((row0 + r) * H + h * group + g) * AMX_D;
            for (int64_t d = 0; d < AMX_D; d++) dst[d] = O[r * AMX_D + d] * inv;
        }
    }
}

/* floats of one thread's part of the scratch (16-float aligned pieces) */
static int64_t amx_thread_floats(int64_t seq_len) {
    const int64_t sstride = (seq_len + 31) / 32 * 32, pchunks = (seq_len + 31) / 32;
    return AMX_ROWS * sstride + 2 * 512 + pchunks * 512 + AMX_ROWS * AMX_D + 16;
}

int64_t paged_prefill_amx_scratch_floats(int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t seq_len,
                                         int64_t threads) {
    if (L <= 0 || H <= 0 || KVH <= 0 || H % KVH || D != AMX_D || seq_len <= 0 || threads <= 0) return -1;
    return (L * H * D + 15) / 16 * 16 + (seq_len + 7) / 8 * 16 + KVH * (pair_kb_elems(seq_len, AMX_D) + pair_vb_elems(seq_len, AMX_D)) / 2 +
           threads * amx_thread_floats(seq_len);
}

/* As paged_prefill_attention (same arguments and output), on AMX: cache_bf16 and D == 64 only (-1 otherwise,
 * before anything is read or written). */
int paged_prefill_attention_amx(const void *q, int q_bf16, const void *cache, int cache_bf16, const int32_t *table,
                                int64_t table_len, int64_t start, int64_t L, int64_t H, int64_t KVH, int64_t D,
                                int64_t block_size, int64_t num_blocks, float scale, float *out, float *scratch,
                                int64_t scratch_floats, int threads) {
    if (start < 0 || L <= 0 || H <= 0 || KVH <= 0 || H % KVH || D != AMX_D || !cache_bf16 || block_size <= 0 ||
        num_blocks <= 0 || threads <= 0)
        return -1;
    const int64_t seq_len = start + L;
    if (scratch_floats < paged_prefill_amx_scratch_floats(L, H, KVH, D, seq_len, threads)) return -1;
    for (int64_t t = 0; t * block_size < seq_len; t++)
        if (t >= table_len || table[t] < 0 || table[t] >= num_blocks) return -1;
    const int64_t group = H / KVH, pos_elems = KVH * D, block_elems = block_size * pos_elems;
    const int64_t v_offset = num_blocks * block_elems;
    float *qw = scratch; /* bf16 queries widened, [L][H][D] (fp32 ones are read in place) */
    int64_t *offs = (int64_t *)(qw + (L * H * D + 15) / 16 * 16);
    uint16_t *KB = (uint16_t *)(offs + (seq_len + 7) / 8 * 8);
    uint16_t *VB = KB + KVH * pair_kb_elems(seq_len, AMX_D);
    float *per_thread = (float *)(VB + KVH * pair_vb_elems(seq_len, AMX_D));
    const int64_t tf = amx_thread_floats(seq_len), sstride = (seq_len + 31) / 32 * 32;
    const int64_t tiles = (L + AMX_ROWS - 1) / AMX_ROWS, chunks = (seq_len + 31) / 32;
    if (q_bf16)
        for (int64_t i = 0; i < L * H * D; i++) qw[i] = load1(q, i, 1);
    const float *qf = q_bf16 ? qw : (const float *)q;
    for (int64_t l = 0; l < seq_len; l++) offs[l] = position(table, l, block_size, block_elems, pos_elems, 0, D);
#pragma omp parallel num_threads(threads)
    {
        amx_load_tiles_16x64();
#pragma omp for schedule(static)
        for (int64_t w = 0; w < KVH * chunks; w++)
            pair_relayout((const uint16_t *)cache, offs, seq_len, w / chunks, AMX_D, v_offset, 32 * (w % chunks),
                         KB + (w / chunks) * pair_kb_elems(seq_len, AMX_D), VB + (w / chunks) * pair_vb_elems(seq_len, AMX_D));
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < tiles * KVH; w++) {
            const int64_t tile = tiles - 1 - w / KVH, h = w % KVH; /* longest rows first */
            const int64_t row0 = tile * AMX_ROWS, nrows = L - row0 < AMX_ROWS ? L - row0 : AMX_ROWS;
            float *S = per_thread + omp_get_thread_num() * tf;
            uint16_t *QA = (uint16_t *)(S + AMX_ROWS * sstride);
            uint16_t *PA = QA + 2048;
            float *O = (float *)(PA + chunks * 1024);
            amx_prefill_tile(qf, H, row0, nrows, start + row0, h, group, KB + h * pair_kb_elems(seq_len, AMX_D),
                             VB + h * pair_vb_elems(seq_len, AMX_D), scale, S, sstride, QA, PA, O, O + AMX_ROWS * AMX_D, out);
        }
        _tile_release();
    }
    return 0;
}
#endif

#ifdef PD_BF16DOT
/* ---------------------------------------------------------------------------------------------------------------
 * Prefill attention on AVX512-BF16 dot products (the "avx512-bf16" build: -DPD_BF16DOT with AVX512-BF16;
 * engine.native_decode's NativeDecodeKernel.prefill on that build). Same arguments and result as
 * paged_prefill_attention, for a bf16 cache, D a multiple of 32 up to 128 and group up to MAX_GROUP; not the
 * decode kernel's arithmetic, but each row's result is still one fixed function of its own query and positions
 * 0 .. its own, whatever row tile, chunk, offset or thread computes it:
 *   - the query rounded to bf16 (RNE, VCVTNE2PS2BF16; a bf16 query is taken as it is);
 *   - scores: per position, VDPBF16PS over the dim pairs 0, 1, .. D / 2 - 1 in order from +0 (each step adds
 *     two exact products of bf16 values to the fp32 sum; Intel SDM, VDPBF16PS), then times the scale;
 *   - numerators: e^(s - max s) as softmax_numerators computes them (exp16), each rounded to bf16 (RNE), their
 *     sum taken over the rounded values (lane t sums positions t mod 16 in order, then lanes 0..15);
 *   - values: per dim, VDPBF16PS over the position pairs (0, 1), (2, 3), .. in order from +0, up to the pair
 *     that holds the row's last position (its numerator past that position is zero and its value masked to
 *     +0, so nothing past the row is read into the sum);
 *   - times 1 / sum.
 * VDPBF16PS does twice the multiply-adds of an fp32 FMA per instruction (one 512-bit instruction a cycle on a
 * Zen 4, each), so the scores and values take half the instructions of paged_prefill_attention's; the price is
 * ~8 bits of the query and of each numerator (docs/engine-step.md, session 29: top-1 agreement measured).
 * K and V come from pair_relayout's KB and VB. Two rows run together in the scores (six independent sums per K
 * vector loaded, VDPBF16PS's latency covered) and a row's query heads together in the values; neither changes
 * the operations of any sum. */
#define BD_ROWS 16 /* query rows per work item */
#define BD_HEADS 3 /* query heads whose sums share each K (V) vector loaded */

INLINE __m512 bd_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* the query at q[index .. index + D) as D / 2 bf16 pairs (RNE from fp32; bf16 queries copied) */
INLINE void bd_query_pairs(const void *q, int q_bf16, int64_t index, int64_t D, uint32_t *restrict out) {
    if (q_bf16) {
        memcpy(out, (const uint16_t *)q + index, (size_t)D * 2);
        return;
    }
    const float *x = (const float *)q + index;
    for (int64_t c = 0; c < D; c += 32) /* the second operand fills the low 16 elements (Intel SDM, VCVTNE2PS2BF16) */
        _mm512_storeu_si512(out + c / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c)));
}

/* s[0 .. len) -> p[0 .. len): bf16 of e^(s - max s) (RNE), p zero from len to the next multiple of 16; returns the
 * sum of the rounded numerators (module comment) */
INLINE float bd_numerators(const float *restrict s, int64_t len, uint16_t *restrict p) {
    const int64_t full = len / 16 * 16;
    float m = s[0];
    if (full) m = max_of(s, full, m);
    for (int64_t l = full; l < len; l++) m = s[l] > m ? s[l] : m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t l0 = 0; l0 < full; l0 += 16) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(as_m512(exp16(as_v16(_mm512_sub_ps(_mm512_loadu_ps(s + l0), mv)))));
        _mm256_storeu_si256((__m256i *)(p + l0), h);
        acc = _mm512_add_ps(acc, bd_widen(h));
    }
    if (full < len) {
        const __mmask16 k = (__mmask16)((1u << (len - full)) - 1u);
        const v16 e = exp16(as_v16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + full), mv)));
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(k, as_m512(e))); /* lanes past len: +0 */
        _mm256_storeu_si256((__m256i *)(p + full), h);
        acc = _mm512_add_ps(acc, bd_widen(h));
    }
    float lanes[16], sum = 0.0f;
    _mm512_storeu_ps(lanes, acc);
    for (int t = 0; t < 16; t++) sum += lanes[t];
    return sum;
}

/* scores of NR rows (1 or 2) and query heads g0 .. g0 + NG - 1 of KV head h over position tiles 0 .. tiles - 1:
 * S[(x group + g) sstride + l] = scale * (row x's query head g . key l). qp: [NR][group][D / 2] query pairs; kb:
 * this head's KB. */
INLINE void bd_scores(const uint32_t *restrict qp, int64_t NR, int64_t group, int64_t g0, int64_t NG,
                      const uint16_t *restrict kb, int64_t D, int64_t tiles, float scale, float *restrict S,
                      int64_t sstride) {
    for (int64_t pt = 0; pt < tiles; pt++) {
        __m512 acc[2][BD_HEADS];
        for (int64_t x = 0; x < NR; x++)
            for (int64_t g = 0; g < NG; g++) acc[x][g] = _mm512_setzero_ps();
        const uint16_t *kt = kb + pt * 16 * D;
        for (int64_t i = 0; i < D / 2; i++) {
            __m512i k = _mm512_loadu_si512(kt + (i / 16) * 512 + (i % 16) * 32);
            IN_REGISTER(k);
            for (int64_t x = 0; x < NR; x++)
                for (int64_t g = 0; g < NG; g++)
                    acc[x][g] = _mm512_dpbf16_ps(acc[x][g], (__m512bh)k,
                                                 (__m512bh)_mm512_set1_epi32((int)qp[(x * group + g0 + g) * (D / 2) + i]));
        }
        for (int64_t x = 0; x < NR; x++)
            for (int64_t g = 0; g < NG; g++)
                _mm512_storeu_ps(S + (x * group + g0 + g) * sstride + pt * 16,
                                 _mm512_mul_ps(acc[x][g], _mm512_set1_ps(scale)));
    }
}

/* acc[g][db] += the pair m of positions' numerators of query head g0 + g times their values, dims 16 db ..: one
 * VDPBF16PS per (g, db); keep: the bits of each 32-bit value word kept (all, or the low half: the even position) */
INLINE void bd_value_pair(__m512 acc[BD_HEADS][128 / 16], const uint16_t *restrict p, int64_t sstride, int64_t g0,
                          int64_t NG, const uint16_t *restrict vb, int64_t D, int64_t m, __m512i keep) {
    const uint16_t *vm = vb + (m / 16) * 32 * D + (m % 16) * 32;
    for (int64_t db = 0; db < D / 16; db++) {
        __m512i v = _mm512_and_si512(_mm512_loadu_si512(vm + db * 512), keep);
        IN_REGISTER(v);
        for (int64_t g = 0; g < NG; g++) {
            uint32_t w;
            memcpy(&w, p + (g0 + g) * sstride + 2 * m, sizeof w);
            acc[g][db] = _mm512_dpbf16_ps(acc[g][db], (__m512bh)v, (__m512bh)_mm512_set1_epi32((int)w));
        }
    }
}

/* one row's output for query heads g0 .. g0 + NG - 1: p: this row's numerators, [group][sstride] bf16; vb: this
 * head's VB; len: the row's positions; sums: the numerators' sums per query head; dst: the row's out at head
 * h group. Pairs (2 m, 2 m + 1) in order; where len is odd the last pair's second position is past the row: its
 * numerator is zero and its value masked to +0, so nothing past the row (a later row's V, even an infinite one)
 * reaches the sum. */
INLINE void bd_values(const uint16_t *restrict p, int64_t sstride, int64_t g0, int64_t NG, const uint16_t *restrict vb,
                      int64_t D, int64_t len, const float *restrict sums, float *restrict dst) {
    __m512 acc[BD_HEADS][128 / 16];
    for (int64_t g = 0; g < NG; g++)
        for (int64_t db = 0; db < D / 16; db++) acc[g][db] = _mm512_setzero_ps();
    const __m512i all = _mm512_set1_epi32(-1);
    for (int64_t m = 0; m < len / 2; m++) bd_value_pair(acc, p, sstride, g0, NG, vb, D, m, all);
    if (len & 1) bd_value_pair(acc, p, sstride, g0, NG, vb, D, len / 2, _mm512_set1_epi32(0xffff));
    for (int64_t g = 0; g < NG; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[g0 + g]);
        for (int64_t db = 0; db < D / 16; db++)
            _mm512_storeu_ps(dst + (g0 + g) * D + 16 * db, _mm512_mul_ps(acc[g][db], inv));
    }
}

/* One work item: rows row0 .. row0 + nrows - 1 (positions pos0 ..) and KV head h, two rows at a time. S: [2][group]
 * [sstride] fp32; P: [group][sstride] bf16; QP: [2][group][D / 2] pairs; sums: [group]. */
INLINE void bd_prefill_rows(const void *q, int q_bf16, int64_t H, int64_t row0, int64_t nrows, int64_t pos0,
                            int64_t h, int64_t group, int64_t D, const uint16_t *KB, const uint16_t *VB, float scale,
                            float *restrict S, int64_t sstride, uint16_t *restrict P, uint32_t *restrict QP,
                            float *restrict sums, float *restrict out) {
    for (int64_t r = 0; r < nrows; r += 2) {
        const int64_t nr = nrows - r >= 2 ? 2 : 1;
        for (int64_t x = 0; x < nr; x++)
            for (int64_t g = 0; g < group; g++)
                bd_query_pairs(q, q_bf16, ((row0 + r + x) * H + h * group + g) * D, D, QP + (x * group + g) * (D / 2));
        const int64_t tiles = (pos0 + r + nr + 15) / 16;
        for (int64_t g0 = 0; g0 < group; g0 += BD_HEADS) {
            const int64_t ng = group - g0 < BD_HEADS ? group - g0 : BD_HEADS;
            if (nr == 2 && ng == BD_HEADS)
                bd_scores(QP, 2, group, g0, BD_HEADS, KB, D, tiles, scale, S, sstride);
            else if (nr == 2)
                bd_scores(QP, 2, group, g0, ng, KB, D, tiles, scale, S, sstride);
            else
                bd_scores(QP, 1, group, g0, ng, KB, D, tiles, scale, S, sstride);
        }
        for (int64_t x = 0; x < nr; x++) {
            const int64_t len = pos0 + r + x + 1;
            for (int64_t g = 0; g < group; g++)
                sums[g] = bd_numerators(S + (x * group + g) * sstride, len, P + g * sstride);
            float *dst = out + ((row0 + r + x) * H + h * group) * D;
            for (int64_t g0 = 0; g0 < group; g0 += BD_HEADS) {
                const int64_t ng = group - g0 < BD_HEADS ? group - g0 : BD_HEADS;
                if (ng == BD_HEADS)
                    bd_values(P, sstride, g0, BD_HEADS, VB, D, len, sums, dst);
                else
                    bd_values(P, sstride, g0, ng, VB, D, len, sums, dst);
            }
        }
    }
}

/* floats of one thread's part of the scratch (a multiple of 16) */
static int64_t bd_thread_floats(int64_t group, int64_t D, int64_t seq_len) {
    const int64_t sstride = (seq_len + 31) / 32 * 32;
    return 2 * group * sstride + group * sstride / 2 + group * D + (group + 15) / 16 * 16;
}

int64_t paged_prefill_bf16_scratch_floats(int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t seq_len,
                                          int64_t threads) {
    if (L <= 0 || H <= 0 || KVH <= 0 || H % KVH || H / KVH > MAX_GROUP || D <= 0 || D % 32 || D > 128 ||
        seq_len <= 0 || threads <= 0)
        return -1;
    return (seq_len + 7) / 8 * 16 + KVH * (pair_kb_elems(seq_len, D) + pair_vb_elems(seq_len, D)) / 2 +
           threads * bd_thread_floats(H / KVH, D, seq_len);
}

/* As paged_prefill_attention (same arguments and output), on VDPBF16PS: a bf16 cache, D a multiple of 32 up to 128
 * and H / KVH up to MAX_GROUP only (-1 otherwise, before anything is read or written). */
int paged_prefill_attention_bf16(const void *q, int q_bf16, const void *cache, int cache_bf16, const int32_t *table,
                                 int64_t table_len, int64_t start, int64_t L, int64_t H, int64_t KVH, int64_t D,
                                 int64_t block_size, int64_t num_blocks, float scale, float *out, float *scratch,
                                 int64_t scratch_floats, int threads) {
    if (start < 0 || L <= 0 || H <= 0 || KVH <= 0 || H % KVH || !cache_bf16 || block_size <= 0 || num_blocks <= 0 ||
        threads <= 0)
        return -1;
    const int64_t seq_len = start + L;
    const int64_t need = paged_prefill_bf16_scratch_floats(L, H, KVH, D, seq_len, threads);
    if (need < 0 || scratch_floats < need) return -1;
    for (int64_t t = 0; t * block_size < seq_len; t++)
        if (t >= table_len || table[t] < 0 || table[t] >= num_blocks) return -1;
    const int64_t group = H / KVH, pos_elems = KVH * D, block_elems = block_size * pos_elems;
    const int64_t v_offset = num_blocks * block_elems;
    int64_t *offs = (int64_t *)scratch;
    uint16_t *KB = (uint16_t *)(offs + (seq_len + 7) / 8 * 8);
    uint16_t *VB = KB + KVH * pair_kb_elems(seq_len, D);
    float *per_thread = (float *)(VB + KVH * pair_vb_elems(seq_len, D));
    const int64_t tf = bd_thread_floats(group, D, seq_len), sstride = (seq_len + 31) / 32 * 32;
    const int64_t tiles = (L + BD_ROWS - 1) / BD_ROWS, chunks = (seq_len + 31) / 32;
    for (int64_t l = 0; l < seq_len; l++) offs[l] = position(table, l, block_size, block_elems, pos_elems, 0, D);
#define BD_PREFILL(G, DD)                                                                                           \
    _Pragma("omp parallel num_threads(threads)") {                                                                  \
        _Pragma("omp for schedule(static)") for (int64_t w = 0; w < KVH * chunks; w++)                               \
            pair_relayout((const uint16_t *)cache, offs, seq_len, w / chunks, DD, v_offset, 32 * (w % chunks),       \
                          KB + (w / chunks) * pair_kb_elems(seq_len, DD), VB + (w / chunks) * pair_vb_elems(seq_len, DD)); \
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t w = 0; w < tiles * KVH; w++) {                          \
            const int64_t tile = tiles - 1 - w / KVH, h = w % KVH; /* longest rows first */                         \
            const int64_t row0 = tile * BD_ROWS, nrows = L - row0 < BD_ROWS ? L - row0 : BD_ROWS;                   \
            float *S = per_thread + omp_get_thread_num() * tf;                                                      \
            uint16_t *P = (uint16_t *)(S + 2 * (G) * sstride);                                                      \
            uint32_t *QP = (uint32_t *)(P + (G) * sstride);                                                         \
            float *sums = (float *)(QP + (G) * (DD));                                                               \
            bd_prefill_rows(q, q_bf16, H, row0, nrows, start + row0, h, G, DD, KB + h * pair_kb_elems(seq_len, DD),  \
                            VB + h * pair_vb_elems(seq_len, DD), scale, S, sstride, P, QP, sums, out);              \
        }                                                                                                           \
    }
#if defined(PD_GROUP) && defined(PD_HEAD_DIM)
    if (group == PD_GROUP && D == PD_HEAD_DIM) {
        BD_PREFILL(PD_GROUP, PD_HEAD_DIM);
    } else
#endif
    {
        BD_PREFILL(group, D);
    }
#undef BD_PREFILL
    return 0;
}
#endif

#ifdef PD_BF16DOT
/* ---------------------------------------------------------------------------------------------------------------
 * Decode attention on VDPBF16PS (the bf16 build's paged_decode_attention_bf16 / _threads; engine.decode_kernel:
 * avx512-bf16). Same arguments and output as paged_decode_attention, a bf16 cache, D a multiple of 32 up to 128,
 * group up to MAX_GROUP. Each sequence's result is exactly what paged_prefill_attention_bf16 computes for a prompt
 * row at position lens[b] - 1 (that kernel's arithmetic, above: the query and numerators rounded to bf16, scores
 * per position over the dim pairs in order, values per dim over the position pairs in order), so a token's K/V
 * and logits are the same bits whether its position came as a prompt row or a generated one, and batched ==
 * alone. Instead of pair_relayout's whole-sequence copy, each 16-position K tile is transposed in registers
 * (the same words as KB's tile) and each position pair's V vector is interleaved as it is used (the same words as
 * VB's): nothing is written but the scores. The blocks a run of sequences shares (shared_len) are transposed and
 * interleaved once for all of them, so each K tile and V pair vector loaded serves every query head of the run.
 *
 * Scratch, per sequence b at scratch + b * PD_SEQ_FLOATS(H, D, max_len): S [H][ss] fp32 scores, P [H][ss] bf16
 * numerators, QP [H][D / 2] query pairs, sums [H] (ss = max_len rounded up to 32). */
#define PD_SEQ_FLOATS(H, D, max_len) ((H) * (2 * ((max_len) + 31) + (D) + 1)) /* engine.native_decode.scratch_size */
#define BDD_SEQS 4 /* sequences of a run whose value sums share each V pair vector (4 x 3 heads x 2: 24 registers) */

/* the K tile of positions whose rows are at[0 .. n) (n <= 16; zero words past n), KV head h: kt[i] lane t = dim
 * pair i of position t (pair_relayout's KB tile: transpose16 of the rows' 32-dim chunks, exact moves) */
INLINE void bdd_k_tile(const uint16_t *cache, const int64_t at[16], int64_t n, int64_t h, int64_t D,
                       __m512i *restrict kt) {
    for (int64_t c = 0; c < D / 32; c++) {
        v16 kv[16];
        for (int64_t t = 0; t < 16; t++) {
            if (t < n)
                memcpy(&kv[t], cache + at[t] + h * D + 32 * c, sizeof kv[t]);
            else
                kv[t] = (v16){0};
        }
        transpose16(kv);
        memcpy(kt + 16 * c, kv, sizeof kv);
    }
}

/* the rows of positions l0 .. l0 + 15 below len (the table's blocks), `count` elements from `first` of each,
 * prefetched into L2 (prefetch_span): the K tiles PD_PF ahead, or the next V chunk */
INLINE void bdd_prefetch(const uint16_t *cache, const int32_t *table, int64_t len, int64_t l0, int64_t first,
                         int64_t count, int64_t block_size, int64_t block_elems, int64_t pos_elems) {
    if (l0 >= len) return;
    int64_t ahead[16];
    rows_from(table, l0, len - l0 < 16 ? len - l0 : 16, block_size, block_elems, pos_elems, first, -1, ahead);
    for (int64_t t = 0; t < 16; t++) prefetch_span(cache, 1, ahead[t], 0, count);
}

/* NJ (1 or 2) jobs at once, so 2 x NG sums are in flight (VDPBF16PS's latency covered): job j's K tile kt[j] and
 * the NG query heads whose pairs start at qp[j] (D / 2 words each); dst[j][g ss + t] = scale * (query head g . key
 * t of the tile): bd_scores' chain per position, VDPBF16PS over pairs 0 .. D / 2 - 1 from +0 */
INLINE void bdd_scores(int64_t NJ, const __m512i *const kt[2], const uint32_t *const qp[2], int64_t NG, int64_t D,
                       float scale, float *const dst[2], int64_t ss) {
    __m512 acc[2][MAX_GROUP];
    for (int64_t j = 0; j < NJ; j++)
        for (int64_t g = 0; g < NG; g++) acc[j][g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D / 2; i++)
        for (int64_t j = 0; j < NJ; j++) {
            __m512i k = kt[j][i];
            IN_REGISTER(k);
            for (int64_t g = 0; g < NG; g++)
                acc[j][g] = _mm512_dpbf16_ps(acc[j][g], (__m512bh)k,
                                             (__m512bh)_mm512_set1_epi32((int)qp[j][g * (D / 2) + i]));
        }
    for (int64_t j = 0; j < NJ; j++)
        for (int64_t g = 0; g < NG; g++) _mm512_storeu_ps(dst[j] + g * ss, _mm512_mul_ps(acc[j][g], _mm512_set1_ps(scale)));
}

/* tiles [t0, t1) of one sequence (its table, length len), every KV head: its scores, two tiles a call (rows found
 * once for the heads; every head's K rows PD_PF tiles ahead prefetched). qp: the sequence's query pairs [H][D / 2];
 * S: its scores [H][ss]. */
INLINE void bdd_seq_scores(const uint16_t *cache, const int32_t *table, int64_t len, int64_t t0, int64_t t1,
                           int64_t KVH, int64_t group, int64_t D, int64_t block_size, int64_t block_elems,
                           int64_t pos_elems, const uint32_t *qp, float scale, float *S, int64_t ss) {
    __m512i kt[2][128 / 2];
    for (int64_t t = t0; t < t1; t += 2) {
        const int64_t nj = t1 - t >= 2 ? 2 : 1;
        int64_t at[2][16], n[2];
        for (int64_t j = 0; j < nj; j++) {
            const int64_t l0 = 16 * (t + j);
            n[j] = len - l0 < 16 ? len - l0 : 16;
            rows_from(table, l0, n[j], block_size, block_elems, pos_elems, 0, 0, at[j]);
            bdd_prefetch(cache, table, len, l0 + 16 * PD_PF, 0, pos_elems, block_size, block_elems, pos_elems);
        }
        for (int64_t h = 0; h < KVH; h++) {
            for (int64_t j = 0; j < nj; j++) bdd_k_tile(cache, at[j], n[j], h, D, kt[j]);
            const __m512i *const kts[2] = {kt[0], kt[1]};
            const uint32_t *const qps[2] = {qp + h * group * (D / 2), qp + h * group * (D / 2)};
            float *const dst[2] = {S + h * group * ss + 16 * t, S + h * group * ss + 16 * (t + 1)};
            if (nj == 2)
                bdd_scores(2, kts, qps, group, D, scale, dst, ss);
            else
                bdd_scores(1, kts, qps, group, D, scale, dst, ss);
        }
    }
}

/* acc[x][g][j] += over position pairs m in [m0, m1): pair m's numerators of query head hg + g of sequence x (its
 * P at p[x], rows ss apart) times V's pair vector of dims 16 (db0 + j) .. + 15 (VB's words: the two positions of
 * each dim interleaved), one VDPBF16PS each, pairs in order: bd_value_pair's operations. Rows from `table`;
 * positions at or past len read as +0 (the last pair's second where len is odd, as VB holds it). */
INLINE void bdd_values(__m512 acc[BDD_SEQS][MAX_GROUP][2], int64_t NB, int64_t group, const uint16_t *const p[BDD_SEQS],
                       int64_t ss, int64_t hg, const uint16_t *cache, const int32_t *table, int64_t len, int64_t m0,
                       int64_t m1, int64_t h, int64_t D, int64_t db0, int64_t block_size, int64_t block_elems,
                       int64_t pos_elems, int64_t v_offset) {
    /* word d of a (position 2m, dims 32 j' ..) and b (position 2m + 1): vector j takes dims 16 j + d of each */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                        22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int64_t l0 = 2 * m0; l0 < 2 * m1; l0 += 32) {
        int64_t at[32];
        for (int64_t half = 0; half < 2; half++) {
            const int64_t from = l0 + 16 * half, n = len - from < 0 ? 0 : len - from > 16 ? 16 : len - from;
            rows_from(table, from, n, block_size, block_elems, pos_elems, v_offset + h * D + 16 * db0, -1,
                      at + 16 * half);
        }
        for (int64_t ahead = l0 + 32; ahead < l0 + 64; ahead += 16)
            bdd_prefetch(cache, table, 2 * m1, ahead, v_offset + h * D + 16 * db0, 32, block_size, block_elems,
                         pos_elems);
        const int64_t pairs = 2 * m1 - l0 < 32 ? (2 * m1 - l0) / 2 : 16;
        for (int64_t r = 0; r < pairs; r++) {
            const int64_t m = l0 / 2 + r;
            const __m512i a = at[2 * r] >= 0 ? _mm512_loadu_si512(cache + at[2 * r]) : _mm512_setzero_si512();
            const __m512i b = at[2 * r + 1] >= 0 ? _mm512_loadu_si512(cache + at[2 * r + 1]) : _mm512_setzero_si512();
            __m512i v0 = _mm512_permutex2var_epi16(a, lo, b), v1 = _mm512_permutex2var_epi16(a, hi, b);
            IN_REGISTER(v0);
            IN_REGISTER(v1);
            for (int64_t x = 0; x < NB; x++)
                for (int64_t g = 0; g < group; g++) {
                    uint32_t w;
                    memcpy(&w, p[x] + (hg + g) * ss + 2 * m, sizeof w);
                    const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w);
                    acc[x][g][0] = _mm512_dpbf16_ps(acc[x][g][0], (__m512bh)v0, pw);
                    acc[x][g][1] = _mm512_dpbf16_ps(acc[x][g][1], (__m512bh)v1, pw);
                }
        }
    }
}

/* o[(hg + g) D + 16 (db0 + j) ..] = acc[x][g][j] times `inv` (1 / sum), or as it is where sums is NULL */
INLINE void bdd_store(__m512 acc[MAX_GROUP][2], int64_t group, int64_t hg, int64_t D, int64_t db0,
                      const float *sums, float *restrict o) {
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < 2; j++) {
            __m512 v = acc[g][j];
            if (sums) v = _mm512_mul_ps(v, _mm512_set1_ps(1.0f / sums[hg + g]));
            _mm512_storeu_ps(o + (hg + g) * D + 16 * (db0 + j), v);
        }
}

/* the per-sequence parts of the scratch, sequence idx's as S<s>, P<s>, QP<s>, SUM<s> */
#define BDD_PARTS(s, idx)                                                                                          \
    float *S##s = scratch + (idx) * PD_SEQ_FLOATS(H, D, max_len);                                                  \
    uint16_t *P##s = (uint16_t *)(S##s + H * ss);                                                                  \
    uint32_t *QP##s = (uint32_t *)(S##s + H * ss + H * ss / 2);                                                    \
    float *SUM##s = S##s + H * ss + H * ss / 2 + H * D / 2;                                                        \
    (void)S##s, (void)P##s, (void)QP##s, (void)SUM##s

/* KV head h's output dims 16 db0 .. + 31 of sequences b0 .. b0 + NB - 1 (NB <= BDD_SEQS): the shared pairs once
 * for all of them, then each sequence's own pairs, then times 1 / sum */
INLINE void bdd_values_run(int64_t NB, int64_t b0, int64_t group, int64_t H, int64_t D, int64_t ss,
                           float *restrict scratch, int64_t max_len, int64_t h, int64_t db0, const uint16_t *cache,
                           const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t shared_len,
                           int64_t block_size, int64_t block_elems, int64_t pos_elems, int64_t v_offset,
                           float *restrict out) {
    const int64_t hg = h * group;
    __m512 acc[BDD_SEQS][MAX_GROUP][2];
    const uint16_t *pp[BDD_SEQS];
    for (int64_t x = 0; x < NB; x++) {
        BDD_PARTS(x, b0 + x);
        pp[x] = Px;
        for (int64_t g = 0; g < group; g++) acc[x][g][0] = acc[x][g][1] = _mm512_setzero_ps();
    }
    if (shared_len)
        bdd_values(acc, NB, group, pp, ss, hg, cache, tables + b0 * table_stride, shared_len, 0, shared_len / 2, h, D,
                   db0, block_size, block_elems, pos_elems, v_offset);
    for (int64_t x = 0; x < NB; x++) {
        const int64_t b = b0 + x;
        __m512 one[BDD_SEQS][MAX_GROUP][2];
        for (int64_t g = 0; g < group; g++) one[0][g][0] = acc[x][g][0], one[0][g][1] = acc[x][g][1];
        const uint16_t *p1[BDD_SEQS] = {pp[x]};
        bdd_values(one, 1, group, p1, ss, hg, cache, tables + b * table_stride, lens[b], shared_len / 2,
                   (lens[b] + 1) / 2, h, D, db0, block_size, block_elems, pos_elems, v_offset);
        BDD_PARTS(b, b);
        bdd_store(one[0], group, hg, D, db0, SUMb, out + b * H * D);
    }
}

/* Thread p of P's share of B sequences (the calling region's team, or P = 1 alone; the same bits for any P), in
 * three passes with a barrier between: the scores by K tiles (the shared prefix's tiles each once for every
 * sequence, then each sequence's own), the numerators by (sequence, query head), the values by (KV head, 32
 * dims) items over every sequence (so each shared V pair and each K tile is read by one thread). The first
 * shared_len positions (a multiple of 16) are read from sequence 0's table, which every table holds there
 * (checked by the caller). */
INLINE void bdd_part(const uint16_t *cache, const int32_t *tables, int64_t table_stride, const int32_t *lens,
                     int64_t B, int64_t KVH, int64_t group, int64_t D, int64_t block_size, int64_t block_elems,
                     int64_t pos_elems, int64_t v_offset, float scale, float *restrict out, float *restrict scratch,
                     int64_t max_len, int64_t shared_len, int64_t p, int64_t P) {
    const int64_t H = KVH * group, ss = (max_len + 31) / 32 * 32, shared_tiles = shared_len / 16;
    int64_t own = 0; /* K tiles past the shared ones, over every sequence */
    for (int64_t b = 0; b < B; b++) own += (lens[b] + 15) / 16 - shared_tiles;
    const int64_t work = shared_tiles + own, w0 = work * p / P, w1 = work * (p + 1) / P;
    __m512i kt[128 / 2];
    for (int64_t t = w0; t < w1 && t < shared_tiles; t++) { /* one K tile per head for every sequence, two a call */
        const int64_t l0 = 16 * t;
        int64_t at[16];
        rows_from(tables, l0, 16, block_size, block_elems, pos_elems, 0, 0, at);
        if (t + 1 < w1)
            bdd_prefetch(cache, tables, shared_len, l0 + 16 * PD_PF, 0, pos_elems, block_size, block_elems, pos_elems);
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t hg = h * group;
            bdd_k_tile(cache, at, 16, h, D, kt);
            const __m512i *const kts[2] = {kt, kt};
            for (int64_t b = 0; b < B; b += 2) {
                const int64_t nj = B - b >= 2 ? 2 : 1, b1 = b + nj - 1;
                BDD_PARTS(x, b);
                BDD_PARTS(y, b1);
                const uint32_t *const qps[2] = {QPx + hg * (D / 2), QPy + hg * (D / 2)};
                float *const dst[2] = {Sx + hg * ss + l0, Sy + hg * ss + l0};
                if (nj == 2)
                    bdd_scores(2, kts, qps, group, D, scale, dst, ss);
                else
                    bdd_scores(1, kts, qps, group, D, scale, dst, ss);
            }
        }
    }
    for (int64_t b = 0, first = shared_tiles; b < B; b++) { /* this thread's part of each sequence's own tiles */
        const int64_t tiles = (lens[b] + 15) / 16 - shared_tiles;
        const int64_t lo = w0 > first ? w0 - first : 0, hi = w1 < first + tiles ? w1 - first : tiles;
        if (lo < hi) {
            BDD_PARTS(b, b);
            bdd_seq_scores(cache, tables + b * table_stride, lens[b], shared_tiles + lo, shared_tiles + hi, KVH,
                           group, D, block_size, block_elems, pos_elems, QPb, scale, Sb, ss);
        }
        first += tiles;
    }
#pragma omp barrier
    for (int64_t i = B * H * p / P; i < B * H * (p + 1) / P; i++) {
        BDD_PARTS(b, i / H);
        SUMb[i % H] = bd_numerators(Sb + (i % H) * ss, lens[i / H], Pb + (i % H) * ss);
    }
#pragma omp barrier
    /* runs of sequences whose accumulators fit the registers (group x 2 x NB <= 24) */
    const int64_t nb_max = 12 / group >= BDD_SEQS ? BDD_SEQS : 12 / group >= 1 ? 12 / group : 1;
    const int64_t halves = D / 32, items = KVH * halves;
    for (int64_t it = items * p / P; it < items * (p + 1) / P; it++) {
        const int64_t h = it / halves, db0 = 2 * (it % halves);
        for (int64_t b0 = 0; b0 < B; b0 += nb_max) {
            const int64_t nb = B - b0 < nb_max ? B - b0 : nb_max;
#define BDD_RUN(NB)                                                                                                \
    bdd_values_run(NB, b0, group, H, D, ss, scratch, max_len, h, db0, cache, tables, table_stride, lens, shared_len, \
                   block_size, block_elems, pos_elems, v_offset, out)
            if (nb == 4)
                BDD_RUN(4);
            else if (nb == 3)
                BDD_RUN(3);
            else if (nb == 2)
                BDD_RUN(2);
            else
                BDD_RUN(1);
#undef BDD_RUN
        }
    }
}

/* bdd_part behind a call, its arguments plain parameters (attend_one_part's reason): the model's compiled shape,
 * and any shape */
#define BDD_PART_PARAMS                                                                                            \
    const uint16_t *cache, const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t B, int64_t KVH, \
        int64_t block_size, int64_t block_elems, int64_t pos_elems, int64_t v_offset, float scale,                  \
        float *restrict out, float *restrict scratch, int64_t max_len, int64_t shared_len, int64_t p, int64_t P
#if defined(PD_GROUP) && defined(PD_HEAD_DIM)
static __attribute__((noinline)) void bdd_part_model(BDD_PART_PARAMS) {
    bdd_part(cache, tables, table_stride, lens, B, KVH, PD_GROUP, PD_HEAD_DIM, block_size, block_elems, pos_elems,
             v_offset, scale, out, scratch, max_len, shared_len, p, P);
}
#endif
static __attribute__((noinline)) void bdd_part_any(BDD_PART_PARAMS, int64_t group, int64_t D) {
    bdd_part(cache, tables, table_stride, lens, B, KVH, group, D, block_size, block_elems, pos_elems, v_offset, scale,
             out, scratch, max_len, shared_len, p, P);
}
#undef BDD_PART_PARAMS

/* decode_attention's checks and arguments; -1 also for an fp32 cache or a shape off the vector path (D not a
 * multiple of 32 up to 128, group past MAX_GROUP). A shared_len whose blocks the tables do not all hold is
 * taken as 0 (the same bits: it only orders the work). */
static int decode_attention_bf16(const void *q, int q_bf16, const void *cache, int cache_bf16,
                                 const int32_t *block_tables, int64_t table_stride, const int32_t *lens, int64_t B,
                                 int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks,
                                 float scale, float *out, float *scratch, int64_t max_len, int64_t shared_len,
                                 int threads, int split) {
    if (decode_args_ok(block_tables, table_stride, lens, B, H, KVH, D, block_size, num_blocks, max_len, shared_len,
                       threads, split))
        return -1;
    const int64_t group = H / KVH;
    if (!cache_bf16 || D % 32 || D > 128 || group > MAX_GROUP) return -1;
    const int64_t pos_elems = KVH * D, block_elems = block_size * pos_elems, v_offset = num_blocks * block_elems;
    for (int64_t b = 1; b < B && shared_len; b++)
        for (int64_t t = 0; t * block_size < shared_len; t++)
            if (block_tables[b * table_stride + t] != block_tables[t]) shared_len = 0;
    const int64_t ss = (max_len + 31) / 32 * 32;
    for (int64_t b = 0; b < B; b++) {
        BDD_PARTS(b, b);
        for (int64_t i = 0; i < H; i++) bd_query_pairs(q, q_bf16, (b * H + i) * D, D, QPb + i * (D / 2));
    }
    const uint16_t *kv = (const uint16_t *)cache;
#if defined(PD_GROUP) && defined(PD_HEAD_DIM)
#define BDD_CALL(p, P)                                                                                             \
    if (group == PD_GROUP && D == PD_HEAD_DIM)                                                                     \
        bdd_part_model(kv, block_tables, table_stride, lens, B, KVH, block_size, block_elems, pos_elems, v_offset,  \
                       scale, out, scratch, max_len, shared_len, p, P);                                            \
    else                                                                                                           \
        bdd_part_any(kv, block_tables, table_stride, lens, B, KVH, block_size, block_elems, pos_elems, v_offset,    \
                     scale, out, scratch, max_len, shared_len, p, P, group, D)
#else
#define BDD_CALL(p, P)                                                                                             \
    bdd_part_any(kv, block_tables, table_stride, lens, B, KVH, block_size, block_elems, pos_elems, v_offset, scale, \
                 out, scratch, max_len, shared_len, p, P, group, D)
#endif
    if (threads > 1 && B > 0) {
#pragma omp parallel num_threads(threads)
        {
            const int64_t p = omp_get_thread_num(), P = omp_get_num_threads();
            BDD_CALL(p, P);
        }
    } else if (B > 0) {
        BDD_CALL(0, 1);
    }
#undef BDD_CALL
    return 0;
}

/* As paged_decode_attention (same arguments and output; scratch: B * PD_SEQ_FLOATS(H, D, max_len) floats), on
 * VDPBF16PS: each sequence's result is paged_prefill_attention_bf16's for a row at position lens[b] - 1. */
int paged_decode_attention_bf16(const void *q, int q_bf16, const void *cache, int cache_bf16,
                                const int32_t *block_tables, int64_t table_stride, const int32_t *lens, int64_t B,
                                int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                                float *out, float *scratch, int64_t max_len, int64_t shared_len) {
    return decode_attention_bf16(q, q_bf16, cache, cache_bf16, block_tables, table_stride, lens, B, H, KVH, D,
                                 block_size, num_blocks, scale, out, scratch, max_len, shared_len, 1, SPLIT_DEFAULT);
}

/* The same, spread over `threads` OpenMP threads (bdd_part; any B, any split: the same bits). decode_step.c calls
 * it for a whole step's sequences (struct decode_step's attn_batched). */
int paged_decode_attention_bf16_threads(const void *q, int q_bf16, const void *cache, int cache_bf16,
                                        const int32_t *block_tables, int64_t table_stride, const int32_t *lens,
                                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                        int64_t num_blocks, float scale, float *out, float *scratch, int64_t max_len,
                                        int64_t shared_len, int threads, int split) {
    return decode_attention_bf16(q, q_bf16, cache, cache_bf16, block_tables, table_stride, lens, B, H, KVH, D,
                                 block_size, num_blocks, scale, out, scratch, max_len, shared_len, threads, split);
}
#endif
