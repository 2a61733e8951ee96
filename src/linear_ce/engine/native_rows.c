/* The row math of a logits tile in one pass per output: linear_ce.engine.native_rows.
 *
 * Each row i of a (rows, V) tile x with row stride ld (row-major) is read as
 *     v_j = (x_j * mul) / div,  m = max_j v_j,  u_j = v_j - m,  e_j = exp(u_j)
 * in fp32, whatever the tile's dtype (bf16, fp16 or fp32). Two functions per dtype:
 *
 *   stats: m, S = sum_j e_j, and where asked D = sum_j e_j u_j and u_t (the target
 *          column's u; 0 where target[i] < 0). A row is read twice (its max, then
 *          its sums) while it sits in the core's cache.
 *   grad:  g_j = e_j (a + b (u_j - mu)) + gamma [j = t], written over the tile in
 *          its own dtype (one rounding, to nearest even), with m from stats.
 *   fused: stats (m, S, u_t) and then, while the row is in cache, the gradient with
 *          a = (c0 + c1 lse) / S, lse = m + log S, b = 0: a head whose coefficients
 *          are known before its row statistics (cross-entropy). e_j is kept in a row
 *          of fp32 scratch between the two, not formed twice.
 *   fused_cm: fused for an fp32 class-major tile (a (V, B) array with class stride
 *          ld, read as its (B, V) transpose), vectorised over rows: two passes over the
 *          tile from memory (statistics with a running max, gradient) where torch's
 *          operations take eight. stats_cm: stats' statistics (the dot sum too);
 *          grad_cm: grad's gradient (the vocabulary pass's blocks of a known row's classes).
 *
 * Where e_j = 0 (a masked class, u_j = -inf) g_j is 0 (the limit, not 0 * inf), times a
 * NaN where a row's coefficients hold one (a row the forward found non-finite stays NaN,
 * as the plain expression's).
 * exp is a Cody-Waite reduction and a degree-7 Taylor polynomial (< 2 ulp over
 * u <= 0); u below the smallest normal's log (-126 ln 2) gives 0, a NaN u gives NaN. The sums
 * use 64 fp32 partial sums per row. Plain C, no threads: the caller splits rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 64

static inline float from_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    /* Round to nearest even; a NaN keeps a quiet NaN's bits. */
    uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? ((b >> 16) | 0x40u) : rounded);
}

static inline float from_f16(_Float16 h) { return (float)h; }
static inline _Float16 to_f16(float f) { return (_Float16)f; }
static inline float from_f32(float f) { return f; }
static inline float to_f32(float f) { return f; }

static inline float exp_nonpositive(float u) {
    /* -126 ln 2 (rounded up): above it 2^n times p stays a normal number. */
    float x = u < -87.336544f ? -87.336544f : u;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606820309417232e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t k = (int32_t)n;
    uint32_t bits;
    memcpy(&bits, &p, 4);
    bits += (uint32_t)k << 23;
    float out;
    memcpy(&out, &bits, 4);
    out = u < -87.336544f ? 0.0f : out;
    return u != u ? u : out;
}

/* e^x for a clamped u, EXP_SUM_CLAMP <= x <= 0 (or NaN), without exp_nonpositive's selects:
 * the terms of the sums of a row whose max is finite. A term below e^-86 counts as e^-86,
 * which cannot move a sum that holds the max's term of 1, and keeps 2^n p normal; a NaN x
 * makes the sum NaN. 2^n comes from the rounding constant's bits, r from one fused step (its
 * error, |n| 2e-9, is under 3e-7 even at n = -124, where the term is ~1e-37), p from a
 * near-minimax polynomial of degree 6 (2e-9 relative on |r| <= ln 2 / 2). Half the
 * instructions of exp_nonpositive in the loops below. */
static inline float exp_sum(float x) {
    /* 1.5 2^23 + 127: t rounds x log2(e) to an integer n and its low bits hold n + 127. */
    float t = x * 1.44269504088896341f + 12583039.0f;
    float r = fmaf(t - 12583039.0f, -0.693147180559945f, x);
    float p = 0.0013836845755577087f;
    p = p * r + 0.008374815806746483f;
    p = p * r + 0.04166822507977486f;
    p = p * r + 0.16666419804096222f;
    p = p * r + 0.49999991059303284f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits;
    memcpy(&bits, &t, 4);
    bits <<= 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}
#define EXP_SUM_CLAMP -86.0f

/* The fast path's two reads of a row with v_j = LOAD(x_j) * scale: its max (a NaN never wins
 * the comparison: it shows in the sums instead) and S = sum e^x, D = sum e^x x (where d is
 * not NULL) over x_j = max(v_j - m, EXP_SUM_CLAMP), one partial sum per vector lane. */
#define FAST_SUMS(NAME, T, LOAD)                                                \
    static inline float fast_max_##NAME(const void* data, int64_t V, float scale) {      \
        const T* row = data;                                                             \
        float m = -INFINITY;                                                             \
        _Pragma("omp simd reduction(max : m) simdlen(LANES)")                            \
        for (int64_t j = 0; j < V; ++j) {                                                \
            float v = LOAD(row[j]) * scale;                                              \
            m = v > m ? v : m;                                                           \
        }                                                                                \
        return m;                                                                        \
    }                                                                                    \
    static inline void fast_sums_##NAME(const void* data, int64_t V, float scale, float m, \
                                        float* sum_exp, float* dot) {                    \
        const T* row = data;                                                             \
        float s = 0.0f, d = 0.0f;                                                        \
        if (dot) {                                                                       \
            _Pragma("omp simd reduction(+ : s, d) simdlen(LANES)")                       \
            for (int64_t j = 0; j < V; ++j) {                                            \
                float u = LOAD(row[j]) * scale - m;                                      \
                float x = u < EXP_SUM_CLAMP ? EXP_SUM_CLAMP : u;                         \
                float e = exp_sum(x);                                                    \
                s += e;                                                                  \
                d += e * x;                                                              \
            }                                                                            \
            *dot = d;                                                                    \
        } else {                                                                         \
            _Pragma("omp simd reduction(+ : s) simdlen(LANES)")                          \
            for (int64_t j = 0; j < V; ++j) {                                            \
                float u = LOAD(row[j]) * scale - m;                                      \
                s += exp_sum(u < EXP_SUM_CLAMP ? EXP_SUM_CLAMP : u);                     \
            }                                                                            \
        }                                                                                \
        *sum_exp = s;                                                                    \
    }

/* fp16 by its bits: integer operations and one multiply, which vectorise on any CPU, where
 * GCC 12 leaves (float)h scalar without AVX512-FP16. The magnitude's bits, shifted into an
 * fp32's place (the row read as uint16_t), read as a number 2^112 too small (subnormals too:
 * the multiply normalises them); inf and NaN take the all-ones exponent. */
