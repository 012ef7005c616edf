/* The Llama/Qwen2 forward pass on the CPU in one call: GEMMs on pre-packed weights, RMSNorm, rotary,
 * paged KV store and paged attention, SiLU*mul and the residual adds.
 *
 * Why C: at decode batch sizes on a 2-core CPU, a step through torch is ~20 small ops per layer, each
 * paying dispatch and an OpenMP fork/join, plus GEMMs that cannot stream a weight in bf16 (torch's bf16
 * CPU matmul needs AVX512-BF16). Here a layer is eight parallel loops over memory the caller owns.
 *
 * Threads: `#pragma omp parallel`, linked against the libgomp torch itself loaded (same soname), so the
 * loops run on torch's own intra-op thread pool and never oversubscribe the cores.
 *
 * Layouts (row-major unless said):
 *   activations fp32 [T, features]; the residual stream stays fp32 whatever the weight dtype.
 *   packed weight: panels of 16 output features, [ceil(N/16), K, 16], fp32 or bf16 (bf16 panels store
 *     their 16 columns in the order PANEL_ORDER so that two unpack instructions widen them in order).
 *   or GGUF blocks (Q8_0 / Q4_0 / Q4_1) repacked by quant_gemm.c: each weight carries its format code.
 *   KV cache per layer: [num_blocks, block_size, kv_heads, head_dim], fp32 or bf16 (NHD).
 *   attention works per query token: its sequence row in block_tables and its context length
 *   (position + 1), so one loop serves decodes, chunked prefills and whole prompts alike.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVS_AVX2 1
#endif

#define PANEL 16
/* Stored position -> column of a bf16 panel (see the header comment); fp32 panels are in order. */
static const int PANEL_ORDER[PANEL] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#ifdef _OPENMP
#define POOL_SIZE() omp_get_max_threads()
#define TEAM_SIZE() omp_get_num_threads()
#define TEAM_RANK() omp_get_thread_num()
#else
#define POOL_SIZE() 1
#define TEAM_SIZE() 1
#define TEAM_RANK() 0
#endif
/* Loops over fewer elements than this run on the calling thread: a fork/join costs more. */
#define PARALLEL_MIN_ELEMENTS 32768

/* ------------------------------------------------------------------------------------------------
 * GEMM: y[M, N] (=|+=) x[M, K] @ W^T (+ bias), W packed in panels.
 * A micro-tile is MR rows x one 16-column panel: 2*MR vector accumulators stay in registers over the
 * whole K loop (K is at most a few thousand here), so there is no K blocking.
 * ------------------------------------------------------------------------------------------------ */
#define MAX_MR 6
#define PREFETCH_ROWS 96

static void tile_store(float acc[MAX_MR][PANEL], int mr, float *y, int64_t ldy, int ncols, const float *bias,
                       int accumulate) {
    for (int r = 0; r < mr; r++) {
        float *row = y + r * ldy;
        for (int c = 0; c < ncols; c++) {
            float v = acc[r][c];
            if (bias) v += bias[c];
            row[c] = accumulate ? row[c] + v : v;
        }
    }
}

#ifdef KVS_AVX2
static inline __attribute__((always_inline)) void load_panel_row(const void *w, const int bf16, int64_t k, __m256 *w0,
                                                                 __m256 *w1) {
    if (bf16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k * PANEL));
        const __m256i zero = _mm256_setzero_si256();
        *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
        *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
    } else {
        const float *p = (const float *)w + k * PANEL;
        *w0 = _mm256_loadu_ps(p);
        *w1 = _mm256_loadu_ps(p + 8);
    }
}

/* One MR x 16 tile. MR, BF16 and KSTEP are literals at every call site, and the accumulators are
 * named variables, not an array: gcc kept an array of __m256 on the stack and stored it every k.
 * Element (r, k) of A is x[r * ldx + k * KSTEP]: rows of x (ldx = K, KSTEP = 1) or a packed sliver
 * (ldx = 1, KSTEP = MAX_MR). */
#define KVS_ROW_FMA(r)                                                              \
    if (MR > r) {                                                                   \
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k * KSTEP);             \
        c##r##a = _mm256_fmadd_ps(xv, w0, c##r##a);                                 \
        c##r##b = _mm256_fmadd_ps(xv, w1, c##r##b);                                 \
    }
