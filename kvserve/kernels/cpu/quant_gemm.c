/* y (=|+=) x @ W^T + bias with W kept in llama.cpp's GGUF blocks (Q8_0, Q4_0, Q4_1), repacked once at
 * load: the weight is read at its stored 4.5-8.5 bits per element instead of 16 or 32.
 *
 * Method (llama.cpp's int8 activation trick): each activation row is quantized once per call to int8
 * blocks of 32 with one fp32 scale da and the block's scaled sum sa = da * sum(qa). Every weight block
 * is written as w = d * u + m with u unsigned (Q4_1: its nibble and minimum; Q4_0: m = -8d; Q8_0:
 * u = q + 128, m = -128d), so a weight block times an activation block is
 *     d * da * isum(u * qa) + m * sa,
 * one unsigned-by-signed int8 dot and two multiply-adds.
 *
 * Layout (kvs_quant_repack): rows in groups of 8, and for each group and block of 32 inputs
 *     d[8] fp16 | m[8] fp16 (Q4_1 only) | quants
 * where quants hold, for each k-group j of 4 inputs, 8 rows x 4 bytes: one 256-bit register is k-group
 * j of all 8 rows, and one vpdpbusd against the activation's 4 bytes of that k-group broadcast adds 4
 * products to each row's lane. Q4 keeps two k-groups per byte (j in the low nibble, j + 4 in the high
 * one: GGUF's own byte order, so the nibbles move as they are), 128 bytes; Q8 stores u, 256 bytes. A
 * block then costs 8 dot instructions for 8 rows x 32 inputs per activation row, and the int32 lanes
 * are converted and scaled once per block instead of once per row (llama.cpp's repacked "8x8" CPU
 * layouts rest on the same idea).
 *
 * Instructions, chosen by the compiler from what this machine's CPU reports (-march=native, the build
 * being per machine: kvserve/kernels/cpu/__init__.py): AVX512-VNNI (256-bit, AVX512VL) or AVX-VNNI
 * vpdpbusd; AVX2's vpmaddubsw + vpmaddwd otherwise (Q8's u split into nibbles there, as vpmaddubsw
 * saturates at int16); a scalar loop without AVX2. kvs_quant_isa() names the one compiled in.
 *
 * x, y fp32 row-major; K a multiple of 32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QG_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QG_VNNI 1
#define QG_DPBUSD(acc, u, a) _mm256_dpbusd_epi32(acc, u, a)
#elif defined(__AVXVNNI__)
#define QG_VNNI 1
#define QG_DPBUSD(acc, u, a) _mm256_dpbusd_avx_epi32(acc, u, a)
#endif
#endif

/* Format codes shared with kvserve/kernels/cpu/weight_formats.py (0 and 1 are the fp32 / bf16 panels
 * of llama_forward.c). */
enum { QG_Q8_0 = 2, QG_Q4_0 = 3, QG_Q4_1 = 4 };
#define QK 32
#define GROUP 8
/* Activation rows per pass over a row group's blocks: the unpacked weight registers serve all of them. */
#define QG_ROWS 4
#define QG_PARALLEL_MIN 32768

const char *kvs_quant_isa(void) {
#if defined(QG_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(QG_AVX2) && defined(__AVXVNNI__)
    return "avx-vnni";
#elif defined(QG_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {                                     /* subnormal: normalise it */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400u)) { mantissa <<= 1; exponent--; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline int valid_format(int fmt) { return fmt == QG_Q8_0 || fmt == QG_Q4_0 || fmt == QG_Q4_1; }
static inline int gguf_block_bytes(int fmt) { return fmt == QG_Q8_0 ? 34 : fmt == QG_Q4_0 ? 18 : 20; }
static inline int quant_bytes(int fmt) { return fmt == QG_Q8_0 ? 256 : 128; }
static inline int group_block_bytes(int fmt) { return 16 + (fmt == QG_Q4_1 ? 16 : 0) + quant_bytes(fmt); }

/* Bytes of kvs_quant_repack's output for an [N, K] weight (rows padded to a multiple of 8); -1 if unsupported. */
int64_t kvs_quant_packed_bytes(int32_t fmt, int64_t N, int64_t K) {
    if (!valid_format(fmt) || K % QK || N <= 0) return -1;
    return (N + GROUP - 1) / GROUP * (K / QK) * group_block_bytes(fmt);
}

/* GGUF blocks [N rows][K/32 blocks] -> the interleaved layout above. Padding rows get d = m = 0. */
int kvs_quant_repack(const void *src, int32_t fmt, int64_t N, int64_t K, void *dst) {
    if (kvs_quant_packed_bytes(fmt, N, K) < 0) return -1;
    const int64_t nb = K / QK, groups = (N + GROUP - 1) / GROUP;
    const int in_bytes = gguf_block_bytes(fmt), out_bytes = group_block_bytes(fmt), qoff = fmt == QG_Q4_1 ? 32 : 16;
    memset(dst, 0, (size_t)kvs_quant_packed_bytes(fmt, N, K));
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = (uint8_t *)dst + (g * nb + b) * out_bytes;
            for (int r = 0; r < GROUP && g * GROUP + r < N; r++) {
                const uint8_t *in = (const uint8_t *)src + ((g * GROUP + r) * nb + b) * in_bytes;
                memcpy(out + 2 * r, in, 2);                                     /* d */
                if (fmt == QG_Q4_1) memcpy(out + 16 + 2 * r, in + 2, 2);       /* m */
                const uint8_t *quants = in + (fmt == QG_Q4_1 ? 4 : 2);
                const int groups_of_4 = fmt == QG_Q8_0 ? 8 : 4;
                for (int j = 0; j < groups_of_4; j++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t v = quants[4 * j + t];
                        out[qoff + j * 32 + r * 4 + t] = fmt == QG_Q8_0 ? (uint8_t)(v ^ 0x80u) : v;   /* q + 128 */
                    }
            }
        }
    return 0;
}