static inline float widen_f16(uint16_t b) {
    uint32_t magnitude = (uint32_t)(b & 0x7fffu) << 13;
    float f;
    memcpy(&f, &magnitude, 4);
    f *= 0x1p112f;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits = (b & 0x7fffu) >= 0x7c00u ? magnitude | 0x7f800000u : bits;
    bits |= (uint32_t)(b & 0x8000u) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

FAST_SUMS(f16, uint16_t, widen_f16)
FAST_SUMS(f32, float, from_f32)

/* bf16 reads its row a pair of logits per 32-bit word, each half shifted into place: two
 * plain operations for 32 logits where widening takes a shuffle for each 16 (the max and the
 * sums do not depend on the order). */
static inline float low_bf16(uint32_t w) { return from_bf16((uint16_t)w); }
static inline float high_bf16(uint32_t w) {
    uint32_t b = w & 0xffff0000u;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint32_t bf16_pair(const uint16_t* row, int64_t j) {
    uint32_t w;
    memcpy(&w, row + 2 * j, 4);
    return w;
}

static inline float fast_max_bf16(const uint16_t* row, int64_t V, float scale) {
    float m = V % 2 ? from_bf16(row[V - 1]) * scale : -INFINITY;
    _Pragma("omp simd reduction(max : m) simdlen(LANES)")
    for (int64_t j = 0; j < V / 2; ++j) {
        uint32_t w = bf16_pair(row, j);
        float a = low_bf16(w) * scale, b = high_bf16(w) * scale;
        float c = a > b ? a : b;
        m = c > m ? c : m;
    }
    return m;
}

static inline float clamp_sum(float u) { return u < EXP_SUM_CLAMP ? EXP_SUM_CLAMP : u; }

static inline void fast_sums_bf16(const uint16_t* row, int64_t V, float scale, float m,
                                  float* sum_exp, float* dot) {
    float x = V % 2 ? clamp_sum(from_bf16(row[V - 1]) * scale - m) : EXP_SUM_CLAMP;
    float e = V % 2 ? exp_sum(x) : 0.0f;
    /* The pair's halves in sums of their own: each term one fused multiply-add. */
    float s = e, d = e * x, s_high = 0.0f, d_high = 0.0f;
    if (dot) {
        _Pragma("omp simd reduction(+ : s, d, s_high, d_high) simdlen(LANES)")
        for (int64_t j = 0; j < V / 2; ++j) {
            uint32_t w = bf16_pair(row, j);
            float a = clamp_sum(low_bf16(w) * scale - m), b = clamp_sum(high_bf16(w) * scale - m);
            float ea = exp_sum(a), eb = exp_sum(b);
            s += ea;
            s_high += eb;
            d += ea * a;
            d_high += eb * b;
        }
        *dot = d + d_high;
    } else {
        _Pragma("omp simd reduction(+ : s, s_high) simdlen(LANES)")
        for (int64_t j = 0; j < V / 2; ++j) {
            uint32_t w = bf16_pair(row, j);
            s += exp_sum(clamp_sum(low_bf16(w) * scale - m));
            s_high += exp_sum(clamp_sum(high_bf16(w) * scale - m));
        }
    }
    *sum_exp = s + s_high;
}

/* The gradient's fast path for a half tile's row whose max m is finite (fast_grad_bf16,
 * fast_grad_f16): g_j = e_j (a + b (x_j - mu)) over the clamped x_j (exp_sum), e_j = 0 where
 * u_j is below the clamp (a masked class's gradient is exactly 0, times a NaN where the
 * row's coefficients hold one), rounded once to the tile's dtype; 0 where the row takes the
 * exact path (an infinite or NaN max). fp32 tiles always take it (fast_grad_f32), as in
 * fast_exps below. */
static inline float grad_term(float v, float m, float a, float b, float mu) {
    float u = v - m;
    float x = clamp_sum(u);
    float e = u < EXP_SUM_CLAMP ? 0.0f : exp_sum(x);
    return e * (a + b * (x - mu));
}

static inline int fast_grad_f16(void* data, int64_t V, float scale, float m, float a, float b,
                                float mu) {
    _Float16* row = data;
    if (!isfinite(m)) return 0;
    _Pragma("omp simd")
    for (int64_t j = 0; j < V; ++j)
        row[j] = to_f16(grad_term(from_f16(row[j]) * scale, m, a, b, mu));
    return 1;
}

/* bf16 a pair of logits per 32-bit word, as fast_sums_bf16, and both halves' gradients
 * written back as one word. */
static inline int fast_grad_bf16(void* data, int64_t V, float scale, float m, float a, float b,
                                 float mu) {
    uint16_t* row = data;
    if (!isfinite(m)) return 0;
    _Pragma("omp simd")
    for (int64_t j = 0; j < V / 2; ++j) {
        uint32_t w = bf16_pair(row, j);
        float low = grad_term(low_bf16(w) * scale, m, a, b, mu);
        float high = grad_term(high_bf16(w) * scale, m, a, b, mu);
        uint32_t out = (uint32_t)to_bf16(low) | (uint32_t)to_bf16(high) << 16;
        memcpy(row + 2 * j, &out, 4);
    }
    if (V % 2) row[V - 1] = to_bf16(grad_term(from_bf16(row[V - 1]) * scale, m, a, b, mu));
    return 1;
}

static inline int fast_grad_f32(void* data, int64_t V, float scale, float m, float a, float b,
                                float mu) {
    (void)data, (void)V, (void)scale, (void)m, (void)a, (void)b, (void)mu;
    return 0;
}

/* The fused loops' fast path for a half tile's row (fast_exps_bf16, fast_exps_f16): its max
 * m and, where m is finite, e_j = e^x_j (exp_sum; 0 where u_j is below the clamp, so that a
 * masked class's gradient is exactly 0) into e and their sum z; 0 where the row takes the
 * exact path (a NaN or infinite max, or a NaN in the sum). fp32 tiles always take it: their
 * gradients keep exp_nonpositive's 2-ulp exponentials (fast_exps_f32). */
#define FAST_EXPS(NAME, T, LOAD)                                                         \
    static inline int fast_exps_##NAME(const void* data, int64_t V, float scale, float* e, \
                                       float* row_max, float* sum_exp) {                 \
        const T* row = data;                                                             \
        float m = fast_max_##NAME(data, V, scale), s = 0.0f;                             \
        if (!isfinite(m)) return 0;                                                      \
        _Pragma("omp simd reduction(+ : s)")                                             \
        for (int64_t j = 0; j < V; ++j) {                                                \
            float u = LOAD(row[j]) * scale - m;                                          \
            float x = u < EXP_SUM_CLAMP ? 0.0f : exp_sum(clamp_sum(u));                  \
            e[j] = x;                                                                    \
            s += x;                                                                      \
        }                                                                                \
        *row_max = m;                                                                    \
        *sum_exp = s;                                                                    \
        return s == s;                                                                   \
    }

FAST_EXPS(bf16, uint16_t, from_bf16)
FAST_EXPS(f16, uint16_t, widen_f16)

static inline int fast_exps_f32(const void* data, int64_t V, float scale, float* e,
                                float* row_max, float* sum_exp) {
    (void)data, (void)V, (void)scale, (void)e, (void)row_max, (void)sum_exp;
    return 0;
}

/* The next row into the cache while this one's sums run: a tile just past a GEMM comes
 * back from memory, and the loops' reads alone leave it idle during each row's sums. */
static inline void prefetch_row(const void* row, int64_t bytes) {
    for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch((const char*)row + k, 0, 3);
}

#define ROW_MATH(NAME, T, LOAD, STORE)                                           \
    static inline float value_##NAME(T x, float scale) { return LOAD(x) * scale; }      \
                                                                                         \
    /* A row whose max is not finite or that holds a NaN: its max as torch.amax's (NaN   \
     * where a logit is NaN), and sums of NaN, as the sums of e^(v - m) are where some   \
     * v - m is (v = m = +-inf, or a NaN v); an empty row's are 0. */                    \
    static void nonfinite_row_##NAME(const T* row, int64_t V, float scale, float* row_max,\
                                     float* sum_exp, float* dot) {                       \
        float m = -INFINITY;                                                             \
        int nan = 0;                                                                     \
        for (int64_t j = 0; j < V; ++j) {                                                \
            float v = value_##NAME(row[j], scale);                                       \
            m = v > m ? v : m;                                                           \
            nan |= v != v;                                                               \
        }                                                                                \
        *row_max = nan ? NAN : m;                                                        \
        *sum_exp = V ? NAN : 0.0f;                                                       \
        if (dot) *dot = *sum_exp;                                                        \
    }                                                                                    \
                                                                                         \
    void lce_stats_##NAME(const T* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V, \
                          float scale, const int64_t* target, float* row_max,            \
                          float* sum_exp, float* dot, float* target_u) {                 \
        for (int64_t i = r0; i < r1; ++i) {                                              \
            const T* row = tile + i * ld;                                                \
            float m = fast_max_##NAME(row, V, scale), s = NAN;                            \
            if (i + 1 < r1) prefetch_row(row + ld, V * (int64_t)sizeof(T));              \
            if (isfinite(m)) fast_sums_##NAME(row, V, scale, m, &s, dot ? dot + i : NULL); \
            if (s == s) {                                                                \
                row_max[i] = m;                                                          \
                sum_exp[i] = s;                                                          \
            } else {                                                                     \
                nonfinite_row_##NAME(row, V, scale, row_max + i, sum_exp + i,            \
                                   dot ? dot + i : NULL);                                \
            }                                                                            \
            if (target_u) {                                                              \
                int64_t t = target[i];                                                   \
                target_u[i] = t >= 0 ? value_##NAME(row[t], scale) - row_max[i] : 0.0f;  \
            }                                                                            \
        }                                                                                \
    }                                                                                    \
                                                                                         \
    void lce_grad_##NAME(T* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V,         \
                         float scale, const float* row_max, const float* a,     \
                         const float* b, const float* mu, const int64_t* target,         \
                         const float* gamma) {                                           \
        for (int64_t i = r0; i < r1; ++i) {                                              \
            T* row = tile + i * ld;                                                      \
            float m = row_max[i], ai = a[i];                                             \
            int64_t t = target ? target[i] : -1;                                         \
            float g_t = 0.0f;                                                            \
            if (t >= 0) {                                                                \
                float u = value_##NAME(row[t], scale) - m;                    \
                float e = exp_nonpositive(u);                                            \
                g_t = !b ? e * ai : e == 0.0f ? e * (ai + b[i] + mu[i])                  \
                                              : e * (ai + b[i] * (u - mu[i]));           \
                g_t += gamma[i];                                                         \
            }                                                                            \
            int fast = fast_grad_##NAME(row, V, scale, m, ai, b ? b[i] : 0.0f,           \
                                        b ? mu[i] : 0.0f);                               \
            if (!fast && b) {                                                            \
                float bi = b[i], mi = mu[i];                                             \
                _Pragma("omp simd") for (int64_t j = 0; j < V; ++j) {                    \
                    float u = value_##NAME(row[j], scale) - m;                           \
                    float e = exp_nonpositive(u);                                        \
                    row[j] = STORE(e * (e == 0.0f ? ai + bi + mi : ai + bi * (u - mi))); \
                }                                                                        \
            } else if (!fast) {                                                          \
                _Pragma("omp simd") for (int64_t j = 0; j < V; ++j) {                    \
                    row[j] = STORE(exp_nonpositive(value_##NAME(row[j], scale) - m) * ai);\
                }                                                                        \
            }                                                                            \
            if (t >= 0) row[t] = STORE(g_t);                                             \
        }                                                                                \
    }


#define FUSED(NAME, T, STORE)                                                            \
    int lce_fused_##NAME(T* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V,         \
                         float scale, const int64_t* target, const float* c0,           \
                         const float* c1, const float* gamma, float* row_max,           \
                         float* sum_exp, float* target_u) {                              \
        float* e = aligned_alloc(64, (size_t)((V + 15) / 16) * 64);                      \
        if (!e) return -1;                                                               \
        for (int64_t i = r0; i < r1; ++i) {                                              \
            T* row = tile + i * ld;                                                      \
            float m, z;                                                                  \
            if (i + 1 < r1) prefetch_row(row + ld, V * (int64_t)sizeof(T));              \
            if (!fast_exps_##NAME(row, V, scale, e, &m, &z)) {                           \
                m = -INFINITY;                                                           \
                int nan = 0;                                                             \
                _Pragma("omp simd reduction(max : m) reduction(| : nan)")                \
                for (int64_t j = 0; j < V; ++j) {                                        \
                    float v = value_##NAME(row[j], scale);                               \
                    m = v > m ? v : m;                                                   \
                    nan |= v != v;                                                       \
                }                                                                        \
                if (nan) m = NAN;                                                        \
                float s[LANES] = {0};                                                    \
                int64_t whole = V - V % LANES;                                           \
                for (int64_t j = 0; j < whole; j += LANES) {                             \
                    _Pragma("omp simd") for (int k = 0; k < LANES; ++k) {                \
                        float x = exp_nonpositive(value_##NAME(row[j + k], scale) - m);  \
                        e[j + k] = x;                                                    \
                        s[k] += x;                                                       \
                    }                                                                    \
                }                                                                        \
                for (int64_t j = whole; j < V; ++j) {                                    \
                    e[j] = exp_nonpositive(value_##NAME(row[j], scale) - m);             \
                    s[j - whole] += e[j];                                                \
                }                                                                        \
                for (int width = LANES / 2; width > 0; width /= 2)                       \
                    for (int k = 0; k < width; ++k) s[k] += s[k + width];                \
                z = s[0];                                                                \
            }                                                                            \
            float a = c0[i];                                                             \
            if (c1[i] != 0.0f) a += c1[i] * (isinf(m) ? m : m + logf(z));               \
            a /= z;                                                                      \
            int64_t t = target[i];                                                       \
            row_max[i] = m;                                                              \
            sum_exp[i] = z;                                                              \
            target_u[i] = t >= 0 ? value_##NAME(row[t], scale) - m : 0.0f;               \
            _Pragma("omp simd") for (int64_t j = 0; j < V; ++j) row[j] = STORE(e[j] * a); \
            if (t >= 0) row[t] = STORE(e[t] * a + gamma[i]);                             \
        }                                                                                \
        free(e);                                                                         \
        return 0;                                                                        \
    }

ROW_MATH(bf16, uint16_t, from_bf16, to_bf16)
ROW_MATH(f16, _Float16, from_f16, to_f16)
ROW_MATH(f32, float, from_f32, to_f32)
FUSED(bf16, uint16_t, to_bf16)
FUSED(f16, _Float16, to_f16)
FUSED(f32, float, to_f32)

/* The rows [r0, r1) of a class-major tile: every pass walks the classes in order and,
 * for each, the rows' contiguous run, so the tile streams through the cache (a block of
 * rows walked class by class would touch a new page per class).
 *
 * cm_statistics: each row's max m, sum s of e^(v - m) and, where d is not NULL, sum d of
 * e^(v - m) (v - m); w = r1 - r0 rows; part, dpart (with d), me and nan are scratch of w
 * floats. Per block of 64 classes (in cache between its two reads): its max, the sums so
 * far rescaled when the block raises the max m to m' (s' = r s, d' = r (d - (m' - m) s),
 * r = e^(m - m')), then the block's terms added, four classes at a time in pairs: one
 * read of the tile from memory, ~(18 + V/64) roundings per sum. A NaN logit makes the
 * row's max and sums NaN, as
 * torch.amax and the sum of exp do. */
static void cm_statistics(const float* tile, int64_t ld, int64_t r0, int64_t w, int64_t V,
                          float scale, float* m, float* s, float* d, float* part, float* dpart,
                          float* me, float* nan) {
    for (int64_t k = 0; k < w; ++k) {
        m[k] = -INFINITY;
        s[k] = nan[k] = 0.0f;
        if (d) d[k] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < V; j0 += 64) {
        int64_t j1 = j0 + 64 < V ? j0 + 64 : V;
        for (int64_t k = 0; k < w; ++k) part[k] = -INFINITY;
        for (int64_t j = j0; j < j1; ++j) {
            const float* p = tile + j * ld + r0;
            _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) {
                float v = p[k] * scale;
                part[k] = v > part[k] ? v : part[k];
                nan[k] = v != v ? 1.0f : nan[k];
            }
        }
        if (d) {
            /* Before s is rescaled: d's shift takes the old s. While s is 0 (no term yet,
             * or every one underflowed) so is d, not r (0 - inf 0). */
            _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) {
                int grown = part[k] > m[k];
                float shifted = s[k] == 0.0f ? 0.0f
                    : exp_nonpositive(m[k] - part[k]) * (d[k] - (part[k] - m[k]) * s[k]);
                d[k] = grown ? shifted : d[k];
                dpart[k] = 0.0f;
            }
        }
        _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) {
            int grown = part[k] > m[k];
            s[k] = grown ? s[k] * exp_nonpositive(m[k] - part[k]) : s[k];
            m[k] = grown ? part[k] : m[k];
            /* While every class so far is -inf, so is this block's: its terms are 0, not
             * e^(-inf - (-inf)). */
            me[k] = m[k] == -INFINITY ? 0.0f : m[k];
            part[k] = 0.0f;
        }
        /* Four classes at a time, added in pairs before the running sum: a chain of
         * 16 + 2 roundings per block, not 64 (one chain's error exceeds the 2x bound of
         * tests/test_cpu_paths.py on CPUs whose fp32 GEMMs are themselves near it). */
        int64_t j4 = j0 + (j1 - j0) / 4 * 4;
        if (d) {
            for (int64_t j = j0; j < j4; j += 4) {
                const float* p = tile + j * ld + r0;
                _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) {
                    float u0 = p[k] * scale - me[k], u1 = p[k + ld] * scale - me[k];
                    float u2 = p[k + 2 * ld] * scale - me[k], u3 = p[k + 3 * ld] * scale - me[k];
                    float e0 = exp_nonpositive(u0), e1 = exp_nonpositive(u1);
                    float e2 = exp_nonpositive(u2), e3 = exp_nonpositive(u3);
                    part[k] += (e0 + e1) + (e2 + e3);
                    dpart[k] += (e0 * (u0 < -3.0e38f ? 0.0f : u0) + e1 * (u1 < -3.0e38f ? 0.0f : u1))
                              + (e2 * (u2 < -3.0e38f ? 0.0f : u2) + e3 * (u3 < -3.0e38f ? 0.0f : u3));
                }
            }
            for (int64_t j = j4; j < j1; ++j) {
                const float* p = tile + j * ld + r0;
                _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) {
                    float u = p[k] * scale - me[k];
                    float e = exp_nonpositive(u);
                    part[k] += e;
                    dpart[k] += e * (u < -3.0e38f ? 0.0f : u);
                }
            }
            _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) d[k] += dpart[k];
        } else {
            for (int64_t j = j0; j < j4; j += 4) {
                const float* p = tile + j * ld + r0;
                _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) {
                    float e0 = exp_nonpositive(p[k] * scale - me[k]);
                    float e1 = exp_nonpositive(p[k + ld] * scale - me[k]);
                    float e2 = exp_nonpositive(p[k + 2 * ld] * scale - me[k]);
                    float e3 = exp_nonpositive(p[k + 3 * ld] * scale - me[k]);
                    part[k] += (e0 + e1) + (e2 + e3);
                }
            }
            for (int64_t j = j4; j < j1; ++j) {
                const float* p = tile + j * ld + r0;
                _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) part[k] += exp_nonpositive(p[k] * scale - me[k]);
            }
        }
        _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) s[k] += part[k];
    }
    for (int64_t k = 0; k < w; ++k)
        if (nan[k] != 0.0f) {
            m[k] = s[k] = NAN;
            if (d) d[k] = NAN;
        }
}

