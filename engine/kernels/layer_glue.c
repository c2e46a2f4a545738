/* Layer glue of a Llama-family decoder step (prefixgate engine.native_glue): the small elementwise work between
 * the linear kernels and the attention kernel, one C call each instead of ~7-30 torch ops.
 *
 *   glue_rmsnorm     h += y (optional), then x = (h * (1 / sqrt(sum(h^2) / n + eps))) * w   (RMSNorm,
 *                    Zhang & Sennrich 2019), x written fp32 or bf16 (round to nearest even)
 *   glue_rope_store  RoPE (Su et al. 2021) on the q and k heads of a fused qkv buffer whose head dims come in
 *                    pairs (d, d + head_dim / 2) (engine.model.interleave_rope_rows), each pair (a, b) times
 *                    (cos, sin): (a cos - b sin, a sin + b cos); k in place, q into its own contiguous buffer;
 *                    then K and V rows stored at their cache slots (fp32, or bf16 rounded to nearest even)
 *   glue_silu_mul    act = silu(g) * u = (g / (1 + e^-g)) * u of a [g | u] row, fp32 or bf16 in and out
 *
 * Every row is computed alone, by one fixed sequence of fp32 operations that depends only on its width: the
 * same bits whatever the number of rows in the call, the other rows and the thread count (OpenMP splits rows,
 * never a row). The sum of squares of a row is taken in 16 lanes (lane l sums elements i = l mod 16 in order,
 * missing elements of a last partial vector count as +0), the lanes then added as a tree (l + 8, + 4, + 2, + 1).
 * Built with -ffp-contract=off: no multiply-add is fused, so RoPE's products and differences round as torch's
 * complex multiply does, and every build computes the same operations per element. The vectors are GL lanes wide:
 * 16 (one 512-bit register) on AVX-512 and on the test-only AVX build, 8 on AVX2, where GCC had lowered the
 * 16-lane vectors' compares, selects and conversions to scalar code through the stack (a store-forwarding stall
 * took half of silu's time). Every operation is per lane, and the sum of squares keeps its 16 lanes as two
 * 8-lane halves, so the lane count changes no bit (tests/engine/test_native_glue.py compares the builds).
 *
 * Every function checks its arguments before it reads or writes anything and returns 0, or a negative code
 * (the Python wrapper raises a named error). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define PAR_MIN_ELEMS (1 << 16) /* rows * width below this run on the calling thread alone */

#if defined(__AVX2__) && !defined(__AVX512F__)
#define GL 8 /* lanes per vector: 8 on AVX2 (256-bit registers) */
#else
#define GL 16
#endif
typedef float vg __attribute__((vector_size(GL * 4)));
typedef uint16_t u16g __attribute__((vector_size(GL * 2)));
typedef uint32_t u32g __attribute__((vector_size(GL * 4)));
typedef int32_t i32g __attribute__((vector_size(GL * 4)));

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even (torch's conversion; NaN -> quiet NaN) */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

INLINE vg loadg(const void *src, int64_t i, int is_bf16) {
    vg r;
    if (is_bf16) {
        u16g h;
        memcpy(&h, (const uint16_t *)src + i, sizeof h);
        u32g w = __builtin_convertvector(h, u32g) << 16;
        memcpy(&r, &w, sizeof r);
    } else {
        memcpy(&r, (const float *)src + i, sizeof r);
    }
    return r;
}

INLINE void storeg(void *dst, int64_t i, vg x, int is_bf16) {
    if (is_bf16) {
        u32g u;
        memcpy(&u, &x, sizeof u);
        const i32g nan = x != x;
        const u32g rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        const u32g quiet = (u >> 16) | 0x40u;
        const u32g r = (rounded & ~(u32g)nan) | (quiet & (u32g)nan);
        const u16g h = __builtin_convertvector(r, u16g);
        memcpy((uint16_t *)dst + i, &h, sizeof h);
    } else {
        memcpy((float *)dst + i, &x, sizeof x);
    }
}

INLINE float load1(const void *src, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i];
}