/* One activation row -> int8 blocks (q), their scales (d) and scaled sums (s). */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float scale = amax / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = (int)nearbyintf(xb[i] * inverse);
            q[b * QK + i] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
    }
}

#ifdef QG_AVX2
/* acc + per-lane sums of u[4i..4i+3] * a[4i..4i+3] (u unsigned, a signed). Without VNNI, vpmaddubsw's
 * int16 pair sums hold for u <= 15 (Q4); a byte u (Q8) goes in as its two nibbles. */
static inline __m256i dot_add(const int FMT, __m256i acc, __m256i u, __m256i a) {
#ifdef QG_VNNI
    (void)FMT;
    return QG_DPBUSD(acc, u, a);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (FMT != QG_Q8_0) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), ones));
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    const __m256i low = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(u, nibble), a), ones);
    const __m256i high = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u, 4), nibble), a), ones);
    return _mm256_add_epi32(acc, _mm256_add_epi32(low, _mm256_slli_epi32(high, 4)));
#endif
}

/* One row group (8 weight rows) against `rows` activation rows: out[r][lane] = sum_k w[lane][k] x_r[k]. */
static inline __attribute__((always_inline)) void group_dots(const int FMT, const int rows, const uint8_t *w,
                                                              int64_t nb, const int8_t *q, const float *d,
                                                              const float *s, int64_t K, __m256 out[QG_ROWS]) {
    const int bytes = group_block_bytes(FMT), qoff = FMT == QG_Q4_1 ? 32 : 16;
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    for (int r = 0; r < QG_ROWS; r++) out[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * bytes;
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        const __m256 mw = FMT == QG_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16)))
                                         : _mm256_mul_ps(dw, _mm256_set1_ps(FMT == QG_Q8_0 ? -128.0f : -8.0f));
        __m256i u[8];
        if (FMT == QG_Q8_0) {
            for (int j = 0; j < 8; j++) u[j] = _mm256_loadu_si256((const __m256i *)(block + qoff + 32 * j));
        } else {
            for (int j = 0; j < 4; j++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + qoff + 32 * j));
                u[j] = _mm256_and_si256(packed, nibble);
                u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            }
        }
        for (int r = 0; r < rows; r++) {
            const int8_t *a = q + r * K + b * QK;
            __m256i acc = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                int32_t four;
                memcpy(&four, a + 4 * j, 4);
                acc = dot_add(FMT, acc, u[j], _mm256_set1_epi32(four));
            }
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(d[r * nb + b]));
            out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), scale, out[r]);
            out[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s[r * nb + b]), out[r]);
        }
    }
}

static inline void store_group(const __m256 value, float *y, int ncols, const float *bias, int accumulate) {
    float lanes[GROUP];
    _mm256_storeu_ps(lanes, value);
    for (int c = 0; c < ncols; c++) {
        const float v = lanes[c] + (bias ? bias[c] : 0.0f);
        y[c] = accumulate ? y[c] + v : v;
    }
}
#else
static void group_dots_scalar(const int FMT, const int rows, const uint8_t *w, int64_t nb, const int8_t *q,
                              const float *d, const float *s, int64_t K, float out[QG_ROWS][GROUP]) {
    const int bytes = group_block_bytes(FMT), qoff = FMT == QG_Q4_1 ? 32 : 16;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < GROUP; c++) out[r][c] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * bytes;
        for (int c = 0; c < GROUP; c++) {
            uint16_t half;
            memcpy(&half, block + 2 * c, 2);
            const float dw = fp16_to_f32(half);
            float mw = dw * (FMT == QG_Q8_0 ? -128.0f : -8.0f);
            if (FMT == QG_Q4_1) {
                memcpy(&half, block + 16 + 2 * c, 2);
                mw = fp16_to_f32(half);
            }
            for (int r = 0; r < rows; r++) {
                const int8_t *a = q + r * K + b * QK;
                int dot = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t byte = FMT == QG_Q8_0 ? block[qoff + j * 32 + c * 4 + t]
                                                            : block[qoff + (j & 3) * 32 + c * 4 + t];
                        const int u = FMT == QG_Q8_0 ? byte : j < 4 ? (byte & 0x0f) : (byte >> 4);
                        dot += u * a[4 * j + t];
                    }
                out[r][c] += dw * d[r * nb + b] * (float)dot + mw * s[r * nb + b];
            }
        }
    }
}
#endif