int lce_fused_cm_f32(float* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V, float scale,
                     const int64_t* target, const float* c0, const float* c1, const float* gamma,
                     float* row_max, float* sum_exp, float* target_u) {
    int64_t w = r1 - r0;
    float* work = aligned_alloc(64, (size_t)((5 * w + 15) / 16) * 64);
    if (!work) return -1;
    float *m = work, *s = work + w, *part = work + 2 * w, *a = work + 3 * w, *me = work + 4 * w;
    /* a holds cm_statistics' NaN flags until it holds the rows' coefficients. */
    cm_statistics(tile, ld, r0, w, V, scale, m, s, NULL, part, NULL, me, a);
    for (int64_t k = 0; k < w; ++k) {
        int64_t i = r0 + k, t = target[i];
        float z = s[k];
        float u = t >= 0 ? tile[t * ld + i] * scale - m[k] : 0.0f;
        row_max[i] = m[k];
        sum_exp[i] = z;
        target_u[i] = u;
        a[k] = c0[i];
        if (c1[i] != 0.0f) a[k] += c1[i] * (isinf(m[k]) ? m[k] : m[k] + logf(z));
        a[k] /= z;
        part[k] = t >= 0 ? exp_nonpositive(u) * a[k] + gamma[i] : 0.0f;
    }
    for (int64_t j = 0; j < V; ++j) {
        float* p = tile + j * ld + r0;
        _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) p[k] = exp_nonpositive(p[k] * scale - m[k]) * a[k];
    }
    for (int64_t k = 0; k < w; ++k) {
        int64_t t = target[r0 + k];
        if (t >= 0) tile[t * ld + r0 + k] = part[k];
    }
    free(work);
    return 0;
}