INLINE void store1(void *dst, int64_t i, float x, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)dst)[i] = f32_to_bf16(x);
    else
        ((float *)dst)[i] = x;
}

/* the first n (<= GL) elements at src[i], the rest 0 */
INLINE vg load_part(const void *src, int64_t i, int64_t n, int is_bf16) {
    float buf[GL] = {0};
    for (int64_t t = 0; t < n; t++) buf[t] = load1(src, i + t, is_bf16);
    vg r;
    memcpy(&r, buf, sizeof r);
    return r;
}

INLINE void store_part(void *dst, int64_t i, int64_t n, vg x, int is_bf16) {
    float buf[GL];
    memcpy(buf, &x, sizeof buf);
    for (int64_t t = 0; t < n; t++) store1(dst, i + t, buf[t], is_bf16);
}

/* lane sums l + 8, + 4, + 2, + 1: the 16 lanes of a[0 .. 16 / GL - 1] as one number, in a fixed tree */
INLINE float tree16(const vg a[16 / GL]) {
    float s[16];
    memcpy(s, a, sizeof s);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) s[l] = s[l] + s[l + w];
    return s[0];
}

/* ---- RMSNorm ----------------------------------------------------------------------------------------------- */

static void rmsnorm_row(float *restrict h, const void *restrict y, int y_bf16, const float *restrict w,
                        void *restrict x, int x_bf16, int64_t n, float eps) {
    const int64_t full = n / 16 * 16;
    vg acc[16 / GL] = {{0}}; /* lane l of the 16: the squares of elements i = l mod 16, in order */
    for (int64_t i = 0; i < full; i += 16)
        for (int k = 0; k < 16 / GL; k++) {
            vg v;
            memcpy(&v, h + i + k * GL, sizeof v);
            if (y) {
                v = v + loadg(y, i + k * GL, y_bf16);
                memcpy(h + i + k * GL, &v, sizeof v);
            }
            acc[k] += v * v;
        }
    for (int k = 0; k < 16 / GL; k++) {
        const int64_t at = full + k * GL, m = n - at < 0 ? 0 : n - at < GL ? n - at : GL;
        if (m == 0) continue; /* +0 squares: acc unchanged */
        vg v = load_part(h, at, m, 0);
        if (y) {
            v = v + load_part(y, at, m, y_bf16);
            store_part(h, at, m, v, 0);
        }
        acc[k] += v * v;
    }
    const float ms = tree16(acc) / (float)n;
    const float inv = 1.0f / sqrtf(ms + eps);
    const int64_t vfull = n / GL * GL;
    for (int64_t i = 0; i < vfull; i += GL) {
        vg v, wv;
        memcpy(&v, h + i, sizeof v);
        memcpy(&wv, w + i, sizeof wv);
        storeg(x, i, (v * inv) * wv, x_bf16);
    }
    for (int64_t i = vfull; i < n; i++) store1(x, i, (h[i] * inv) * w[i], x_bf16);
}

/* rows x n: h (fp32, updated in place when y is given: h += y), y (fp32 or bf16, or NULL), w (fp32 [n]),
 * x (fp32 or bf16 out, its own buffer). Returns 0, or -1 for a bad size. */
int glue_rmsnorm(float *h, const void *y, int y_bf16, const float *w, void *x, int x_bf16, int64_t rows,
                 int64_t n, float eps, int threads) {
    if (rows < 0 || n < 1 || threads < 1 || !h || !w || !x) return -1;
    const int64_t xs = n * (x_bf16 ? 2 : 4), ys = n * (y_bf16 ? 2 : 4);
    if (rows * n < PAR_MIN_ELEMS || threads == 1) {
        for (int64_t r = 0; r < rows; r++)
            rmsnorm_row(h + r * n, y ? (const char *)y + r * ys : 0, y_bf16, w, (char *)x + r * xs, x_bf16, n,
                        eps);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++)
        rmsnorm_row(h + r * n, y ? (const char *)y + r * ys : 0, y_bf16, w, (char *)x + r * xs, x_bf16, n, eps);
    return 0;
}

