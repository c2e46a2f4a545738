/* The AMX bf16 GEMM of prompt rows: y[M, N] = x[M, K] @ W[N, K]^T, fp32 activations in, fp32 out, the weight
 * a bf16 copy packed into AMX B tiles (engine.amx_gemm owns the layout and the Python side).
 *
 * Why our own: oneDNN's bf16 GEMM on CPUs with AMX computes some rows of a call of more than 32 rows otherwise
 * than the same rows alone, so the engine cut its calls into 32-row slices (engine.bf16_gemm), reading the
 * weights once per 32 rows. Here every output element is one fixed sequence of tile operations: C starts at
 * zero and takes one TDPBF16PS per 32-wide chunk of K, chunks in increasing order, whatever M, the row's place
 * in the call, the other rows and the thread count. TDPBF16PS computes each C element from its own row of A
 * and column of B only (Intel SDM, "TDPBF16PS"), so row i of an M-row call is bit-identical to the one-row call
 * of that row (batch invariance: batched == alone, cache on == cache off).
 *
 * Layouts (bf16 as uint16_t):
 *   w_packed  [Np / 16][Kp / 32][16][32]: for output block nb and K chunk kb, a 16 x 64-byte B tile whose row r
 *             holds, for its 16 outputs n, the pair W[nb*16 + n][kb*32 + 2r + {0, 1}] (the "VNNI" pairing
 *             TDPBF16PS reads). Np = N rounded up to 32, Kp = K rounded up to 32, padding zero.
 *   scratch   [Mp][Kp] bf16 rows of x (round to nearest even; the K tail and the rows past M zero),
 *             Mp = M rounded up to 32; the caller allocates it.
 *
 * A call's last row block takes 16 rows when no more than 16 are left (block_16x32: the same tile products per
 * element, half the products of a 32-row block).
 *
 * Threads: the 32-column output blocks are split between threads in contiguous ranges; the conversion of x
 * is split by rows. Each output element is computed by one thread, in the order above.
 *
 * Invariants: reads x and w_packed only, writes scratch and the M x N block of y; nothing else. Before any
 * tile instruction a thread loads its tile configuration; the process must have asked Linux for AMX's tile data
 * state first (engine.amx_gemm.request_amx_permission).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h" /* tiles 0-3: C, 4-5: A, 6-7: B */

/* Row i of x (k floats) -> kp bf16, round to nearest even (the hardware's VCVTNEPS2BF16), zero past k. */
static void convert_row(const float *x, int64_t k, int64_t kp, uint16_t *out) {
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j));
        _mm256_storeu_si256((__m256i *)(out + j), (__m256i)h);
    }
    if (j < k) {
        __mmask16 m = (__mmask16)((1u << (k - j)) - 1u);
        __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + j));
        _mm256_storeu_si256((__m256i *)(out + j), (__m256i)h);
        j += 16;
    }
    for (; j < kp; j++) out[j] = 0;
}

/* The stored rows and columns of a block at the edge of y: tmp holds `block_rows` rows of 32 floats; rows past
 * `rows` and columns past `cols` (padding) are not stored. */
static void store_part(const float *tmp, int64_t block_rows, float *y, int64_t ldy, int64_t rows, int64_t cols) {
    const int64_t r_end = rows < block_rows ? rows : block_rows, c_end = cols < 32 ? cols : 32;
    for (int64_t r = 0; r < r_end; r++) memcpy(y + r * ldy, tmp + r * 32, (size_t)c_end * 4);
}

/* One 32 x 32 output block: rows m0..m0+31 of scratch against output block pair nb2 (outputs nb2*32..+31).
 * Rows past `rows` and columns past `cols` are computed (from zero padding) but not stored. */