/* Statistics of the rows [r0, r1) of a class-major fp32 tile, as lce_stats_f32's (dot and
 * target_u where not NULL), by cm_statistics. */
int lce_stats_cm_f32(const float* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V,
                     float scale, const int64_t* target, float* row_max, float* sum_exp,
                     float* dot, float* target_u) {
    int64_t w = r1 - r0;
    float* work = aligned_alloc(64, (size_t)((7 * w + 15) / 16) * 64);
    if (!work) return -1;
    float *m = work, *s = work + w, *d = dot ? work + 5 * w : NULL;
    cm_statistics(tile, ld, r0, w, V, scale, m, s, d, work + 2 * w, work + 6 * w, work + 3 * w,
                  work + 4 * w);
    for (int64_t k = 0; k < w; ++k) {
        int64_t i = r0 + k;
        row_max[i] = m[k];
        sum_exp[i] = s[k];
        if (dot) dot[i] = d[k];
        if (target_u) target_u[i] = target[i] >= 0 ? tile[target[i] * ld + i] * scale - m[k] : 0.0f;
    }
    free(work);
    return 0;
}

/* lce_grad_f32's gradient over the rows [r0, r1) of a class-major fp32 tile. */
int lce_grad_cm_f32(float* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V, float scale,
                    const float* row_max, const float* a, const float* b, const float* mu,
                    const int64_t* target, const float* gamma) {
    int64_t w = r1 - r0;
    const float *m = row_max + r0, *ai = a + r0;
    float* g_t = aligned_alloc(64, (size_t)((w + 15) / 16) * 64);
    if (!g_t) return -1;
    /* The target columns' values before the tile is overwritten. */
    for (int64_t k = 0; k < w; ++k) {
        int64_t i = r0 + k, t = target ? target[i] : -1;
        if (t < 0) continue;
        float u = tile[t * ld + i] * scale - m[k];
        float e = exp_nonpositive(u);
        g_t[k] = !b ? e * ai[k]
                    : e * (e == 0.0f ? ai[k] + b[i] + mu[i] : ai[k] + b[i] * (u - mu[i]));
        g_t[k] += gamma[i];
    }
    if (b) {
        const float *bi = b + r0, *mi = mu + r0;
        for (int64_t j = 0; j < V; ++j) {
            float* p = tile + j * ld + r0;
            _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) {
                float u = p[k] * scale - m[k];
                float e = exp_nonpositive(u);
                p[k] = e * (e == 0.0f ? ai[k] + bi[k] + mi[k] : ai[k] + bi[k] * (u - mi[k]));
            }
        }
    } else {
        for (int64_t j = 0; j < V; ++j) {
            float* p = tile + j * ld + r0;
            _Pragma("omp simd") for (int64_t k = 0; k < w; ++k) p[k] = exp_nonpositive(p[k] * scale - m[k]) * ai[k];
        }
    }
    for (int64_t k = 0; k < w; ++k) {
        int64_t t = target ? target[r0 + k] : -1;
        if (t >= 0) tile[t * ld + r0 + k] = g_t[k];
    }
    free(g_t);
    return 0;
}