/* ---- RoPE and the K/V store -------------------------------------------------------------------------------- */

/* one head's d values in pair order, times the row's (cos, sin) pairs cs[d]: GL values (GL / 2 pairs) at a time */
INLINE void rope_head(float *restrict x, const float *restrict cs, int64_t d) {
#if GL == 16
    const i32g even = {0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14};
    const i32g odd = {1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15};
    const i32g swap = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    const vg sign = {-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1};
#else
    const i32g even = {0, 0, 2, 2, 4, 4, 6, 6};
    const i32g odd = {1, 1, 3, 3, 5, 5, 7, 7};
    const i32g swap = {1, 0, 3, 2, 5, 4, 7, 6};
    const vg sign = {-1, 1, -1, 1, -1, 1, -1, 1};
#endif
    const int64_t full = d / GL * GL;
    for (int64_t i = 0; i < full; i += GL) {
        vg v, c;
        memcpy(&v, x + i, sizeof v);
        memcpy(&c, cs + i, sizeof c);
        const vg cos = __builtin_shuffle(c, even), sin = __builtin_shuffle(c, odd);
        const vg r = v * cos + (__builtin_shuffle(v, swap) * sin) * sign; /* (a c + -(b s), b c + a s) */
        memcpy(x + i, &r, sizeof r);
    }
    for (int64_t i = full; i < d; i += 2) {
        const float a = x[i], b = x[i + 1], c = cs[i], s = cs[i + 1];
        x[i] = a * c + -(b * s);
        x[i + 1] = b * c + a * s;
    }
}

static void rope_store_row(float *restrict row, float *restrict q, const float *restrict cs, int64_t heads,
                           int64_t kv_heads, int64_t d, void *restrict cache, int cache_bf16, int64_t plane,
                           int64_t slot) {
    if (q) {
        memcpy(q, row, heads * d * sizeof(float));
        for (int64_t j = 0; j < heads; j++) rope_head(q + j * d, cs, d);
    } else {
        for (int64_t j = 0; j < heads; j++) rope_head(row + j * d, cs, d);
    }
    for (int64_t j = heads; j < heads + kv_heads; j++) rope_head(row + j * d, cs, d);
    if (!cache) return;
    const int64_t kvn = kv_heads * d;
    const float *k = row + heads * d, *v = k + kvn;
    const int64_t size = cache_bf16 ? 2 : 4;
    char *kd = (char *)cache + slot * kvn * size, *vd = (char *)cache + (plane + slot * kvn) * size;
    if (!cache_bf16) {
        memcpy(kd, k, kvn * 4);
        memcpy(vd, v, kvn * 4);
        return;
    }
    const int64_t full = kvn / GL * GL;
    for (int64_t i = 0; i < full; i += GL) {
        vg a, b;
        memcpy(&a, k + i, sizeof a);
        memcpy(&b, v + i, sizeof b);
        storeg(kd, i, a, 1);
        storeg(vd, i, b, 1);
    }
    for (int64_t i = full; i < kvn; i++) {
        store1(kd, i, k[i], 1);
        store1(vd, i, v[i], 1);
    }
}

/* qkv: fp32 [rows][(heads + 2 kv_heads) d], q heads then k heads then v heads, each head's dims in RoPE pair
 * order; cs: fp32 [rows][d / 2][2] (cos, sin) per row and pair. k rotated in place; q rotated into q_out (fp32
 * [rows][heads][d]), or in place when q_out is NULL. With cache (NULL: none): [2][num_slots][kv_heads][d] fp32
 * or bf16, K at plane 0, V at plane 1; row r's K and V stored at slots[r]. Returns 0; -1 a bad size; -2 a slot
 * outside [0, num_slots) (nothing written). */
