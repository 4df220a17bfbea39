// Exact greedy tokens from a float32 lm_head through an int8 screen (AVX-512 VNNI).
// The proof that the screen never drops the argmax is in model.GreedyHead.
//
// 1. Approximate logits x W^T with both sides in int8. W is quantized once per
//    row and stored as unsigned bytes (Wq + 128) in VNNI order, 16 vocabulary
//    rows by 4 hidden dims per 64-byte vector: packed[Vp/16][K4][16][4]. Each x
//    row is int8 with one scale. vpdpbusd multiplies the unsigned weight bytes
//    by the signed x bytes broadcast four at a time, so the exact integer dot is
//        A = sum_k (Wq + 128) xq - 128 sum_k xq
//    and the approximate logit x_scale * w_scale * A. A quarter of the float32
//    matrix's bytes is read per step, and only the maximum of each 64-column
//    chunk is kept (writing all the logits would cost as much again).
// 2. Per row, the chunks whose maximum is within 2 * bound of the row's are
//    computed again (64 columns, one row: cheap), the columns within the bound
//    are the candidates; their float32 logits (x . W_j) are computed and the
//    largest wins, the lowest id among equals (torch.argmax's rule). A row with more
//    than max_candidates candidates gets -1: the caller computes it in full.
// Without VNNI kvengine_greedy_supported() is 0 and the caller keeps its
// bf16 screen. Built with -ffast-math (finite math): no infinities here,
// -FLT_MAX marks the padding columns, and the caller passes finite bounds.
#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KV_HAVE_VNNI 1
#endif

extern "C" int kvengine_greedy_supported() {
#ifdef KV_HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef KV_HAVE_VNNI
namespace {

constexpr int CHUNK = 64;  // columns per chunk maximum: 4 vectors of 16
constexpr int VB = CHUNK / 16;

// x rows [s0, s0 + R) against vocabulary rows [16 vb0, 16 vb0 + 64): one chunk.
// Writes each row's chunk maximum (with chunk_max) and its 64 logits (with values, [R][64]).
template <int R>
inline void chunk_tile(const uint8_t *packed, const int32_t *x32, const float *x_scale,
                       const int32_t *x_sum, const float *w_scale, int64_t k4, int64_t s0,
                       int64_t vb0, int64_t V, int64_t chunks, float *chunk_max, float *values) {
    __m512i acc[VB][R];
    for (int v = 0; v < VB; v++)
        for (int r = 0; r < R; r++) acc[v][r] = _mm512_setzero_si512();
    const uint8_t *wb = packed + vb0 * k4 * 64;
    const int32_t *xr = x32 + s0 * k4;
    const uint8_t *next = wb + VB * k4 * 64;  // the next chunk: 64 bytes per g and vector
    for (int64_t g = 0; g < k4; g++) {
        if (R > 1)
            for (int v = 0; v < VB; v++) __builtin_prefetch(next + (v * k4 + g) * 64, 0, 3);
        __m512i w[VB];
        for (int v = 0; v < VB; v++) w[v] = _mm512_loadu_si512(wb + (v * k4 + g) * 64);
        for (int r = 0; r < R; r++) {
            const __m512i b = _mm512_set1_epi32(xr[r * k4 + g]);
            for (int v = 0; v < VB; v++) acc[v][r] = _mm512_dpbusd_epi32(acc[v][r], w[v], b);
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t s = s0 + r;
        const __m512i offset = _mm512_set1_epi32(128 * x_sum[s]);
        const __m512 xs = _mm512_set1_ps(x_scale[s]);
        __m512 m = _mm512_set1_ps(-FLT_MAX);
        for (int v = 0; v < VB; v++) {
            const int64_t col = (vb0 + v) * 16;
            __m512 val = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[v][r], offset)),
                                       _mm512_mul_ps(_mm512_loadu_ps(w_scale + col), xs));
            if (col + 16 > V) {  // padding columns: never a candidate, never the maximum
                const int64_t valid = V > col ? V - col : 0;
                val = _mm512_mask_blend_ps((__mmask16)((1u << valid) - 1u),
                                           _mm512_set1_ps(-FLT_MAX), val);
            }
            if (values) _mm512_storeu_ps(values + r * CHUNK + v * 16, val);
            m = _mm512_max_ps(m, val);
        }
        if (chunk_max) chunk_max[s * chunks + vb0 / VB] = _mm512_reduce_max_ps(m);
    }
}