/* log1p(y) for 0 <= y <= 1 (y = e^-|x| of a softplus): log(1 + y) by 2 atanh(f), f = (m - 1) /
 * (m + 1) on 1 + y = 2^k m, m in [sqrt(1/2), sqrt(2)) (|f| < 0.172: six terms, < 1e-9), times
 * y / ((1 + y) - 1), which restores the bits of y that 1 + y rounded off. */
static inline float log1p_unit(float y) {
    float x = 1.0f + y;
    int big = x >= 1.41421356f;
    float m = big ? 0.5f * x : x;
    float f = (m - 1.0f) / (m + 1.0f), f2 = f * f;
    float p = 1.0f / 11.0f;
    p = p * f2 + 1.0f / 9.0f;
    p = p * f2 + 1.0f / 7.0f;
    p = p * f2 + 1.0f / 5.0f;
    p = p * f2 + 1.0f / 3.0f;
    p = p * f2 + 1.0f;
    float log_x = (big ? 0.693147180559945f : 0.0f) + 2.0f * f * p;
    float d = x - 1.0f;
    return d == 0.0f ? y : log_x * (y / d);
}

/* The mixture's per-class terms from delta = log(beta q) - log((1 - beta) p) alone:
 * g = log p - log r = -log(1 - beta) - softplus(delta) and
 * hq = log q - log r = -log(beta) - softplus(-delta), each from its own small term
 * (softplus(x) = max(x, 0) + log1p(e^-|x|)), not as a difference of logs. */
static inline void mixture_terms(float delta, float log_beta, float log_rest, float* g,
                                 float* hq) {
    float l = log1p_unit(exp_nonpositive(-fabsf(delta)));
    l = delta != delta ? delta : l;
    *g = -((delta > 0.0f ? delta : 0.0f) + l + log_rest);
    *hq = -((delta < 0.0f ? -delta : 0.0f) + l + log_beta);
}

/* pair: the row math of a distillation loss on two row-major tiles of the same rows, the
 * student's s (row stride lds, overwritten by its gradient) and the teacher's t (ldt):
 *     u_j = s_j cs - m_s,  v_j = t_j ct - m_t,  Zs = sum e^u,  Zt = sum e^v,
 *     beta = 0 (forward KL): C = sum e^v (v - u);  beta = 1 (reverse KL): C = sum e^u (u - v);
 *     0 < beta < 1 (the mixture r = beta q + (1 - beta) p, once Zs and Zt are known):
 *     C = sum e^u g,  C2 = sum e^v hq (mixture_terms, delta = v - u + log Zs - log Zt
 *     + log(beta / (1 - beta))),
 *     where asked: E = sum e^u u (the student's entropy), Z1 = sum e^(power u) (power > 0:
 *     the hard term's normaliser at temperature 1), u_t (target[i] >= 0).
 * out is 9 rows of ld_out floats: m_s, Zs, m_t, Zt, C, E, Z1, u_t, C2 (0 where not formed).
 * Where w is not NULL, the gradient with row weight w[i], hard weight h, T' = power or 1:
 *     forward: g_j = w (1 + h') e^u_j / Zs - w e^v_j / Zt
 *     reverse: g_j = w e^u_j (u_j - v_j - C/Zs + h') / Zs
 *     mixture: g_j = w e^u_j ((1 - beta)(g_j - C/Zs) + h') / Zs
 *     each plus w h power e^(power u_j) / Z1 where power > 0, and -w h T' at the target,
 * h' = h where the hard term has no own normaliser (target given, power == 0), else 0.
 * A row is read from memory once: its max, then its sums (e^u and e^v, or the mixture's g,
 * kept in fp32 scratch), then its gradient, while both rows sit in the core's cache. A
 * factor e that is 0 makes its product 0 (a masked class: the limit, not 0 * inf). */