int glue_rope_store(float *qkv, float *q_out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d,
                    const float *cs, void *cache, int cache_bf16, int64_t num_slots, const int64_t *slots,
                    int threads) {
    if (rows < 0 || heads < 1 || kv_heads < 1 || d < 2 || d % 2 || threads < 1 || !qkv || !cs) return -1;
    if (cache) {
        if (!slots || num_slots < 1) return -1;
        for (int64_t r = 0; r < rows; r++)
            if (slots[r] < 0 || slots[r] >= num_slots) return -2;
    }
    const int64_t width = (heads + 2 * kv_heads) * d, plane = num_slots * kv_heads * d;
    if (rows * width < PAR_MIN_ELEMS || threads == 1) {
        for (int64_t r = 0; r < rows; r++)
            rope_store_row(qkv + r * width, q_out ? q_out + r * heads * d : 0, cs + r * d, heads, kv_heads, d,
                           cache, cache_bf16, plane, cache ? slots[r] : 0);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++)
        rope_store_row(qkv + r * width, q_out ? q_out + r * heads * d : 0, cs + r * d, heads, kv_heads, d, cache,
                       cache_bf16, plane, cache ? slots[r] : 0);
    return 0;
}

/* ---- SiLU(gate) * up --------------------------------------------------------------------------------------- */

/* a where mask (lanes of -1), else b */
INLINE vg selectg(i32g mask, vg a, vg b) {
    i32g ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* e^x per lane for silu: x = n ln2 + r with n = x log2 e rounded to nearest even, e^r by the minimax polynomial
 * of Cephes' expf (S. L. Moshier), 2^n as 2^(n-1) * 2 from the exponent bits; ~2 ulp. x < -80 is taken as -80
 * (e^-80 < 2^-115: 1 + e^x rounds to 1 either way), x > 88.7228 (past FLT_MAX) gives +inf; NaN stays NaN. */
INLINE vg expg(vg x) {
    const i32g big = x > 88.72283935546875f;
    const vg zero = {0}, lo = zero - 80.0f, hi = zero + 88.72283935546875f;
    x = selectg(x < lo, lo, x);
    x = selectg(x > hi, hi, x);
    const vg t = x * 1.44269504088896341f;
    const vg tf = (t + 12582912.0f) - 12582912.0f; /* round to nearest even (|t| < 2^22) */
    const i32g n = __builtin_convertvector(tf, i32g);
    const vg r = (x - tf * 0.693359375f) + tf * 2.12194440e-4f;
    vg p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i32g bits = (n + 126) << 23;
    vg two_n1;
    memcpy(&two_n1, &bits, sizeof two_n1);
    const vg e = (p * two_n1) * 2.0f;
    return selectg(big, zero + __builtin_inff(), e);
}

INLINE vg silu_mulg(vg g, vg u) { return (g / (1.0f + expg(-g))) * u; }

static void silu_mul_row(const void *restrict gu, int in_bf16, void *restrict out, int out_bf16, int64_t n) {
    const int64_t full = n / GL * GL;
    for (int64_t i = 0; i < full; i += GL)
        storeg(out, i, silu_mulg(loadg(gu, i, in_bf16), loadg(gu, n + i, in_bf16)), out_bf16);
    if (full < n) {
        const int64_t m = n - full;
        const vg a = silu_mulg(load_part(gu, full, m, in_bf16), load_part(gu, n + full, m, in_bf16));
        store_part(out, full, m, a, out_bf16);
    }
}

/* gu: [rows][2 n] (gate then up), fp32 or bf16; out: [rows][n] fp32 or bf16. Returns 0, or -1 a bad size. */
int glue_silu_mul(const void *gu, int in_bf16, void *out, int out_bf16, int64_t rows, int64_t n, int threads) {
    if (rows < 0 || n < 1 || threads < 1 || !gu || !out) return -1;
    const int64_t is = 2 * n * (in_bf16 ? 2 : 4), os = n * (out_bf16 ? 2 : 4);
    if (rows * n < PAR_MIN_ELEMS / 4 || threads == 1) {
        for (int64_t r = 0; r < rows; r++)
            silu_mul_row((const char *)gu + r * is, in_bf16, (char *)out + r * os, out_bf16, n);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row((const char *)gu + r * is, in_bf16, (char *)out + r * os, out_bf16, n);
    return 0;
}