#define KVS_ROW_OUT(r)                                                              \
    if (MR > r) {                                                                   \
        _mm256_storeu_ps(acc_out[r], c##r##a);                                      \
        _mm256_storeu_ps(acc_out[r] + 8, c##r##b);                                  \
    }
static inline __attribute__((always_inline)) void micro_tile(const int MR, const int BF16, const int KSTEP, const int STREAM,
                                                             const float *x,
                                                             int64_t ldx, const void *w, int64_t K,
                                                             float acc_out[MAX_MR][PANEL]) {
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a;
    __m256 c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
    int64_t k = 0;
    if (MR == 1 && KSTEP == 1) {
        /* One row is bound by FMA latency, not by loads: a second pair of chains on odd k. */
        for (; k + 1 < K; k += 2) {
            __m256 w0, w1, v0, v1;
            load_panel_row(w, BF16, k, &w0, &w1);
            load_panel_row(w, BF16, k + 1, &v0, &v1);
            const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + k + 1);
            c0a = _mm256_fmadd_ps(xa, w0, c0a);
            c0b = _mm256_fmadd_ps(xa, w1, c0b);
            c1a = _mm256_fmadd_ps(xb, v0, c1a);
            c1b = _mm256_fmadd_ps(xb, v1, c1b);
        }
        c0a = _mm256_add_ps(c0a, c1a);
        c0b = _mm256_add_ps(c0b, c1b);
    }
    for (; k < K; k++) {
        __m256 w0, w1;
        if (STREAM) __builtin_prefetch((const char *)w + (k + PREFETCH_ROWS) * PANEL * (BF16 ? 2 : 4), 0, 0);
        load_panel_row(w, BF16, k, &w0, &w1);
        KVS_ROW_FMA(0) KVS_ROW_FMA(1) KVS_ROW_FMA(2) KVS_ROW_FMA(3) KVS_ROW_FMA(4) KVS_ROW_FMA(5)
    }
    KVS_ROW_OUT(0) KVS_ROW_OUT(1) KVS_ROW_OUT(2) KVS_ROW_OUT(3) KVS_ROW_OUT(4) KVS_ROW_OUT(5)
}
#undef KVS_ROW_FMA
#undef KVS_ROW_OUT

/* Writes a tile from acc (bias, accumulate): vector stores for a full panel. */
static inline void tile_write(float acc[MAX_MR][PANEL], int mr, float *y, int64_t ldy, int ncols, const float *bias,
                              int accumulate) {
    if (ncols != PANEL) {
        tile_store(acc, mr, y, ldy, ncols, bias, accumulate);
        return;
    }
    const __m256 bias0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 bias1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int r = 0; r < mr; r++) {
        float *row = y + r * ldy;
        __m256 v0 = _mm256_add_ps(_mm256_loadu_ps(acc[r]), bias0);
        __m256 v1 = _mm256_add_ps(_mm256_loadu_ps(acc[r] + 8), bias1);
        if (accumulate) {
            v0 = _mm256_add_ps(_mm256_loadu_ps(row), v0);
            v1 = _mm256_add_ps(_mm256_loadu_ps(row + 8), v1);
        }
        _mm256_storeu_ps(row, v0);
        _mm256_storeu_ps(row + 8, v1);
    }
}
#endif

/* One MR x 16 tile of y (=|+=) x @ W_panel^T (+ bias). packed: x is a sliver from pack_rows (MR = MAX_MR).
 * stream (a packed bf16 tile that is the first to read its panel): the panel comes from DRAM, and at
 * decode batch sizes the next tiles find it in cache but this one waits on it. It prefetches
 * PREFETCH_ROWS rows ahead (3 KiB; non-temporal hint): +7 to +20% on the model's GEMMs at 16 rows
 * streaming their weights from DRAM on two threads, ~0 to +4% at 64 (paired runs); for the unpacked
 * single-row tile (batch 1) it measured no gain in the engine. */
static void gemm_tile(int mr, int packed, int stream, const float *x, int64_t ldx, const void *w, int bf16, int64_t K, float *y,
                      int64_t ldy, int ncols, const float *bias, int accumulate) {
    float acc[MAX_MR][PANEL];
#ifdef KVS_AVX2
#define KVS_CASE(MR)                                                               \
    case MR:                                                                       \
        if (bf16) micro_tile(MR, 1, 1, 0, x, ldx, w, K, acc);                         \
        else micro_tile(MR, 0, 1, 0, x, ldx, w, K, acc);                              \
        break;
    if (packed) {
        if (bf16 && stream) micro_tile(MAX_MR, 1, MAX_MR, 1, x, 1, w, K, acc);
        else if (bf16) micro_tile(MAX_MR, 1, MAX_MR, 0, x, 1, w, K, acc);
        else micro_tile(MAX_MR, 0, MAX_MR, 0, x, 1, w, K, acc);
    } else {
        switch (mr) {
            KVS_CASE(1) KVS_CASE(2) KVS_CASE(3) KVS_CASE(4) KVS_CASE(5)
        default:
            if (bf16) micro_tile(6, 1, 1, 0, x, ldx, w, K, acc);
            else micro_tile(6, 0, 1, 0, x, ldx, w, K, acc);
        }
    }
#undef KVS_CASE
    tile_write(acc, mr, y, ldy, ncols, bias, accumulate);
#else
    const int64_t kstep = packed ? MAX_MR : 1;
    if (packed) ldx = 1;
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < PANEL; c++) acc[r][c] = 0.0f;
    for (int64_t k = 0; k < K; k++)
        for (int s = 0; s < PANEL; s++) {
            const int c = bf16 ? PANEL_ORDER[s] : s;
            const float wv = bf16 ? bf16_to_f32(((const uint16_t *)w)[k * PANEL + s]) : ((const float *)w)[k * PANEL + s];
            for (int r = 0; r < mr; r++) acc[r][c] += x[r * ldx + k * kstep] * wv;
        }
    tile_store(acc, mr, y, ldy, ncols, bias, accumulate);
#endif
}

/* Activations are packed into slivers of MAX_MR rows, element (r, k) at k * MAX_MR + r, so a tile's
 * broadcasts read one sequential stream instead of MAX_MR rows K floats apart (measured 10-20%
 * faster per core on the model's GEMMs: with K = 576 a bf16 panel and six unpacked rows fill the
 * 32 KiB L1). A row block's slivers (at most PACK_BYTES) stay in L2 while every panel a thread owns
 * passes over them; K is not blocked (slicing K to 256 measured slower). Rows past the last full
 * sliver take the unpacked tile. Each thread packs its own copy (M x K floats, against M x K x N /
 * threads FMAs). */
#define PACK_BYTES (256 * 1024)
#define PACK_THREADS 64
static float pack_pool[PACK_THREADS][PACK_BYTES / sizeof(float)] __attribute__((aligned(64)));

