// Decode attention on the CPU, reading K/V in place through block tables.
//
// One query token per sequence (the decode rows of a step). For each
// (sequence, kv head) the G query heads that share the kv head are done
// together, so each K and V row is loaded once: scores q.k over the context,
// a softmax, then the probability-weighted sum of V. Nothing is gathered: the
// torch path copies every sequence's K/V out of the pool first, which on the
// CPU costs more than the attention itself. head_dim and the group size are
// template parameters so the compiler unrolls and vectorizes the inner loops;
// other shapes return -1 and the caller uses the torch path.
//
// Layouts (contiguous), as kv_cache.PagedKVCache holds them:
//   q, out        [num_seqs, num_heads, head_dim] float32
//   k/v cache     [num_kv_heads, num_blocks, block_size, head_dim] (one layer), float32
//                 or bfloat16 (read as uint16 bit patterns, widened exactly to float32:
//                 the arithmetic is float32 either way, as vLLM's CPU attention does)
//   tables        [num_seqs, max_blocks] block ids; lens [num_seqs] context lengths
//   scratch       at least G * max(lens) floats
// window > 0: a sequence of length L sees only its last `window` tokens.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

namespace {

using bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
    const uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16 *p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The four sums of v0..v3 (16 lanes each), as one [sum v0, sum v1, sum v2, sum v3].
inline __m128 sum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// Scores of 4 consecutive tokens (rows k, k + D, ...) for query heads j0..j0+3:
// one FMA per 16 dims per (head, token), reduced four at a time.
template <int D, int G, typename T>
inline void scores_4x4(const float (*qs)[D], int j0, const T *k, float *s, int64_t n) {
    __m512 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int t = 0; t < 4; t++) acc[j][t] = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 16) {
        __m512 kv[4];
        for (int t = 0; t < 4; t++) kv[t] = load16(k + t * D + c);
        for (int j = 0; j < 4; j++) {
            const __m512 qv = _mm512_loadu_ps(&qs[j0 + j][c]);
            for (int t = 0; t < 4; t++) acc[j][t] = _mm512_fmadd_ps(qv, kv[t], acc[j][t]);
        }
    }
    for (int j = 0; j < 4; j++)
        _mm_storeu_ps(s + (j0 + j) * n, sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}
#endif

template <int D, int G, typename T>
inline void scores_1(const float (*qs)[D], const T *k, float *s, int64_t n) {
    for (int j = 0; j < G; j++) {
        float acc = 0.f;
        for (int i = 0; i < D; i++) acc += qs[j][i] * to_float(k[i]);
        s[j * n] = acc;
    }
}

