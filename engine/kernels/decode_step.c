/* The layer loop of a decode step, and of a step of prompt chunks on the AMX dense copies: every decoder layer
 * of the model in one call (engine/native_step.py).
 *
 * A decode step of a small model is a few hundred kernel calls, and from Python each costs a wrapper, its
 * argument checks, an output tensor and a ctypes crossing: on SmolLM2-135M that was a third of a one-stream
 * step. This file runs the same calls, in the same order, with the same arguments, from C: the kernels are the
 * caller's (engine/kernels/quant_gemv.c, layer_glue.c, paged_decode.c, each from its own shared library, built
 * and checked by its module) and reached through the function pointers in `struct decode_step`, so every
 * output is bit for bit what engine.model.DecoderLayer.forward_glued computes. Nothing here does arithmetic.
 *
 * Per layer, for T rows (one generated token per sequence), fp32 unless said:
 *   qkv  = gemv(W_qkv, x)                            [T][(H + 2 KVH) D]
 *   q    = rope_store(qkv) (K/V stored at slots)     [T][H][D]
 *   attn = paged_decode_attention(q, cache)          [T][H][D]  (runs of sequences on attn_threads threads)
 *   o    = gemv(W_o, attn)                           [T][hidden]
 *   x    = rmsnorm(h += o, post_norm)                [T][hidden]
 *   gu   = gemv(W_gate_up, x)                        [T][2 I]
 *   act  = silu(g) * u                               [T][I]
 *   dn   = gemv(W_down, act)                         [T][hidden]
 *   x    = rmsnorm(h += dn, next_norm)               [T][hidden]  (the next layer's input, or the output)
 *
 * prompt_step_layers (the end of the file) runs the same stages for a step of prompt rows (one or more sequences'
 * prompt chunks, each a contiguous run of rows), each linear on its bf16 dense copy in the AMX GEMM
 * (engine/kernels/amx_gemm.c) and attention on the native prefill kernel (paged_decode.c's paged_prefill_attention
 * or its AMX build), one call per chunk in order, for the first `layers` layers.
 *
 * Returns 0, or the first failing kernel's return code (nothing after it runs); `failed` then holds the
 * layer and the stage (0 qkv, 1 rope_store, 2 attention, 3 o, 4 post norm, 5 gate_up, 6 silu_mul, 7 down,
 * 8 next norm).
 */
#include <stdint.h>

typedef int (*gemv_fn)(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int threads);
typedef int (*rmsnorm_fn)(float *h, const void *y, int y_bf16, const float *w, void *x, int x_bf16, int64_t rows,
                          int64_t n, float eps, int threads);
typedef int (*rope_fn)(float *qkv, float *q_out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d,
                       const float *cs, void *cache, int cache_bf16, int64_t num_slots, const int64_t *slots,
                       int threads);
typedef int (*silu_fn)(const void *gu, int in_bf16, void *out, int out_bf16, int64_t rows, int64_t n, int threads);
typedef int (*attend_fn)(const void *q, int q_bf16, const void *cache, int cache_bf16, const int32_t *tables,
                         int64_t table_stride, const int32_t *lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                         int64_t block_size, int64_t num_blocks, float scale, float *out, float *scratch,
                         int64_t max_len, int64_t shared_len);
typedef int (*attend_threads_fn)(const void *q, int q_bf16, const void *cache, int cache_bf16,
                                 const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t B,
                                 int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks,
                                 float scale, float *out, float *scratch, int64_t max_len, int64_t shared_len,
                                 int threads, int split);

/* One decoder layer as the kernels take it (engine/native_step_abi.py `DecodeLayer`). */
struct decode_layer {
    const uint8_t *qkv, *o, *gate_up, *down; /* the native linear kernel's packed tiles */
    int32_t qkv_bits, o_bits, gate_up_bits, down_bits;
    const float *post_norm, *next_norm; /* [hidden]; next_norm: the next layer's input norm, or the final norm */
    void *cache;                        /* [2][num_blocks][block_size][KVH][D], fp32 or bf16 */
};