static inline int64_t row_block(int64_t K) {
    int64_t rows = PACK_BYTES / (K * (int64_t)sizeof(float));
    rows = rows / MAX_MR * MAX_MR;
    return rows < MAX_MR ? MAX_MR : rows;
}

static void pack_rows(const float *x, int64_t rows, int64_t K, float *dst) {
    for (int64_t m = 0; m + MAX_MR <= rows; m += MAX_MR) {
        const float *src = x + m * K;
        float *sliver = dst + m * K;
        for (int64_t k = 0; k < K; k++)
            for (int r = 0; r < MAX_MR; r++) sliver[k * MAX_MR + r] = src[r * K + k];
    }
}

/* bf16 panels are widened in registers by every micro-tile (two unpacks per k, which do not compete
 * with the FMAs for a port). Widening a panel once per row block into an fp32 copy, by contrast,
 * measured 10-20% slower at 16-64 rows and no faster at 128-256. */
static void gemm_panel(const float *x, int64_t K, const void *w, int bf16, const float *bias, float *y, int64_t N,
                       int accumulate, int64_t p, int64_t m0, int64_t m1, const float *pack, size_t panel_bytes) {
    const void *wp = (const char *)w + (size_t)p * panel_bytes;
    const int64_t col = p * PANEL;
    const int ncols = N - col < PANEL ? (int)(N - col) : PANEL;
    for (int64_t m = m0; m < m1; m += MAX_MR) {
        const int mr = m1 - m < MAX_MR ? (int)(m1 - m) : MAX_MR;
        const int packed = pack && mr == MAX_MR;
        gemm_tile(mr, packed, packed && m == m0, packed ? pack + (m - m0) * K : x + m * K, K, wp, bf16, K, y + m * N + col,
                  N, ncols, bias ? bias + col : NULL, accumulate);
    }
}

/* Panels per grab of the dynamic schedule: enough to keep a thread's weight stream sequential for a
 * while, few enough that the last grabs even out (36-192 panels at the model's shapes). */
#define PANELS_PER_GRAB 2

/* y (=|+=) x @ W^T + bias over all panels. Row block by row block (see row_block), each thread packs
 * the block's rows into its own slivers, then the panels are dealt out dynamically: this VM's two
 * vCPUs run at different speeds from minute to minute (a register-only FMA loop measured 89 and 62
 * GFLOP/s on the two cores at one moment, equal a minute later), and a static half each left the
 * faster core idle for the difference. No barrier between row blocks: each thread's slivers are its
 * own. */
void kvs_linear(const float *x, int64_t M, int64_t K, const void *w, int32_t bf16, const float *bias, float *y,
                int64_t N, int32_t accumulate) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (M <= 0 || N <= 0) return;
    const size_t panel_bytes = (size_t)K * PANEL * (bf16 ? 2 : 4);
    const int64_t rows_per_block = row_block(K);
    /* Packing pays when a sliver is reused by several panels and fits the pool. */
    const int packing = K * MAX_MR * (int64_t)sizeof(float) <= PACK_BYTES && panels > 1;
#pragma omp parallel if (panels > 1 && M * K * N > PARALLEL_MIN_ELEMENTS)
    {
        const int rank = TEAM_RANK();
        float *pack = packing && rank < PACK_THREADS ? pack_pool[rank] : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += rows_per_block) {
            const int64_t m1 = m0 + rows_per_block < M ? m0 + rows_per_block : M;
            if (pack) pack_rows(x + m0 * K, m1 - m0, K, pack);
#pragma omp for schedule(dynamic, PANELS_PER_GRAB) nowait
            for (int64_t p = 0; p < panels; p++)
                gemm_panel(x, K, w, bf16, bias, y, N, accumulate, p, m0, m1, pack, panel_bytes);
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * Vector helpers
 * ------------------------------------------------------------------------------------------------ */
#ifdef KVS_AVX2
/* 16 bf16 values widened by two unpacks (one instruction per 8 values; a zero-extend and a shift cost two):
 * lo holds elements 0-3 and 8-11, hi 4-7 and 12-15 (the unpacks work within 128-bit lanes). Dot
 * products do not care if the other operand is permuted alike (permute_like_split); sums of
 * rows come out permuted and are put back in order by unsplit. */
static inline void load16_split(const uint16_t *p, __m256 *lo, __m256 *hi) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

/* dst[0:16] = src[0:16] in load16_split's order. */
static inline void permute_like_split(const float *src, float *dst) {
    const __m256 a = _mm256_loadu_ps(src), b = _mm256_loadu_ps(src + 8);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(a, b, 0x31));
}