/* Scratch for the quantized activations, grown as needed. The engine runs one forward at a time. */
static int8_t *act_q;
static float *act_scales;
static int64_t act_capacity;

static int reserve_activations(int64_t M, int64_t K) {
    const int64_t need = M * K;
    if (need <= act_capacity) return 0;
    int8_t *q = realloc(act_q, (size_t)need);
    if (!q) return -1;
    act_q = q;
    float *scales = realloc(act_scales, (size_t)(2 * need / QK) * sizeof(float));
    if (!scales) return -1;
    act_scales = scales;
    act_capacity = need;
    return 0;
}

static void group_rows(const int fmt, const uint8_t *wg, int64_t nb, int64_t M, int64_t K, const int8_t *q,
                       const float *d, const float *s, float *y, int64_t N, int64_t col, const float *bias,
                       int accumulate) {
    const int ncols = N - col < GROUP ? (int)(N - col) : GROUP;
    for (int64_t m = 0; m < M; m += QG_ROWS) {
        const int rows = M - m < QG_ROWS ? (int)(M - m) : QG_ROWS;
#ifdef QG_AVX2
        __m256 out[QG_ROWS];
#define QG_CALL(FMT, R) group_dots(FMT, R, wg, nb, q + m * K, d + m * nb, s + m * nb, K, out)
#define QG_ROWS_SWITCH(FMT)                                                                               \
        switch (rows) {                                                                                   \
        case 1: QG_CALL(FMT, 1); break;                                                                   \
        case 2: QG_CALL(FMT, 2); break;                                                                   \
        case 3: QG_CALL(FMT, 3); break;                                                                   \
        default: QG_CALL(FMT, 4);                                                                         \
        }
        if (fmt == QG_Q8_0) { QG_ROWS_SWITCH(QG_Q8_0) }
        else if (fmt == QG_Q4_0) { QG_ROWS_SWITCH(QG_Q4_0) }
        else { QG_ROWS_SWITCH(QG_Q4_1) }
#undef QG_ROWS_SWITCH
#undef QG_CALL
        for (int r = 0; r < rows; r++)
            store_group(out[r], y + (m + r) * N + col, ncols, bias ? bias + col : NULL, accumulate);
#else
        float out[QG_ROWS][GROUP];
        group_dots_scalar(fmt, rows, wg, nb, q + m * K, d + m * nb, s + m * nb, K, out);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < ncols; c++) {
                float *target = y + (m + r) * N + col + c;
                const float v = out[r][c] + (bias ? bias[col + c] : 0.0f);
                *target = accumulate ? *target + v : v;
            }
#endif
    }
}

/* w: kvs_quant_repack's output. Returns 0, or -1 when K is not a whole number of blocks, the format is
 * unknown or memory ran out. */
int kvs_quant_linear(const float *x, int64_t M, int64_t K, const void *w, int32_t fmt, const float *bias, float *y,
                     int64_t N, int32_t accumulate) {
    if (K % QK || !valid_format(fmt)) return -1;
    if (M <= 0 || N <= 0) return 0;
    if (reserve_activations(M, K)) return -1;
    const int64_t nb = K / QK, groups = (N + GROUP - 1) / GROUP;
    int8_t *q = act_q;
    float *d = act_scales, *s = act_scales + M * nb;
#pragma omp parallel for if (M * K > 4 * QG_PARALLEL_MIN)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, q + m * K, d + m * nb, s + m * nb);
    const size_t group_bytes = (size_t)nb * group_block_bytes(fmt);
    /* Groups are dealt out dynamically, two at a time (the VM's cores run at uneven speeds: see
     * kvs_linear). A group's blocks are read once per call and meet every activation row. */
#pragma omp parallel for schedule(dynamic, 2) if (M * K * N > QG_PARALLEL_MIN)
    for (int64_t g = 0; g < groups; g++)
        group_rows(fmt, (const uint8_t *)w + g * group_bytes, nb, M, K, q, d, s, y, N, g * GROUP, bias, accumulate);
    return 0;
}