float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

// The winner of row s among its candidates, or -1 when there are too many.
int64_t pick(const uint8_t *packed, const int32_t *x32, const float *x_scale,
             const int32_t *x_sum, const float *w_scale, int64_t k4, const float *x,
             const float *weight, int64_t K, int64_t V, int64_t s, const float *chunk_max,
             int64_t chunks, float bound, int64_t max_candidates) {
    const float *row_max_of = chunk_max + s * chunks;
    float row_max = row_max_of[0];
    for (int64_t c = 1; c < chunks; c++) row_max = row_max_of[c] > row_max ? row_max_of[c] : row_max;
    const float thr = row_max - 2.f * bound - std::fabs(row_max) * 0x1p-20f;
    int64_t best = -1, seen = 0;
    float best_logit = 0.f, values[CHUNK];
    for (int64_t c = 0; c < chunks; c++) {
        if (row_max_of[c] < thr) continue;
        chunk_tile<1>(packed, x32, x_scale, x_sum, w_scale, k4, s, c * VB, V, chunks, nullptr,
                      values);
        const int64_t end = (c + 1) * CHUNK < V ? (c + 1) * CHUNK : V;
        for (int64_t j = c * CHUNK; j < end; j++) {
            if (values[j - c * CHUNK] < thr) continue;
            if (++seen > max_candidates) return -1;
            const float l = dot(x + s * K, weight + j * K, K);
            if (best < 0 || l > best_logit) best = j, best_logit = l;  // ascending j: ties keep the lowest
        }
    }
    return best;
}

}  // namespace
#endif

// packed [Vp/16][K4][64] (Vp = V rounded up to 64); weight [V][K] float32; w_scale [Vp];
// x [S][K] float32 (the normed rows); xq [S][K4 * 4] int8 (zero-padded); x_scale, x_sum
// (sum of xq), bound [S] (logit units); scratch: chunk_max [S][Vp/64].
// out [S]: token ids, -1 where the row must be computed in full.
extern "C" int kvengine_greedy_int8(const uint8_t *packed, const float *weight,
                                    const float *w_scale, int64_t V, int64_t K, int64_t k4,
                                    const float *x, const int8_t *xq, const float *x_scale,
                                    const int32_t *x_sum, const float *bound, int64_t S,
                                    float *chunk_max, int64_t max_candidates,
                                    int64_t *out) {
#ifdef KV_HAVE_VNNI
    const int64_t Vp = (V + CHUNK - 1) / CHUNK * CHUNK, chunks = Vp / CHUNK;
    const int32_t *x32 = reinterpret_cast<const int32_t *>(xq);
    constexpr int R = 3;
    for (int64_t vb0 = 0; vb0 < Vp / 16; vb0 += VB) {
        int64_t s0 = 0;
        for (; s0 + R <= S; s0 += R)
            chunk_tile<R>(packed, x32, x_scale, x_sum, w_scale, k4, s0, vb0, V, chunks,
                          chunk_max, nullptr);
        for (; s0 < S; s0++)
            chunk_tile<1>(packed, x32, x_scale, x_sum, w_scale, k4, s0, vb0, V, chunks,
                          chunk_max, nullptr);
    }
    for (int64_t s = 0; s < S; s++)
        out[s] = pick(packed, x32, x_scale, x_sum, w_scale, k4, x, weight, K, V, s, chunk_max,
                      chunks, bound[s], max_candidates);
    return 0;
#else
    (void)packed; (void)weight; (void)w_scale; (void)V; (void)K; (void)k4; (void)x; (void)xq;
    (void)x_scale; (void)x_sum; (void)bound; (void)S; (void)chunk_max;
    (void)max_candidates; (void)out;
    return -1;
#endif
}