/* Inverse of the split order: (lo, hi) -> elements 0-7 and 8-15. */
static inline void unsplit(__m256 lo, __m256 hi, __m256 *first, __m256 *second) {
    *first = _mm256_permute2f128_ps(lo, hi, 0x20);
    *second = _mm256_permute2f128_ps(lo, hi, 0x31);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x, Cephes' single-precision polynomial (about 1 ulp) with the argument range clamped. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
#endif

static inline float load1(const void *base, int bf16, int64_t index) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

/* ------------------------------------------------------------------------------------------------
 * Paged attention for one query token over KV heads [h0, h1): every K row of its context is read
 * once, in order (a block's rows are contiguous across heads), for all the query heads of those KV
 * heads, prefetched a few rows ahead, so over a long batch of contexts the scores are a DRAM stream.
 * P @ V goes over the V rows in chunks of PV_CHUNK keys with its accumulators in registers
 * (pv_registers); for a decode those rows were prefetched into L2 during the score pass. K and V
 * vectors are loaded once for a KV head's whole query-head group (GQA); bf16 ones are widened by
 * two unpacks per 16 values (load16_split), the query permuted to match.
 * ------------------------------------------------------------------------------------------------ */

/* Floats of attention scratch one thread needs for contexts up to max_context. */
static inline int64_t attention_scratch_floats(int64_t num_heads, int64_t max_context) {
    const int64_t length = max_context > 0 ? max_context : 1;
    return num_heads * length + 1 + 2 * length + 16;
}

int64_t kvs_attention_scratch(int64_t num_heads, int64_t max_context) {
    return attention_scratch_floats(num_heads, max_context);
}

static inline void prefetch_span(const char *start, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(start + at);
}

static inline void prefetch_span_l2(const char *start, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(start + at, 0, 2);
}

/* Scores of up to QK_HEADS query heads (one KV head's group) against four keys: each K vector is
 * loaded (and widened from bf16) once for all the heads, 4 x GS accumulators stay in registers, and
 * one horizontal-add tree per head reduces its four dot products. BF16: D % 16 == 0 and q in
 * load16_split's order (16 channels a step); fp32: D % 8 == 0. */
#define QK_HEADS 3
#ifdef KVS_AVX2
#define KVS_QK_FMA(j)                                                                                 \
    if (BF16) {                                                                                       \
        __m256 klo, khi;                                                                              \
        load16_split((const uint16_t *)k_cache + at[j] + d, &klo, &khi);                              \
        a0##j = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), khi, _mm256_fmadd_ps(_mm256_loadu_ps(q + d), klo, a0##j)); \
        if (GS > 1) a1##j = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d + 8), khi,                      \
                                            _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d), klo, a1##j)); \
        if (GS > 2) a2##j = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d + 8), khi,                  \
                                            _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d), klo, a2##j)); \
    } else {                                                                                          \
        const __m256 kv = _mm256_loadu_ps((const float *)k_cache + at[j] + d);                        \
        a0##j = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv, a0##j);                                  \
        if (GS > 1) a1##j = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d), kv, a1##j);                   \
        if (GS > 2) a2##j = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d), kv, a2##j);               \
    }
#define KVS_QK_OUT(g)                                                                                 \
    if (GS > g) {                                                                                     \
        const __m256 hs = _mm256_hadd_ps(_mm256_hadd_ps(a##g##0, a##g##1), _mm256_hadd_ps(a##g##2, a##g##3)); \
        _mm_storeu_ps(dots[g], _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(hs), _mm256_extractf128_ps(hs, 1)), \
                                          _mm_set1_ps(scale)));                                       \
    }
static inline __attribute__((always_inline)) void qk_tile(const int GS, const int BF16, const float *q, int64_t D,
                                                          const void *k_cache, const int64_t at[4], float scale,
                                                          int64_t count, float *out, int64_t out_stride) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    /* Each K vector is consumed as soon as it is loaded: holding all four (plus the 12 accumulators)
     * left gcc one register short, and it spilled an accumulator onto the loop's dependency chain. */
    for (int64_t d = 0; d < D; d += BF16 ? 16 : 8) {
        KVS_QK_FMA(0) KVS_QK_FMA(1) KVS_QK_FMA(2) KVS_QK_FMA(3)
    }
    float dots[QK_HEADS][4];
    KVS_QK_OUT(0) KVS_QK_OUT(1) KVS_QK_OUT(2)
    for (int g = 0; g < GS; g++) {
        if (count == 4) _mm_storeu_ps(out + g * out_stride, _mm_loadu_ps(dots[g]));
        else for (int64_t j = 0; j < count; j++) out[g * out_stride + j] = dots[g][j];
    }
}

#undef KVS_QK_FMA
#undef KVS_QK_OUT
#endif

/* out[g, 0:16] += sum_t p[g, t] * V[t, 0:16] for GS query heads of one KV head (`column` is the KV
 * head's first channel of the 16 within a cache row). */
#define PV_HEADS 3
#ifdef KVS_AVX2
#define KVS_PV_FMA(g)                                                                                 \
    if (GS > g) {                                                                                     \
        const __m256 pg = _mm256_broadcast_ss(p + g * length + t);                                    \
        a##g##0 = _mm256_fmadd_ps(pg, v0, a##g##0);                                                   \
        a##g##1 = _mm256_fmadd_ps(pg, v1, a##g##1);                                                   \
    }
#define KVS_PV_OUT(g)                                                                                 \
    if (GS > g) {                                                                                     \
        float *o = out + g * out_stride;                                                              \
        __m256 first = a##g##0, second = a##g##1;                                                     \
        if (BF16) unsplit(a##g##0, a##g##1, &first, &second);                                         \
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), first));                                \
        _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), second));                       \
    }
static inline __attribute__((always_inline)) void pv_tile(const int GS, const int BF16, const float *p,
                                                          int64_t length, int64_t t0, int64_t t1,
                                                          const int64_t *rows, const void *v_cache, int64_t column,
                                                          float *out, int64_t out_stride) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    for (int64_t t = t0; t < t1; t++) {
        __m256 v0, v1;      /* bf16: in load16_split's order, undone once at the end */
        if (BF16) {
            load16_split((const uint16_t *)v_cache + rows[t] + column, &v0, &v1);
        } else {
            v0 = _mm256_loadu_ps((const float *)v_cache + rows[t] + column);
            v1 = _mm256_loadu_ps((const float *)v_cache + rows[t] + column + 8);
        }
        KVS_PV_FMA(0) KVS_PV_FMA(1) KVS_PV_FMA(2)
    }
    KVS_PV_OUT(0) KVS_PV_OUT(1) KVS_PV_OUT(2)
}
#undef KVS_PV_FMA
#undef KVS_PV_OUT
#endif