#define PAIR(NAME, T, LOAD, STORE)                                                           \
    int lce_pair_##NAME(T* s, int64_t lds, const T* t, int64_t ldt, int64_t r0, int64_t r1,  \
                        int64_t V, float cs, float ct, float beta, float power, int entropy, \
                        const int64_t* target, float h, const float* w, float* out,          \
                        int64_t ld_out) {                                                    \
        int mode = beta == 0.0f ? 0 : beta == 1.0f ? 1 : 2;                                  \
        float log_beta = mode == 2 ? logf(beta) : 0.0f;                                      \
        float log_rest = mode == 2 ? log1pf(-beta) : 0.0f;                                   \
        float* eu = aligned_alloc(64, (size_t)((V + 15) / 16) * 64 * 2);                     \
        if (!eu) return -1;                                                                  \
        float* ev = eu + (V + 15) / 16 * 16;                                                 \
        for (int64_t i = r0; i < r1; ++i) {                                                  \
            T* srow = s + i * lds;                                                           \
            const T* trow = t + i * ldt;                                                     \
            float ms = -INFINITY, mt = -INFINITY;                                            \
            int nan = 0;                                                                     \
            _Pragma("omp simd reduction(max : ms, mt) reduction(| : nan)")                   \
            for (int64_t j = 0; j < V; ++j) {                                                \
                float a = LOAD(srow[j]) * cs, b = LOAD(trow[j]) * ct;                        \
                ms = a > ms ? a : ms;                                                        \
                mt = b > mt ? b : mt;                                                        \
                nan |= (a != a) | (b != b);                                                  \
            }                                                                                \
            if (nan) ms = mt = NAN;                                                          \
            float zs[LANES] = {0}, zt[LANES] = {0}, c[LANES] = {0}, d[LANES] = {0};          \
            float z1[LANES] = {0}, c2[LANES] = {0};                                          \
            int64_t whole = V - V % LANES;                                                   \
            for (int64_t j0 = 0; j0 < V; j0 += LANES) {                                      \
                int64_t n = j0 < whole ? LANES : V - whole;                                  \
                _Pragma("omp simd") for (int k = 0; k < n; ++k) {                            \
                    float u = LOAD(srow[j0 + k]) * cs - ms;                                  \
                    float v = LOAD(trow[j0 + k]) * ct - mt;                                  \
                    float a = exp_nonpositive(u), b = exp_nonpositive(v);                    \
                    eu[j0 + k] = a;                                                          \
                    ev[j0 + k] = b;                                                          \
                    zs[k] += a;                                                              \
                    zt[k] += b;                                                              \
                    if (mode == 0) c[k] += b == 0.0f ? 0.0f : b * (v - u);                   \
                    if (mode == 1) c[k] += a == 0.0f ? 0.0f : a * (u - v);                   \
                }                                                                            \
                if (entropy) {                                                               \
                    _Pragma("omp simd") for (int k = 0; k < n; ++k) {                        \
                        float a = eu[j0 + k];                                                \
                        d[k] += a == 0.0f ? 0.0f : a * (LOAD(srow[j0 + k]) * cs - ms);       \
                    }                                                                        \
                }                                                                            \
                if (power > 0.0f) {                                                          \
                    _Pragma("omp simd") for (int k = 0; k < n; ++k)                          \
                        z1[k] += exp_nonpositive(power * (LOAD(srow[j0 + k]) * cs - ms));    \
                }                                                                            \
            }                                                                                \
            for (int width = LANES / 2; width > 0; width /= 2) {                             \
                for (int k = 0; k < width; ++k) {                                            \
                    zs[k] += zs[k + width];                                                  \
                    zt[k] += zt[k + width];                                                  \
                    c[k] += c[k + width];                                                    \
                    d[k] += d[k + width];                                                    \
                    z1[k] += z1[k + width];                                                  \
                }                                                                            \
            }                                                                                \
            if (mode == 2) {                                                                 \
                /* ev <- g: the gradient needs g, the loss Σ e^v hq, formed here. */         \
                float shift = logf(zs[0]) - logf(zt[0]) + log_beta - log_rest;               \
                for (int64_t j0 = 0; j0 < V; j0 += LANES) {                                  \
                    int64_t n = j0 < whole ? LANES : V - whole;                              \
                    _Pragma("omp simd") for (int k = 0; k < n; ++k) {                        \
                        float u = LOAD(srow[j0 + k]) * cs - ms;                              \
                        float v = LOAD(trow[j0 + k]) * ct - mt;                              \
                        float g, hq, a = eu[j0 + k], b = ev[j0 + k];                         \
                        mixture_terms((v - u) + shift, log_beta, log_rest, &g, &hq);         \
                        c[k] += a == 0.0f ? 0.0f : a * g;                                    \
                        c2[k] += b == 0.0f ? 0.0f : b * hq;                                  \
                        ev[j0 + k] = g;                                                      \
                    }                                                                        \
                }                                                                            \
                for (int width = LANES / 2; width > 0; width /= 2) {                         \
                    for (int k = 0; k < width; ++k) {                                        \
                        c[k] += c[k + width];                                                \
                        c2[k] += c2[k + width];                                              \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            int64_t tg = target ? target[i] : -1;                                            \
            float ut = tg >= 0 ? LOAD(srow[tg]) * cs - ms : 0.0f;                            \
            float* o = out + i;                                                              \
            o[0] = ms;                                                                       \
            o[ld_out] = zs[0];                                                               \
            o[2 * ld_out] = mt;                                                              \
            o[3 * ld_out] = zt[0];                                                           \
            o[4 * ld_out] = c[0];                                                            \
            o[5 * ld_out] = d[0];                                                            \
            o[6 * ld_out] = z1[0];                                                           \
            o[7 * ld_out] = ut;                                                              \
            o[8 * ld_out] = c2[0];                                                           \
            if (!w) continue;                                                                \
            float wi = w[i], soft = target && power == 0.0f ? h : 0.0f;                      \
            float as = wi / zs[0], at = -wi / zt[0], mu = c[0] / zs[0], rest = 1.0f - beta;  \
            float az = power > 0.0f ? wi * h * power / z1[0] : 0.0f;                         \
            float a1 = as * (1.0f + soft), gt = 0.0f;                                        \
            if (tg >= 0) {                                                                   \
                float a = eu[tg], vt = LOAD(trow[tg]) * ct - mt;                             \
                gt = mode == 0   ? a1 * a + at * ev[tg]                                      \
                     : a == 0.0f ? 0.0f                                                      \
                     : mode == 1 ? as * a * (((ut - vt) - mu) + soft)                        \
                                 : as * a * (rest * (ev[tg] - mu) + soft);                   \
                if (power > 0.0f) gt += az * exp_nonpositive(power * ut);                    \
            }                                                                                \
            if (power > 0.0f) {                                                              \
                _Pragma("omp simd") for (int64_t j = 0; j < V; ++j) {                        \
                    float u = LOAD(srow[j]) * cs - ms, a = eu[j];                            \
                    float dj = u - (LOAD(trow[j]) * ct - mt);                                \
                    float g = mode == 0   ? a1 * a + at * ev[j]                              \
                              : a == 0.0f ? 0.0f                                             \
                              : mode == 1 ? as * a * (dj - mu)                               \
                                          : as * a * (rest * (ev[j] - mu));                  \
                    srow[j] = STORE(g + az * exp_nonpositive(power * u));                    \
                }                                                                            \
            } else if (mode == 0) {                                                          \
                _Pragma("omp simd") for (int64_t j = 0; j < V; ++j)                          \
                    srow[j] = STORE(a1 * eu[j] + at * ev[j]);                                \
            } else if (mode == 1) {                                                          \
                _Pragma("omp simd") for (int64_t j = 0; j < V; ++j) {                        \
                    float a = eu[j];                                                         \
                    float dj = (LOAD(srow[j]) * cs - ms) - (LOAD(trow[j]) * ct - mt);        \
                    srow[j] = STORE(a == 0.0f ? 0.0f : as * a * ((dj - mu) + soft));         \
                }                                                                            \
            } else {                                                                         \
                _Pragma("omp simd") for (int64_t j = 0; j < V; ++j) {                        \
                    float a = eu[j];                                                         \
                    srow[j] = STORE(a == 0.0f ? 0.0f : as * a * (rest * (ev[j] - mu) + soft)); \
                }                                                                            \
            }                                                                                \
            if (tg >= 0) srow[tg] = STORE(gt - wi * h * (power > 0.0f ? power : 1.0f));     \
        }                                                                                    \
        free(eu);                                                                            \
        return 0;                                                                            \
    }

PAIR(bf16, uint16_t, from_bf16, to_bf16)
PAIR(f16, _Float16, from_f16, to_f16)
PAIR(f32, float, from_f32, to_f32)

/* pair_cm: pair's sums and gradient over the rows [r0, r1) of two class-major fp32 tiles
 * (ld: their class strides), vectorised over rows as cm_statistics: per block of 64
 * classes (in cache between its two reads) the blocks' maxima, the sums so far rescaled
 * where a block raises a row's max (m_s to m_s' by ds, m_t to m_t' by dt; e.g. forward
 * C' = r_t (C - (dt - ds) Zt), r_t = e^(-dt); reverse C' = r_s (C - (ds - dt) Zs);
 * E' = r_s (E - ds Zs)), then the block's terms; the mixture's C and C2 in one more pass
 * (they need Zs and Zt); then, where w is not NULL, the gradient in one more pass, its
 * terms formed again. A max still -inf moves by 0 (its sums are 0, or the divergence's
 * infinity, which stays). */
int lce_pair_cm_f32(float* s, int64_t lds, const float* t, int64_t ldt, int64_t r0, int64_t r1,
                    int64_t V, float cs, float ct, float beta, float power, int entropy,
                    const int64_t* target, float h, const float* w, float* out, int64_t ld_out) {
    int mode = beta == 0.0f ? 0 : beta == 1.0f ? 1 : 2;
    float log_beta = mode == 2 ? logf(beta) : 0.0f, log_rest = mode == 2 ? log1pf(-beta) : 0.0f;
    float rest = 1.0f - beta;
    int64_t n = r1 - r0;
    float* work = aligned_alloc(64, (size_t)((18 * n + 15) / 16) * 64);
    if (!work) return -1;
    float *ms = work, *zs = work + n, *mt = work + 2 * n, *zt = work + 3 * n, *c = work + 4 * n;
    float *d = work + 5 * n, *z1 = work + 6 * n, *bs = work + 7 * n, *bt = work + 8 * n;
    float *ps = work + 9 * n, *pt = work + 10 * n, *pc = work + 11 * n, *pd = work + 12 * n;
    float *pz = work + 13 * n, *nan = work + 14 * n, *ut = work + 15 * n, *c2 = work + 16 * n;
    float* shift = work + 17 * n;
    for (int64_t k = 0; k < n; ++k) {
        ms[k] = mt[k] = -INFINITY;
        zs[k] = zt[k] = c[k] = d[k] = z1[k] = nan[k] = c2[k] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < V; j0 += 64) {
        int64_t j1 = j0 + 64 < V ? j0 + 64 : V;
        for (int64_t k = 0; k < n; ++k) bs[k] = bt[k] = -INFINITY;
        for (int64_t j = j0; j < j1; ++j) {
            const float *p = s + j * lds + r0, *q = t + j * ldt + r0;
            _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                float a = p[k] * cs, b = q[k] * ct;
                bs[k] = a > bs[k] ? a : bs[k];
                bt[k] = b > bt[k] ? b : bt[k];
                nan[k] = (a != a) | (b != b) ? 1.0f : nan[k];
            }
        }
        _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
            float ns = bs[k] > ms[k] ? bs[k] : ms[k], nt = bt[k] > mt[k] ? bt[k] : mt[k];
            float ds = ms[k] == -INFINITY ? 0.0f : ns - ms[k];
            float dt = mt[k] == -INFINITY ? 0.0f : nt - mt[k];
            float rs = exp_nonpositive(-ds), rt = exp_nonpositive(-dt);
            if (mode == 1)
                c[k] = zs[k] == 0.0f ? c[k] : rs * (c[k] - (ds - dt) * zs[k]);
            else if (mode == 0)
                c[k] = zt[k] == 0.0f ? c[k] : rt * (c[k] - (dt - ds) * zt[k]);
            /* The entropy's sum only where asked: else it stays 0, as the row-major loop's. */
            d[k] = !entropy || zs[k] == 0.0f ? d[k] : rs * (d[k] - ds * zs[k]);
            z1[k] *= exp_nonpositive(-power * ds);
            zs[k] *= rs;
            zt[k] *= rt;
            ms[k] = ns;
            mt[k] = nt;
            /* While every class so far is -inf, so is this block's: its terms are 0. */
            bs[k] = ns == -INFINITY ? 0.0f : ns;
            bt[k] = nt == -INFINITY ? 0.0f : nt;
            ps[k] = pt[k] = pc[k] = pd[k] = pz[k] = 0.0f;
        }
        for (int64_t j = j0; j < j1; ++j) {
            const float *p = s + j * lds + r0, *q = t + j * ldt + r0;
            if (mode == 1) {
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                    float u = p[k] * cs - bs[k], v = q[k] * ct - bt[k];
                    float a = exp_nonpositive(u), b = exp_nonpositive(v);
                    ps[k] += a;
                    pt[k] += b;
                    pc[k] += a == 0.0f ? 0.0f : a * (u - v);
                }
            } else if (mode == 0) {
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                    float u = p[k] * cs - bs[k], v = q[k] * ct - bt[k];
                    float a = exp_nonpositive(u), b = exp_nonpositive(v);
                    ps[k] += a;
                    pt[k] += b;
                    pc[k] += b == 0.0f ? 0.0f : b * (v - u);
                }
            } else {
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                    ps[k] += exp_nonpositive(p[k] * cs - bs[k]);
                    pt[k] += exp_nonpositive(q[k] * ct - bt[k]);
                }
            }
            if (entropy) {
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                    float u = p[k] * cs - bs[k], a = exp_nonpositive(u);
                    pd[k] += a == 0.0f ? 0.0f : a * u;
                }
            }
            if (power > 0.0f) {
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k)
                    pz[k] += exp_nonpositive(power * (p[k] * cs - bs[k]));
            }
        }
        _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
            zs[k] += ps[k];
            zt[k] += pt[k];
            c[k] += pc[k];
            d[k] += pd[k];
            z1[k] += pz[k];
        }
    }
    if (mode == 2) {
        for (int64_t k = 0; k < n; ++k) shift[k] = logf(zs[k]) - logf(zt[k]) + log_beta - log_rest;
        /* Summed a block of 64 classes at a time, then added: ~(64 + V/64) roundings. */
        for (int64_t j0 = 0; j0 < V; j0 += 64) {
            int64_t j1 = j0 + 64 < V ? j0 + 64 : V;
            for (int64_t k = 0; k < n; ++k) pc[k] = pt[k] = 0.0f;
            for (int64_t j = j0; j < j1; ++j) {
                const float *p = s + j * lds + r0, *q = t + j * ldt + r0;
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                    float u = p[k] * cs - ms[k], v = q[k] * ct - mt[k], g, hq;
                    float a = exp_nonpositive(u), b = exp_nonpositive(v);
                    mixture_terms((v - u) + shift[k], log_beta, log_rest, &g, &hq);
                    pc[k] += a == 0.0f ? 0.0f : a * g;
                    pt[k] += b == 0.0f ? 0.0f : b * hq;
                }
            }
            _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                c[k] += pc[k];
                c2[k] += pt[k];
            }
        }
    }
    for (int64_t k = 0; k < n; ++k) {
        int64_t i = r0 + k, tg = target ? target[i] : -1;
        if (nan[k] != 0.0f) ms[k] = mt[k] = zs[k] = zt[k] = c[k] = d[k] = z1[k] = c2[k] = NAN;
        ut[k] = tg >= 0 ? s[tg * lds + i] * cs - ms[k] : 0.0f;
        float* o = out + i;
        o[0] = ms[k];
        o[ld_out] = zs[k];
        o[2 * ld_out] = mt[k];
        o[3 * ld_out] = zt[k];
        o[4 * ld_out] = c[k];
        o[5 * ld_out] = d[k];
        o[6 * ld_out] = z1[k];
        o[7 * ld_out] = ut[k];
        o[8 * ld_out] = c2[k];
    }
    if (w) {
        /* Per row: bs the student's coefficient w / Zs, bt the teacher's, pc mu (C / Zs), pz
         * the hard normaliser's, pd the target's final value. */
        float soft = target && power == 0.0f ? h : 0.0f;
        for (int64_t k = 0; k < n; ++k) {
            int64_t i = r0 + k, tg = target ? target[i] : -1;
            float wi = w[i];
            bs[k] = wi / zs[k];
            bt[k] = -wi / zt[k];
            pc[k] = c[k] / zs[k];
            pz[k] = power > 0.0f ? wi * h * power / z1[k] : 0.0f;
            if (tg < 0) continue;
            float u = ut[k], v = t[tg * ldt + i] * ct - mt[k];
            float a = exp_nonpositive(u), g, gm, hq;
            if (mode == 0) {
                g = bs[k] * (1.0f + soft) * a + bt[k] * exp_nonpositive(v);
            } else if (mode == 1) {
                g = a == 0.0f ? 0.0f : bs[k] * a * (((u - v) - pc[k]) + soft);
            } else {
                mixture_terms((v - u) + shift[k], log_beta, log_rest, &gm, &hq);
                g = a == 0.0f ? 0.0f : bs[k] * a * (rest * (gm - pc[k]) + soft);
            }
            if (power > 0.0f) g += pz[k] * exp_nonpositive(power * u);
            pd[k] = g - wi * h * (power > 0.0f ? power : 1.0f);
        }
        for (int64_t j = 0; j < V; ++j) {
            float* p = s + j * lds + r0;
            const float* q = t + j * ldt + r0;
            if (mode == 0) {
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                    float u = p[k] * cs - ms[k], v = q[k] * ct - mt[k];
                    float g = bs[k] * (1.0f + soft) * exp_nonpositive(u)
                        + bt[k] * exp_nonpositive(v);
                    p[k] = power > 0.0f ? g + pz[k] * exp_nonpositive(power * u) : g;
                }
            } else if (mode == 1) {
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                    float u = p[k] * cs - ms[k], v = q[k] * ct - mt[k];
                    float a = exp_nonpositive(u);
                    float g = a == 0.0f ? 0.0f : bs[k] * a * (((u - v) - pc[k]) + soft);
                    p[k] = power > 0.0f ? g + pz[k] * exp_nonpositive(power * u) : g;
                }
            } else {
                _Pragma("omp simd") for (int64_t k = 0; k < n; ++k) {
                    float u = p[k] * cs - ms[k], v = q[k] * ct - mt[k], gm, hq;
                    float a = exp_nonpositive(u);
                    mixture_terms((v - u) + shift[k], log_beta, log_rest, &gm, &hq);
                    float g = a == 0.0f ? 0.0f : bs[k] * a * (rest * (gm - pc[k]) + soft);
                    p[k] = power > 0.0f ? g + pz[k] * exp_nonpositive(power * u) : g;
                }
            }
        }
        for (int64_t k = 0; k < n; ++k) {
            int64_t tg = target ? target[r0 + k] : -1;
            if (tg >= 0) s[tg * lds + r0 + k] = pd[k];
        }
    }
    free(work);
    return 0;
}