// Blocks sit anywhere in the pool, so each one starts with a cache miss that the
// hardware prefetcher cannot foresee: ask for the next K block, and for this
// block's V (read after the softmax), while this block's scores are computed.
template <typename T>
inline void prefetch(const T *block, int64_t values) {
    const char *bytes = reinterpret_cast<const char *>(block);
    for (int64_t i = 0; i < values * int64_t(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 3);
}

template <int D, int G, typename T>
void attend(const float *q, const T *k_head, const T *v_head, const int64_t *table,
            int64_t first, int64_t len, int64_t bs, float scale, float *s, float *out) {
    const int64_t n = len - first;
    float qs[G][D];
    for (int j = 0; j < G; j++)
        for (int i = 0; i < D; i++) qs[j][i] = q[j * D + i] * scale;
    for (int64_t t = first; t < len;) {  // scores, block by block
        const int64_t b = t / bs, end = std::min(len, (b + 1) * bs);
        const T *k = k_head + (table[b] * bs + (t - b * bs)) * D;
        if (end < len) prefetch(k_head + table[b + 1] * bs * D, bs * D);
        prefetch(v_head + table[b] * bs * D, bs * D);
#if defined(__AVX512F__) && defined(__AVX512DQ__)
        if constexpr (G % 4 == 0 && D % 16 == 0)
            for (; t + 4 <= end; t += 4, k += 4 * D)
                for (int j0 = 0; j0 < G; j0 += 4) scores_4x4<D, G, T>(qs, j0, k, s + (t - first), n);
#endif
        for (; t < end; t++, k += D) scores_1<D, G, T>(qs, k, s + (t - first), n);
    }
    for (int j = 0; j < G; j++) {  // softmax (scores are finite: no masked slots)
        float *sj = s + j * n, m = sj[0], sum = 0.f;
        for (int64_t t = 1; t < n; t++) m = std::max(m, sj[t]);
        for (int64_t t = 0; t < n; t++) {
            sj[t] = std::exp(sj[t] - m);
            sum += sj[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; t++) sj[t] *= inv;
    }
    float acc[G][D] = {};
    for (int64_t t = first; t < len;) {  // probabilities times V
        const int64_t b = t / bs, end = std::min(len, (b + 1) * bs);
        const T *v = v_head + (table[b] * bs + (t - b * bs)) * D;
        for (; t < end; t++, v += D) {
            float vf[D];
            for (int i = 0; i < D; i++) vf[i] = to_float(v[i]);
            for (int j = 0; j < G; j++) {
                const float p = s[j * n + (t - first)];
                for (int i = 0; i < D; i++) acc[j][i] += p * vf[i];
            }
        }
    }
    std::memcpy(out, acc, sizeof(acc));
}

template <int D, int G, typename T>
void run(const float *q, const T *k_cache, const T *v_cache, const int64_t *tables,
         const int64_t *lens, float *out, float *scratch, int64_t num_seqs, int64_t num_kv_heads,
         int64_t num_blocks, int64_t bs, int64_t max_blocks, int64_t window, float scale) {
    const int64_t head_stride = num_blocks * bs * D, H = num_kv_heads * G;
    for (int64_t r = 0; r < num_seqs; r++) {
        const int64_t len = lens[r], first = (window > 0 && len > window) ? len - window : 0;
        for (int64_t h = 0; h < num_kv_heads; h++)
            attend<D, G, T>(q + (r * H + h * G) * D, k_cache + h * head_stride,
                         v_cache + h * head_stride, tables + r * max_blocks, first, len, bs, scale,
                         scratch, out + (r * H + h * G) * D);
    }
}

}  // namespace

extern "C" int kvengine_supports(int64_t head_dim, int64_t group) {
    const bool dim = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
    const bool grp = group == 1 || group == 2 || group == 4 || group == 8;
    return dim && grp;
}

template <typename T>
int dispatch(const float *q, const T *k_cache, const T *v_cache, const int64_t *tables,
             const int64_t *lens, float *out, float *scratch, int64_t num_seqs, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
             int64_t max_blocks, int64_t window, float scale) {
    const int64_t g = num_heads / num_kv_heads;
#define KV_CASE(D_, G_)                                                                         \
    if (head_dim == D_ && g == G_) {                                                            \
        run<D_, G_, T>(q, k_cache, v_cache, tables, lens, out, scratch, num_seqs, num_kv_heads, \
                       num_blocks, block_size, max_blocks, window, scale);                      \
        return 0;                                                                               \
    }
#define KV_CASES(D_) KV_CASE(D_, 1) KV_CASE(D_, 2) KV_CASE(D_, 4) KV_CASE(D_, 8)
    KV_CASES(16) KV_CASES(32) KV_CASES(64) KV_CASES(128)
#undef KV_CASES
#undef KV_CASE
    return -1;
}

// kv_bf16: the caches hold bfloat16 (else float32).
extern "C" int kvengine_paged_decode_attention(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
    const int64_t *lens, float *out, float *scratch, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
    int64_t max_blocks, int64_t window, float scale, int64_t kv_bf16) {
    if (kv_bf16)
        return dispatch(q, static_cast<const bf16 *>(k_cache), static_cast<const bf16 *>(v_cache),
                        tables, lens, out, scratch, num_seqs, num_heads, num_kv_heads, head_dim,
                        num_blocks, block_size, max_blocks, window, scale);
    return dispatch(q, static_cast<const float *>(k_cache), static_cast<const float *>(v_cache),
                    tables, lens, out, scratch, num_seqs, num_heads, num_kv_heads, head_dim,
                    num_blocks, block_size, max_blocks, window, scale);
}