/* out += p @ V over keys [t0, t1): per KV head, up to PV_HEADS of its query heads and 16 channels
 * at a time, the accumulators in registers over the keys (accumulating in `out` per key put a
 * store-to-load round trip on every key's dependency chain, and a store per FMA). */
static void pv_registers(const float *scores, float *outs, int64_t h0, int64_t h1, int64_t G, int64_t D,
                         const void *v_cache, int kv_bf16, const int64_t *rows, int64_t length, int64_t t0,
                         int64_t t1) {
    for (int64_t h = h0; h < h1; h++)
        for (int64_t g0 = 0; g0 < G; g0 += PV_HEADS) {
            const int64_t gs = G - g0 < PV_HEADS ? G - g0 : PV_HEADS;
            const float *p = scores + ((h - h0) * G + g0) * length;
            float *o = outs + ((h - h0) * G + g0) * D;
            int64_t d0 = 0;
#ifdef KVS_AVX2
            for (; d0 + 16 <= D; d0 += 16) {
#define KVS_PV_CALL(GS) kv_bf16 ? pv_tile(GS, 1, p, length, t0, t1, rows, v_cache, h * D + d0, o + d0, D) \
                                : pv_tile(GS, 0, p, length, t0, t1, rows, v_cache, h * D + d0, o + d0, D)
                if (gs == 3) KVS_PV_CALL(3);
                else if (gs == 2) KVS_PV_CALL(2);
                else KVS_PV_CALL(1);
#undef KVS_PV_CALL
            }
#endif
            for (int64_t g = 0; g < gs; g++)
                for (int64_t d = d0; d < D; d++) {
                    float acc = 0.0f;
                    for (int64_t t = t0; t < t1; t++) acc += p[g * length + t] * load1(v_cache, kv_bf16, rows[t] + h * D + d);
                    o[g * D + d] += acc;
                }
        }
}

/* Keys per P @ V chunk: the chunk's V rows (32 x a row's heads, 12 KiB for 3 bf16 heads of 64) stay
 * in L1 while every channel slice and head passes over them, and the next chunk is prefetched into
 * L1 meanwhile (from L2, where a decode's score pass put it). */
#define PV_CHUNK 32

static void attend(const float *q, float *out, int64_t h0, int64_t h1, int64_t G, int64_t D, const void *k_cache,
                   const void *v_cache, int kv_bf16, const int64_t *table, int64_t length, int64_t block_size,
                   int64_t token_stride, float scale, int cached_context, float *scratch) {
    const int64_t heads = (h1 - h0) * G;
    float *outs = out + h0 * G * D;
    const float *qs = q + h0 * G * D;
    if (length <= 0) {
        memset(outs, 0, sizeof(float) * (size_t)(heads * D));
        return;
    }
    float *scores = scratch;                                    /* [heads, length] */
    int64_t *rows = (int64_t *)(scratch + ((heads * length + 1) & ~(int64_t)1));   /* 8-byte aligned */
    for (int64_t t = 0, blk = 0, off = 0; t < length; t++) {     /* block by block: no division per key */
        rows[t] = (table[blk] * block_size + off) * token_stride;
        if (++off == block_size) { off = 0; blk++; }
    }
    const int elem = kv_bf16 ? 2 : 4;
    const size_t span_bytes = (size_t)((h1 - h0) * D * elem);    /* one row's bytes for these heads */
    /* 1. scores = q . k * scale, four keys at a time (one horizontal reduction for all four), every
     * head of the row before the next four: over a DRAM-resident context, one pass per KV head
     * measured a third slower than this one pass over whole rows. */
#ifdef KVS_AVX2
    const int vector_path = kv_bf16 ? D % 16 == 0 : D % 8 == 0;
#else
    const int vector_path = 0;
#endif
    float q_split[vector_path && kv_bf16 ? heads * D : 1];     /* bf16 keys: q in load16_split's order */
#ifdef KVS_AVX2
    if (vector_path && kv_bf16)
        for (int64_t at = 0; at < heads * D; at += 16) permute_like_split(qs + at, q_split + at);
#endif
    for (int64_t t0 = 0; t0 < length; t0 += 4) {
        int64_t quad[4];
        const int64_t count = length - t0 < 4 ? length - t0 : 4;
        for (int j = 0; j < 4; j++) quad[j] = rows[t0 + (j < count ? j : 0)];
        /* The next blocks are elsewhere in memory: fetch rows 8-11 ahead (all lines of their heads)
         * while these four are computed, so the loop does not wait on DRAM at each block boundary.
         * The same rows of V go to L2 now, for step 3: two streams in flight instead of one cut the
         * attention time of a batch-64 decode over DRAM-resident contexts by about a fifth. */
        for (int64_t ahead = t0 + 8; ahead < t0 + 12 && ahead < length; ahead++) {
            prefetch_span((const char *)k_cache + (size_t)(rows[ahead] + h0 * D) * elem, span_bytes);
            if (!cached_context)
                prefetch_span_l2((const char *)v_cache + (size_t)(rows[ahead] + h0 * D) * elem, span_bytes);
        }
        for (int64_t h = h0; h < h1; h++)
            for (int64_t g0 = 0; g0 < G; g0 += QK_HEADS) {
                const int64_t gs = G - g0 < QK_HEADS ? G - g0 : QK_HEADS, first = (h - h0) * G + g0;
                float *out_rows = scores + first * length + t0;
#ifdef KVS_AVX2
                if (vector_path) {
                    const int64_t at[4] = {quad[0] + h * D, quad[1] + h * D, quad[2] + h * D, quad[3] + h * D};
                    /* GS and BF16 literal at each call: no branch on either inside the loop. */
#define KVS_QK_CALL(GS) kv_bf16 ? qk_tile(GS, 1, q_split + first * D, D, k_cache, at, scale, count, out_rows, length) \
                                : qk_tile(GS, 0, qs + first * D, D, k_cache, at, scale, count, out_rows, length)
                    if (gs == 3) KVS_QK_CALL(3);
                    else if (gs == 2) KVS_QK_CALL(2);
                    else KVS_QK_CALL(1);
#undef KVS_QK_CALL
                    continue;
                }
#endif
                for (int64_t g = 0; g < gs; g++)
                    for (int64_t j = 0; j < count; j++) {
                        float acc = 0.0f;
                        for (int64_t d = 0; d < D; d++)
                            acc += qs[(first + g) * D + d] * load1(k_cache, kv_bf16, quad[j] + h * D + d);
                        out_rows[g * length + j] = acc * scale;
                    }
            }
    }
    /* 2. softmax per head. */
    for (int64_t head = 0; head < heads; head++) {
        float *sc = scores + head * length;
        float peak = sc[0];
        for (int64_t t = 1; t < length; t++) peak = sc[t] > peak ? sc[t] : peak;
        float total = 0.0f;
        int64_t t = 0;
#ifdef KVS_AVX2
        __m256 sum8 = _mm256_setzero_ps();
        const __m256 peak8 = _mm256_set1_ps(peak);
        for (; t + 8 <= length; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), peak8));
            _mm256_storeu_ps(sc + t, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        total = hsum8(sum8);
#endif
        for (; t < length; t++) {
            sc[t] = expf(sc[t] - peak);
            total += sc[t];
        }
        const float inv = 1.0f / total;
        for (t = 0; t < length; t++) sc[t] *= inv;
    }
    /* 3. out = p @ V, chunk by chunk (see PV_CHUNK); a prefill chunk's context is in cache already. */
    memset(outs, 0, sizeof(float) * (size_t)(heads * D));
    for (int64_t t0 = 0; t0 < length; t0 += PV_CHUNK) {
        const int64_t t1 = t0 + PV_CHUNK < length ? t0 + PV_CHUNK : length;
        if (!cached_context)
            for (int64_t ahead = t1; ahead < t1 + PV_CHUNK && ahead < length; ahead++)
                prefetch_span((const char *)v_cache + (size_t)(rows[ahead] + h0 * D) * elem, span_bytes);
        pv_registers(scores, outs, h0, h1, G, D, v_cache, kv_bf16, rows, length, t0, t1);
    }
}