static void block_32x32(const uint16_t *a, int64_t kp, const uint16_t *w_packed, int64_t nb2, float *y,
                        int64_t ldy, int64_t rows, int64_t cols) {
    const int64_t kt = kp / 32;
    const uint16_t *b0 = w_packed + (2 * nb2) * kt * 512;
    const uint16_t *b1 = b0 + kt * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kt; kb++) {
        _tile_loadd(4, a + kb * 32, kp * 2);
        _tile_loadd(5, a + 16 * kp + kb * 32, kp * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    if (rows >= 32 && cols >= 32) {
        _tile_stored(0, y, ldy * 4);
        _tile_stored(1, y + 16, ldy * 4);
        _tile_stored(2, y + 16 * ldy, ldy * 4);
        _tile_stored(3, y + 16 * ldy + 16, ldy * 4);
        return;
    }
    float tmp[32 * 32];
    _tile_stored(0, tmp, 32 * 4);
    _tile_stored(1, tmp + 16, 32 * 4);
    _tile_stored(2, tmp + 16 * 32, 32 * 4);
    _tile_stored(3, tmp + 16 * 32 + 16, 32 * 4);
    store_part(tmp, 32, y, ldy, rows, cols);
}

/* One 16 x 32 output block (the last row block of a call whose rows past a multiple of 32 are <= 16): rows
 * m0..m0+15 of scratch against output block pair nb2, C from zero and one TDPBF16PS per K chunk in order, as in
 * block_32x32, so each element is the same bits as there; half the tile products of a 32-row block for these
 * rows. Rows past `rows` and columns past `cols` are computed (from zero padding) but not stored. */
static void block_16x32(const uint16_t *a, int64_t kp, const uint16_t *w_packed, int64_t nb2, float *y,
                        int64_t ldy, int64_t rows, int64_t cols) {
    const int64_t kt = kp / 32;
    const uint16_t *b0 = w_packed + (2 * nb2) * kt * 512;
    const uint16_t *b1 = b0 + kt * 512;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < kt; kb++) {
        _tile_loadd(4, a + kb * 32, kp * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (rows >= 16 && cols >= 32) {
        _tile_stored(0, y, ldy * 4);
        _tile_stored(1, y + 16, ldy * 4);
        return;
    }
    float tmp[16 * 32];
    _tile_stored(0, tmp, 32 * 4);
    _tile_stored(1, tmp + 16, 32 * 4);
    store_part(tmp, 16, y, ldy, rows, cols);
}

/* The column blocks of one thread: panels of PANEL 32-column blocks, every 32-row block of scratch against
 * each block of the panel (the panel's B tiles stay in L2 while the rows stream past). */
#define PANEL 8
static void gemm_blocks(const uint16_t *scratch, int64_t m, int64_t kp, const uint16_t *w_packed, int64_t n,
                        float *y, int64_t ldy, int64_t nb_begin, int64_t nb_end) {
    amx_load_tiles_16x64();
    for (int64_t p = nb_begin; p < nb_end; p += PANEL) {
        int64_t p_end = p + PANEL < nb_end ? p + PANEL : nb_end;
        for (int64_t m0 = 0; m0 < m; m0 += 32) {
            const uint16_t *a = scratch + m0 * kp;
            for (int64_t nb2 = p; nb2 < p_end; nb2++) {
                if (m - m0 <= 16)
                    block_16x32(a, kp, w_packed, nb2, y + m0 * ldy + nb2 * 32, ldy, m - m0, n - nb2 * 32);
                else
                    block_32x32(a, kp, w_packed, nb2, y + m0 * ldy + nb2 * 32, ldy, m - m0, n - nb2 * 32);
            }
        }
    }
    _tile_release();
}

/* y[m, n] (row stride ldy floats) = x[m, k] (row stride ldx floats) @ W^T, W packed as above for n outputs and
 * kp = k rounded up to 32. scratch: (m rounded up to 32) x kp bf16. threads >= 1.
 * Returns 0, or -1 for arguments it cannot take (nothing written). */
int amx_gemm_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w_packed, int64_t n,
                 int64_t kp, float *y, int64_t ldy, uint16_t *scratch, int threads) {
    if (m < 1 || n < 1 || k < 1 || kp != (k + 31) / 32 * 32 || ldx < k || ldy < n || threads < 1) return -1;
    const int64_t mp = (m + 31) / 32 * 32, nblocks = (n + 31) / 32;
    int team = threads;
    if (team > nblocks) team = (int)nblocks;
#pragma omp parallel num_threads(team)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i = t; i < mp; i += nt) {
            if (i < m)
                convert_row(x + i * ldx, k, kp, scratch + i * kp);
            else
                memset(scratch + i * kp, 0, (size_t)kp * 2);
        }
#pragma omp barrier
        int64_t per = nblocks / nt, extra = nblocks % nt;
        int64_t begin = t * per + (t < extra ? t : extra);
        int64_t end = begin + per + (t < extra ? 1 : 0);
        if (begin < end) gemm_blocks(scratch, m, kp, w_packed, n, y, ldy, begin, end);
    }
    return 0;
}