/* One step (engine/native_step_abi.py `DecodeStepArgs`). */
struct decode_step {
    gemv_fn gemv4, gemv8;
    rmsnorm_fn rmsnorm;
    rope_fn rope;
    silu_fn silu;
    attend_fn attend;
    attend_threads_fn attend_threads;
    int64_t layers, rows, hidden, heads, kv_heads, head_dim, inter;
    int64_t block_size, num_blocks, table_stride, max_len, shared_len;
    int32_t cache_bf16, gemv_threads, glue_threads, attn_threads;
    int32_t attn_batched; /* attend_threads takes every row at once (the bf16 decode), not a lone sequence only */
    float eps, scale;
    const float *cos_sin; /* [rows][D / 2][2] */
    const int64_t *slots; /* [rows] */
    const int32_t *tables, *lens;
    float *h, *x; /* [rows][hidden]: the residual (updated) and the normed input (layer 0's in, the output out) */
    float *qkv, *q, *attn, *o, *gu, *act, *down, *scratch;
};

static int gemv(const struct decode_step *s, const uint8_t *w, int32_t bits, int64_t n, int64_t k, const float *x,
                float *y) {
    gemv_fn f = bits == 4 ? s->gemv4 : bits == 8 ? s->gemv8 : 0;
    if (!f) return -100;
    return f(w, n, k, x, s->rows, y, s->gemv_threads);
}

/* Decode attention of the step's sequences, split into `attn_threads` contiguous runs of sequences, one call
 * of the kernel per run on its own thread (each with its share of the scratch: the kernel's layout is per
 * sequence). The kernel computes every sequence alone, so a sequence's output is the same bits in any run,
 * and the blocks all sequences share are walked once per run. A lone sequence, and with attn_batched (the bf16
 * decode, paged_decode_attention_bf16_threads) every sequence of the step, is spread over the threads by the
 * kernel itself (the same bits; the bf16 decode then reads each shared block once per step). */
static int attend(const struct decode_step *s, void *cache) {
    const int64_t T = s->rows, H = s->heads, D = s->head_dim;
    const int64_t per_seq = H * (2 * (s->max_len + 31) + D + 1); /* engine.native_decode.scratch_size, one sequence */
    int rc = 0;
    if ((T == 1 || s->attn_batched) && s->attn_threads > 1)
        return s->attend_threads(s->q, 0, cache, s->cache_bf16, s->tables, s->table_stride, s->lens, T, H,
                                 s->kv_heads, D, s->block_size, s->num_blocks, s->scale, s->attn, s->scratch,
                                 s->max_len, s->shared_len, s->attn_threads, 0 /* the build's split */);
    const int parts = s->attn_threads < T ? s->attn_threads : (int)T;
#pragma omp parallel for num_threads(parts > 1 ? parts : 1) schedule(static, 1) reduction(| : rc)
    for (int p = 0; p < parts; p++) {
        const int64_t b0 = T * p / parts, b1 = T * (p + 1) / parts;
        rc |= s->attend(s->q + b0 * H * D, 0, cache, s->cache_bf16, s->tables + b0 * s->table_stride,
                        s->table_stride, s->lens + b0, b1 - b0, H, s->kv_heads, D, s->block_size, s->num_blocks,
                        s->scale, s->attn + b0 * H * D, s->scratch + b0 * per_seq, s->max_len, s->shared_len);
    }
    return rc;
}

/* Layer L for the step's rows; 0, or the failing kernel's code with its stage in *stage. */
static int decode_layer(const struct decode_step *s, const struct decode_layer *L, int *stage) {
    const int64_t T = s->rows, hid = s->hidden, H = s->heads, KVH = s->kv_heads, D = s->head_dim;
    const int64_t width = (H + 2 * KVH) * D, slots = s->num_blocks * s->block_size;
    int rc = gemv(s, L->qkv, L->qkv_bits, width, hid, s->x, s->qkv);
    *stage = 0;
    if (!rc)
        *stage = 1, rc = s->rope(s->qkv, s->q, T, H, KVH, D, s->cos_sin, L->cache, s->cache_bf16, slots, s->slots,
                                 s->glue_threads);
    if (!rc) *stage = 2, rc = attend(s, L->cache);
    if (!rc) *stage = 3, rc = gemv(s, L->o, L->o_bits, hid, H * D, s->attn, s->o);
    if (!rc) *stage = 4, rc = s->rmsnorm(s->h, s->o, 0, L->post_norm, s->x, 0, T, hid, s->eps, s->glue_threads);
    if (!rc) *stage = 5, rc = gemv(s, L->gate_up, L->gate_up_bits, 2 * s->inter, hid, s->x, s->gu);
    if (!rc) *stage = 6, rc = s->silu(s->gu, 0, s->act, 0, T, s->inter, s->glue_threads);
    if (!rc) *stage = 7, rc = gemv(s, L->down, L->down_bits, hid, s->inter, s->act, s->down);
    if (!rc) *stage = 8, rc = s->rmsnorm(s->h, s->down, 0, L->next_norm, s->x, 0, T, hid, s->eps, s->glue_threads);
    return rc;
}