/* Attention for T query tokens over the paged cache. q rows [T, q_stride] hold heads x D from column
 * 0; out rows [T, out_stride]. Token t attends to the first context_lens[t] tokens of the sequence
 * in row token_seqs[t] of block_tables. scratch: POOL_SIZE() * kvs_attention_scratch(...) floats.
 * A work unit is one token (all its heads: one pass over its rows); with fewer tokens than can
 * keep every thread busy, one (token, KV head). */
void kvs_paged_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride, int64_t T,
                         const void *k_cache, const void *v_cache, int32_t kv_bf16, const int64_t *block_tables,
                         int64_t max_blocks, const int32_t *token_seqs, const int32_t *context_lens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                         float *scratch, int64_t scratch_per_thread) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t split = T < 4 * (int64_t)POOL_SIZE() ? num_kv_heads : 1;   /* units per token */
    const int64_t units = T * split, heads_per_unit = num_kv_heads / split;
    int64_t work = 0;
    for (int64_t t = 0; t < T; t++) work += context_lens[t];
#pragma omp parallel for schedule(dynamic, 1) if (units > 1 && work * num_heads * head_dim > PARALLEL_MIN_ELEMENTS)
    for (int64_t unit = 0; unit < units; unit++) {
        const int64_t t = unit / split, h0 = (unit % split) * heads_per_unit;
        /* A token next to another of its sequence (a prefill chunk) finds that sequence's rows in cache. */
        const int cached = (t > 0 && token_seqs[t - 1] == token_seqs[t]) || (t + 1 < T && token_seqs[t + 1] == token_seqs[t]);
        attend(q + t * q_stride, out + t * out_stride, h0, h0 + heads_per_unit, G, head_dim, k_cache, v_cache, kv_bf16,
               block_tables + (int64_t)token_seqs[t] * max_blocks, context_lens[t], block_size,
               num_kv_heads * head_dim, scale, cached, scratch + TEAM_RANK() * scratch_per_thread);
    }
}

/* ------------------------------------------------------------------------------------------------
 * Row-wise ops
 * ------------------------------------------------------------------------------------------------ */
static void rms_norm(const float *x, float *y, int64_t T, int64_t H, const float *weight, float eps) {
#pragma omp parallel for if (T * H > PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *row = x + t * H;
        float *dst = y + t * H;
        float squares = 0.0f;
        int64_t i = 0;
#ifdef KVS_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= H; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        squares = hsum8(acc);
#endif
        for (; i < H; i++) squares += row[i] * row[i];
        const float inv = 1.0f / sqrtf(squares / (float)H + eps);
        for (i = 0; i < H; i++) dst[i] = weight[i] * (row[i] * inv);
    }
}