/* The kernels over rows [r0, r1) split into `threads` ranges (starts multiples of `align`:
 * a class-major tile's runs of 16 rows), run in an OpenMP parallel region where the build
 * has OpenMP (lce_openmp): the runtime torch's own GEMMs use (libgomp, found loaded by its
 * name), whose workers spin for a while after each GEMM and would take a core from any
 * other thread; a plain build runs the ranges in turn. Each returns non-zero where a range
 * found no memory for its scratch. */
#define UNPACK(...) __VA_ARGS__
static inline int64_t range_start(int64_t lo, int64_t hi, int k, int threads, int64_t align) {
    int64_t at = lo + (hi - lo) * k / threads / align * align;
    return k == threads ? hi : at < hi ? at : hi;
}
#define PARALLEL(NAME, CALL, PARAMS, ARGS)                                                  \
    int NAME##_par(int threads, int64_t align, UNPACK PARAMS) {                             \
        int failed = 0;                                                                     \
        int64_t lo = r0, hi = r1;                                                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static, 1) reduction(| : failed)") \
        for (int k = 0; k < threads; ++k) {                                                 \
            int64_t r0 = range_start(lo, hi, k, threads, align);                            \
            int64_t r1 = range_start(lo, hi, k + 1, threads, align);                        \
            if (r1 > r0) failed |= CALL(NAME(UNPACK ARGS));                                 \
        }                                                                                   \
        return failed;                                                                      \
    }