int decode_step_layers(const struct decode_step *s, const struct decode_layer *layers, int32_t *failed) {
    for (int64_t i = 0; i < s->layers; i++) {
        int stage = 0;
        const int rc = decode_layer(s, layers + i, &stage);
        if (rc) {
            failed[0] = (int32_t)i;
            failed[1] = stage;
            return rc;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Prompt chunks: chunk c is rows row0[c] .. row0[c + 1] - 1 of the step, at positions start[c] .., over block
 * table tables[c]; every linear on its AMX dense copy (engine.amx_gemm: fp32 in and out) for all rows at once,
 * attention by the native prefill kernel chunk by chunk. */
typedef int (*gemm_fn)(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w_packed, int64_t n,
                       int64_t kp, float *y, int64_t ldy, uint16_t *scratch, int threads);
typedef int (*prefill_fn)(const void *q, int q_bf16, const void *cache, int cache_bf16, const int32_t *table,
                          int64_t table_len, int64_t start, int64_t L, int64_t H, int64_t KVH, int64_t D,
                          int64_t block_size, int64_t num_blocks, float scale, float *out, float *scratch,
                          int64_t scratch_floats, int threads);

/* One decoder layer as the prompt step takes it (engine/native_step_abi.py `PromptLayer`). */
struct prompt_layer {
    const uint16_t *qkv, *o, *gate_up, *down; /* the AMX GEMM's packed B tiles */
    int64_t qkv_kp, o_kp, gate_up_kp, down_kp; /* each one's input size rounded up to 32 */
    const float *post_norm, *next_norm;
    void *cache;
};

/* One prompt step (engine/native_step_abi.py `PromptStepArgs`). */
struct prompt_step {
    gemm_fn gemm;
    rmsnorm_fn rmsnorm;
    rope_fn rope;
    silu_fn silu;
    prefill_fn prefill;
    int64_t layers, rows, hidden, heads, kv_heads, head_dim, inter;
    int64_t block_size, num_blocks, chunks, attn_scratch_floats;
    int32_t cache_bf16, gemm_threads, glue_threads, attn_threads;
    float eps, scale;
    const float *cos_sin; /* [rows][D / 2][2] */
    const int64_t *slots; /* [rows] */
    const int64_t *row0, *start, *table_len; /* [chunks + 1], [chunks], [chunks] */
    const int32_t *const *tables;            /* [chunks]: chunk c's block table, table_len[c] ids */
    float *h, *x;
    float *qkv, *q, *attn, *o, *gu, *act, *down, *attn_scratch;
    uint16_t *gemm_scratch; /* bf16 [rows rounded up to 32][the largest kp] */
};

/* attention of every chunk, in order (each chunk's rows computed alone: the same bits in any step) */
static int prefill_chunks(const struct prompt_step *s, void *cache) {
    const int64_t H = s->heads, D = s->head_dim;
    for (int64_t c = 0; c < s->chunks; c++) {
        const int64_t r0 = s->row0[c], n = s->row0[c + 1] - r0;
        const int rc = s->prefill(s->q + r0 * H * D, 0, cache, s->cache_bf16, s->tables[c], s->table_len[c],
                                  s->start[c], n, H, s->kv_heads, D, s->block_size, s->num_blocks, s->scale,
                                  s->attn + r0 * H * D, s->attn_scratch, s->attn_scratch_floats, s->attn_threads);
        if (rc) return rc;
    }
    return 0;
}

/* Layer L for the step's prompt rows; 0, or the failing kernel's code with its stage in *stage. */
static int prompt_layer(const struct prompt_step *s, const struct prompt_layer *L, int *stage) {
    const int64_t T = s->rows, hid = s->hidden, H = s->heads, KVH = s->kv_heads, D = s->head_dim;
    const int64_t width = (H + 2 * KVH) * D, slots = s->num_blocks * s->block_size, I2 = 2 * s->inter;
    const int gt = s->gemm_threads;
    int rc = s->gemm(s->x, T, hid, hid, L->qkv, width, L->qkv_kp, s->qkv, width, s->gemm_scratch, gt);
    *stage = 0;
    if (!rc)
        *stage = 1, rc = s->rope(s->qkv, s->q, T, H, KVH, D, s->cos_sin, L->cache, s->cache_bf16, slots, s->slots,
                                 s->glue_threads);
    if (!rc) *stage = 2, rc = prefill_chunks(s, L->cache);
    if (!rc) *stage = 3, rc = s->gemm(s->attn, T, H * D, H * D, L->o, hid, L->o_kp, s->o, hid, s->gemm_scratch, gt);
    if (!rc) *stage = 4, rc = s->rmsnorm(s->h, s->o, 0, L->post_norm, s->x, 0, T, hid, s->eps, s->glue_threads);
    if (!rc) *stage = 5, rc = s->gemm(s->x, T, hid, hid, L->gate_up, I2, L->gate_up_kp, s->gu, I2, s->gemm_scratch, gt);
    if (!rc) *stage = 6, rc = s->silu(s->gu, 0, s->act, 0, T, s->inter, s->glue_threads);
    if (!rc)
        *stage = 7, rc = s->gemm(s->act, T, s->inter, s->inter, L->down, hid, L->down_kp, s->down, hid,
                                 s->gemm_scratch, gt);
    if (!rc) *stage = 8, rc = s->rmsnorm(s->h, s->down, 0, L->next_norm, s->x, 0, T, hid, s->eps, s->glue_threads);
    return rc;
}

int prompt_step_layers(const struct prompt_step *s, const struct prompt_layer *layers, int32_t *failed) {
    for (int64_t i = 0; i < s->layers; i++) {
        int stage = 0;
        const int rc = prompt_layer(s, layers + i, &stage);
        if (rc) {
            failed[0] = (int32_t)i;
            failed[1] = stage;
            return rc;
        }
    }
    return 0;
}

/* A mixed step: generated rows first (d: the decode step's rows, their own buffers and residual rows), then
 * prompt chunks (p: the rows after them), the first p->layers layers. Every kernel computes a row (attention: a
 * sequence) from its own inputs and the cache, and no sequence has rows in both parts, so running layer i for
 * the generated rows and then for the prompt rows gives each row the bits of the layer loop over the whole step.
 * `failed[2]`: 0 for the generated rows' part, 1 for the prompt rows'. */
int mixed_step_layers(const struct decode_step *d, const struct decode_layer *dl, const struct prompt_step *p,
                      const struct prompt_layer *pl, int32_t *failed) {
    /* every slot of both parts checked first, so a bad one (refused by rope_store, stage 1) leaves nothing
     * written, as the layer loop's single rope_store call over all rows does */
    for (int part = 0; part < 2; part++) {
        const int64_t rows = part ? p->rows : d->rows, *slots = part ? p->slots : d->slots;
        const int64_t num_slots = part ? p->num_blocks * p->block_size : d->num_blocks * d->block_size;
        for (int64_t r = 0; r < rows; r++)
            if (slots[r] < 0 || slots[r] >= num_slots) {
                failed[0] = 0;
                failed[1] = 1;
                failed[2] = part;
                return -2;
            }
    }
    for (int64_t i = 0; i < p->layers; i++) {
        int stage = 0, part = 0;
        int rc = decode_layer(d, dl + i, &stage);
        if (!rc) part = 1, rc = prompt_layer(p, pl + i, &stage);
        if (rc) {
            failed[0] = (int32_t)i;
            failed[1] = stage;
            failed[2] = part;
            return rc;
        }
    }
    return 0;
}