/* Rotates q and k of each token in place (half-split layout, as HF checkpoints) and writes k and v
 * into the cache at the token's slot (negative slot: a padding token, not stored). */
static void rotary_and_store(float *qkv, int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t D,
                             const float *cos_t, const float *sin_t, const int64_t *slot_mapping, void *k_cache,
                             void *v_cache, int kv_bf16) {
    const int64_t stride = (num_heads + 2 * num_kv_heads) * D, half = D / 2, kv_width = num_kv_heads * D;
#pragma omp parallel for if (T * stride > PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * stride;
        const float *c = cos_t + t * D, *s = sin_t + t * D;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            float *x = row + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                const float a = x1 * c[i], b = -x2 * s[i];
                const float e = x2 * c[i + half], f = x1 * s[i + half];
                x[i] = a + b;
                x[i + half] = e + f;
            }
        }
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const float *k = row + num_heads * D, *v = k + kv_width;
        if (kv_bf16) {
            uint16_t *kd = (uint16_t *)k_cache + slot * kv_width, *vd = (uint16_t *)v_cache + slot * kv_width;
            for (int64_t i = 0; i < kv_width; i++) {
                kd[i] = f32_to_bf16(k[i]);
                vd[i] = f32_to_bf16(v[i]);
            }
        } else {
            memcpy((float *)k_cache + slot * kv_width, k, sizeof(float) * (size_t)kv_width);
            memcpy((float *)v_cache + slot * kv_width, v, sizeof(float) * (size_t)kv_width);
        }
    }
}

/* act[t, i] = silu(gate[t, i]) * up[t, i], gate_up rows [gate | up]. */
static void silu_and_mul(const float *gate_up, float *act, int64_t T, int64_t I) {
#pragma omp parallel for if (T * I > PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *a = act + t * I;
        int64_t i = 0;
#ifdef KVS_AVX2
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) a[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

/* ------------------------------------------------------------------------------------------------
 * The whole model
 * ------------------------------------------------------------------------------------------------ */
typedef struct {
    int64_t hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, num_layers, block_size;
    float rms_eps, attn_scale;
    int32_t kv_bf16;
} kvs_dims;

typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv_w;
    const float *qkv_b;
    const void *o_w;
    const float *o_b;
    const void *gate_up_w;
    const float *gate_up_b;
    const void *down_w;
    const float *down_b;
    void *k_cache, *v_cache;
    /* Each weight's format: 0 fp32 panels, 1 bf16 panels, 2-4 GGUF blocks (quant_gemm.c). */
    int32_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
} kvs_layer;

int kvs_quant_linear(const float *x, int64_t M, int64_t K, const void *w, int32_t fmt, const float *bias, float *y,
                     int64_t N, int32_t accumulate);

/* One linear layer in whichever format its weight is kept. */
static int linear_any(const float *x, int64_t M, int64_t K, const void *w, int32_t fmt, const float *bias, float *y,
                      int64_t N, int32_t accumulate) {
    if (fmt <= 1) {
        kvs_linear(x, M, K, w, fmt, bias, y, N, accumulate);
        return 0;
    }
    return kvs_quant_linear(x, M, K, w, fmt, bias, y, N, accumulate);
}

/* Tokens a layer processes at a time. A 2048-token prefill step's gate_up output alone is 25 MB
 * (T x 2 x intermediate floats), so a whole-step layer streamed its activations through DRAM between
 * the GEMMs; chunks keep them in L2/L3 while the layer's weights (7 MB bf16 for SmolLM2) stay in L3.
 * Causal attention allows it: a chunk's tokens attend to positions of earlier chunks, whose K/V this
 * layer has already written. */
#define FORWARD_CHUNK 192

/* Floats of workspace kvs_llama_forward needs for T tokens whose longest context is max_context. */
int64_t kvs_llama_workspace(const kvs_dims *d, int64_t T, int64_t max_context) {
    const int64_t q = d->num_heads * d->head_dim, kv = d->num_kv_heads * d->head_dim;
    const int64_t per_thread = attention_scratch_floats(d->num_heads, max_context);
    const int64_t rows = T < FORWARD_CHUNK ? T : FORWARD_CHUNK;
    return rows * (d->hidden_size + q + 2 * kv + q + 3 * d->intermediate_size) + POOL_SIZE() * per_thread;
}

/* resid [T, H]: the token embeddings in, the residual stream during; out [T, H]: the final norm's
 * output. cos/sin [T, head_dim] for each token's position (attention scaling included). Tokens of
 * one sequence come in position order (a chunk attends to what earlier chunks stored). */