#define RETURNS(x) ((x) != 0)
#define VOID(x) ((x), 0)
#define STATS_PARAMS(T) (const T* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V,       \
                         float scale, const int64_t* target, float* row_max, float* sum_exp,  \
                         float* dot, float* target_u)
#define STATS_ARGS (tile, ld, r0, r1, V, scale, target, row_max, sum_exp, dot, target_u)
#define GRAD_PARAMS(T) (T* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V, float scale,  \
                        const float* row_max, const float* a, const float* b, const float* mu, \
                        const int64_t* target, const float* gamma)
#define GRAD_ARGS (tile, ld, r0, r1, V, scale, row_max, a, b, mu, target, gamma)
#define FUSED_PARAMS(T) (T* tile, int64_t ld, int64_t r0, int64_t r1, int64_t V, float scale, \
                         const int64_t* target, const float* c0, const float* c1,             \
                         const float* gamma, float* row_max, float* sum_exp, float* target_u)
#define FUSED_ARGS (tile, ld, r0, r1, V, scale, target, c0, c1, gamma, row_max, sum_exp, target_u)
#define PAIR_PARAMS(T) (T* s, int64_t lds, const T* t, int64_t ldt, int64_t r0, int64_t r1,   \
                        int64_t V, float cs, float ct, float beta, float power, int entropy,  \
                        const int64_t* target, float h, const float* w, float* out,           \
                        int64_t ld_out)
#define PAIR_ARGS (s, lds, t, ldt, r0, r1, V, cs, ct, beta, power, entropy, target, h, w, out, ld_out)
#define ALL_PARALLEL(NAME, T)                                                               \
    PARALLEL(lce_stats_##NAME, VOID, STATS_PARAMS(T), STATS_ARGS)                           \
    PARALLEL(lce_grad_##NAME, VOID, GRAD_PARAMS(T), GRAD_ARGS)                              \
    PARALLEL(lce_fused_##NAME, RETURNS, FUSED_PARAMS(T), FUSED_ARGS)                        \
    PARALLEL(lce_pair_##NAME, RETURNS, PAIR_PARAMS(T), PAIR_ARGS)

ALL_PARALLEL(bf16, uint16_t)
ALL_PARALLEL(f16, _Float16)
ALL_PARALLEL(f32, float)
PARALLEL(lce_stats_cm_f32, RETURNS, STATS_PARAMS(float), STATS_ARGS)
PARALLEL(lce_grad_cm_f32, RETURNS, GRAD_PARAMS(float), GRAD_ARGS)
PARALLEL(lce_fused_cm_f32, RETURNS, FUSED_PARAMS(float), FUSED_ARGS)
PARALLEL(lce_pair_cm_f32, RETURNS, PAIR_PARAMS(float), PAIR_ARGS)

/* Whether this build runs the ranges in parallel (OpenMP). */
int lce_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