int kvs_llama_forward(const kvs_dims *d, const kvs_layer *layers, const float *final_norm, float *resid, float *out,
                      int64_t T, const float *cos_t, const float *sin_t, const int64_t *slot_mapping,
                      const int32_t *token_seqs, const int32_t *context_lens, const int64_t *block_tables,
                      int64_t max_blocks, float *work, int64_t work_floats) {
    const int64_t H = d->hidden_size, D = d->head_dim, I = d->intermediate_size;
    const int64_t q_width = d->num_heads * D, qkv_width = q_width + 2 * d->num_kv_heads * D;
    int64_t max_context = 0;
    for (int64_t t = 0; t < T; t++) max_context = context_lens[t] > max_context ? context_lens[t] : max_context;
    if (kvs_llama_workspace(d, T, max_context) > work_floats) return -1;
    const int64_t per_thread = attention_scratch_floats(d->num_heads, max_context);
    const int64_t rows = T < FORWARD_CHUNK ? T : FORWARD_CHUNK;
    float *x = work, *qkv = x + rows * H, *attn = qkv + rows * qkv_width, *gate_up = attn + rows * q_width;
    float *act = gate_up + rows * 2 * I, *scratch = act + rows * I;
    int failed = 0;
    for (int64_t l = 0; l < d->num_layers; l++) {
        const kvs_layer *L = layers + l;
        for (int64_t t0 = 0; t0 < T; t0 += FORWARD_CHUNK) {
            const int64_t n = T - t0 < FORWARD_CHUNK ? T - t0 : FORWARD_CHUNK;
            float *r = resid + t0 * H;
            rms_norm(r, x, n, H, L->input_norm, d->rms_eps);
            failed |= linear_any(x, n, H, L->qkv_w, L->qkv_fmt, L->qkv_b, qkv, qkv_width, 0);
            rotary_and_store(qkv, n, d->num_heads, d->num_kv_heads, D, cos_t + t0 * D, sin_t + t0 * D,
                             slot_mapping + t0, L->k_cache, L->v_cache, d->kv_bf16);
            kvs_paged_attention(qkv, qkv_width, attn, q_width, n, L->k_cache, L->v_cache, d->kv_bf16, block_tables,
                                max_blocks, token_seqs + t0, context_lens + t0, d->num_heads, d->num_kv_heads, D,
                                d->block_size, d->attn_scale, scratch, per_thread);
            failed |= linear_any(attn, n, q_width, L->o_w, L->o_fmt, L->o_b, r, H, 1);       /* resid += o_proj */
            rms_norm(r, x, n, H, L->post_norm, d->rms_eps);
            failed |= linear_any(x, n, H, L->gate_up_w, L->gate_up_fmt, L->gate_up_b, gate_up, 2 * I, 0);
            silu_and_mul(gate_up, act, n, I);
            failed |= linear_any(act, n, I, L->down_w, L->down_fmt, L->down_b, r, H, 1);       /* resid += down_proj */
        }
    }
    if (failed) return -2;
    rms_norm(resid, out, T, H, final_norm, d->rms_eps);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Greedy sampling: the first index of each row's maximum (a NaN counts as the maximum, as in
 * torch.argmax). torch's CPU argmax is scalar; over a 50k vocabulary at batch 64 it cost more than a
 * layer's attention.
 * ------------------------------------------------------------------------------------------------ */
void kvs_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for if (rows * cols > 8 * PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        int64_t c = 0, nan_at = -1;
        float peak = -INFINITY;
#ifdef KVS_AVX2
        __m256 peak8 = _mm256_set1_ps(-INFINITY);
        __m256 unordered = _mm256_setzero_ps();
        for (; c + 8 <= cols; c += 8) {
            const __m256 v = _mm256_loadu_ps(row + c);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            peak8 = _mm256_max_ps(peak8, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, peak8);
        for (int i = 0; i < 8; i++) peak = lanes[i] > peak ? lanes[i] : peak;
        if (_mm256_movemask_ps(unordered)) nan_at = 0;      /* rescan below for the first NaN */
#endif
        for (; c < cols; c++) {
            if (row[c] != row[c]) nan_at = 0;
            peak = row[c] > peak ? row[c] : peak;
        }
        int64_t best = 0;
        if (nan_at >= 0) {
            while (row[best] == row[best]) best++;
        } else {
            while (best < cols - 1 && row[best] != peak) best++;
        }
        out[r] = best;
    }
}

/* ------------------------------------------------------------------------------------------------
 * Calibration: GFLOP/s of a register-only FMA loop on every thread of the pool for about `seconds`.
 * What the cores deliver right now: on a shared VM it drifts by a third within minutes, so CPU
 * benchmarks record it next to each figure. 0 without AVX2/FMA.
 * ------------------------------------------------------------------------------------------------ */
#ifdef KVS_AVX2
static double wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#endif

double kvs_fma_gflops(double seconds, double *per_thread, int32_t capacity) {
#ifdef KVS_AVX2
    double flops = 0.0;
    const double started = wall_seconds();
#pragma omp parallel reduction(+ : flops)
    {
        /* Ten independent chains cover the FMA latency on both pipes (4 cycles x 2 on Zen 3). */
        __m256 a0 = _mm256_set1_ps(0.5f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
               a9 = a0;
        const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.0005f);
        double mine = 0.0;
        do {
            for (int i = 0; i < 100000; i++) {
#define KVS_CHAIN(x) x = _mm256_fmadd_ps(x, m, c);
                KVS_CHAIN(a0) KVS_CHAIN(a1) KVS_CHAIN(a2) KVS_CHAIN(a3) KVS_CHAIN(a4)
                KVS_CHAIN(a5) KVS_CHAIN(a6) KVS_CHAIN(a7) KVS_CHAIN(a8) KVS_CHAIN(a9)
#undef KVS_CHAIN
                __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7),
                                 "+x"(a8), "+x"(a9));
            }
            mine += 100000.0 * 10 * 16;
        } while (wall_seconds() - started < seconds);
        volatile float sink = _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(a0, a5), a9));
        (void)sink;
        flops += mine;
        /* Each thread's own rate: this VM's cores differ at times, which a total hides. */
        const int rank = TEAM_RANK();
        if (per_thread && rank < capacity) per_thread[rank] = mine / (wall_seconds() - started) / 1e9;
    }
    return flops / (wall_seconds() - started) / 1e9;
#else
    (void)seconds;
    (void)per_thread;
    (void)capacity;
    return 0.0;
#endif
}
