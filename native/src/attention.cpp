// Attention over a session's KV cache: ggml's own ops (ops_attention), ggml's flash attention
// (flash_attention), and decode-step kernels (AVX-512) run as ggml custom ops on the CPU backend, with
// the open-time check that they agree with ggml's ops.
//
// Why: on a decode step ggml's mul_mat computes the scores with one f16 dot product call per
// (position, head) pair, each only head_dim long, and reads every K and V row once per query head.
// At 2,048 positions that call overhead, not memory, made up most of the extra cost of a long
// context. These kernels read each K row and each V row once per KV group, keep the group's query
// heads in registers, reduce 16 scores at a time, prefetch ahead, and skip the masked tail.
//
// Numerics: each output is formed exactly as ggml_vec_dot_f16 forms it on AVX-512 (the operand
// rounded to f16 as mul_mat's vec_dot_type, four 16-lane FMA accumulators over 64-element steps,
// pairwise adds 0+2, 1+3, then 0+1, then _mm512_reduce_add_ps), so the logits stay identical to
// the ggml path and to llama.cpp (tests/native/test_parity.py checks a max difference of 0.0).
// Other compilers or ggml builds could reduce differently, so every model open compares the two
// on random data first (decode_attention_self_check) and keeps ggml's ops if a bit differs.

#include "attention.h"

// GCC 12's _mm512_reduce_add_ps expands through _mm256_undefined_pd(), which -Wuninitialized flags
// when the intrinsics come in through a target attribute rather than -mavx512f
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-cpu.h"

namespace ggswarm {
namespace {

constexpr int64_t kStep = 64;      // elements per step of ggml's AVX-512 f16 dot product
constexpr int kMaxHeadBlock = 4;   // query heads kept in registers at once (4 x 4 accumulators)

struct Range {
    int64_t begin, end;
};

Range split(int64_t n, int ith, int nth) {
    const int64_t per = (n + nth - 1) / nth;
    const int64_t b = std::min<int64_t>(n, per * ith);
    return {b, std::min<int64_t>(n, b + per)};
}

// Positions 0..pos are attended; pos is the single new position of the decode step.
int64_t attended(const ggml_tensor * pos, int64_t n_kv) {
    const int64_t p = static_cast<const int32_t *>(pos->data)[0];
    return std::clamp<int64_t>(p + 1, 0, n_kv);
}

__attribute__((target("avx512f"))) inline float reduce4(__m512 s0, __m512 s1, __m512 s2, __m512 s3) {
    s0 = _mm512_add_ps(s0, s2);
    s1 = _mm512_add_ps(s1, s3);
    s0 = _mm512_add_ps(s0, s1);
    return _mm512_reduce_add_ps(s0);
}

__attribute__((target("avx512f"))) inline __m512 load_f16(const ggml_fp16_t * p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
}

// n floats (a multiple of 16) rounded to f16 and back, as mul_mat converts its second operand
__attribute__((target("avx512f"))) void round_f16(const float * x, float * y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm512_storeu_ps(y + i, _mm512_cvtph_ps(h));
    }
}

// dst[b * dst_stride] = dot(x[0..n), y_b[0..n)) for NB operand rows y_b = y + b * y_stride, with
// x read once per step for all of them
template <int NB>
__attribute__((target("avx512f,fma"))) void dot_rows(const ggml_fp16_t * x, const float * y, int64_t y_stride,
                                                    int64_t n, float * dst, int64_t dst_stride) {
    __m512 acc[NB][4];
    for (int b = 0; b < NB; ++b)
        for (int c = 0; c < 4; ++c) acc[b][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += kStep) {
        _mm_prefetch(reinterpret_cast<const char *>(x + i + 512), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(x + i + 512 + 32), _MM_HINT_T0);
        __m512 xv[4];
        for (int c = 0; c < 4; ++c) xv[c] = load_f16(x + i + 16 * c);
        for (int b = 0; b < NB; ++b) {
            const float * yb = y + b * y_stride + i;
            for (int c = 0; c < 4; ++c) acc[b][c] = _mm512_fmadd_ps(xv[c], _mm512_loadu_ps(yb + 16 * c), acc[b][c]);
        }
    }
    for (int b = 0; b < NB; ++b) dst[b * dst_stride] = reduce4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]);
}

// f(std::integral_constant<int, NB>{}, first) for consecutive blocks of at most kMaxHeadBlock of
// nb heads: the kernels are templates on the block size so a block's accumulators stay in registers
template <class F>
void head_blocks(int64_t nb, F && f) {
    for (int64_t first = 0; first < nb; first += kMaxHeadBlock) {
        switch (std::min<int64_t>(nb - first, kMaxHeadBlock)) {
            case 1: f(std::integral_constant<int, 1>{}, first); break;
            case 2: f(std::integral_constant<int, 2>{}, first); break;
            case 3: f(std::integral_constant<int, 3>{}, first); break;
            default: f(std::integral_constant<int, 4>{}, first); break;
        }
    }
}

// the nb heads of one group (operand rows y + h * y_stride) against one row x
void dot_heads(const ggml_fp16_t * x, const float * y, int64_t y_stride, int64_t n, float * dst,
               int64_t dst_stride, int64_t nb) {
    head_blocks(nb, [&](auto block, int64_t first) {
        dot_rows<decltype(block)::value>(x, y + first * y_stride, y_stride, n, dst + first * dst_stride, dst_stride);
    });
}

// _mm512_reduce_add_ps (GCC) adds 256-bit halves, then 128-bit halves, then lanes {0,1} + {2,3},
// then lane 0 + lane 1. These four steps make the same pairings for 16 vectors at once, two
// vectors per instruction pair, so 16 scores cost 15 adds instead of 16 full reductions.
__attribute__((target("avx512f"))) inline __m512 halves256(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
__attribute__((target("avx512f"))) inline __m512 halves128(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
__attribute__((target("avx512f"))) inline __m512 pairs(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
__attribute__((target("avx512f"))) inline __m512 lanes(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

constexpr int64_t kBlock = 16;  // positions scored by one batched reduction

// One (position, head) dot product of head_dim 64 before its final reduction, formed as ggml forms
// it: four single-FMA accumulators, then (s0 + s2) + (s1 + s3).
__attribute__((target("avx512f,fma"))) inline __m512 partial64(const __m512 * k, const float * q) {
    const __m512 z = _mm512_setzero_ps();
    const __m512 s0 = _mm512_fmadd_ps(k[0], _mm512_loadu_ps(q), z);
    const __m512 s1 = _mm512_fmadd_ps(k[1], _mm512_loadu_ps(q + 16), z);
    const __m512 s2 = _mm512_fmadd_ps(k[2], _mm512_loadu_ps(q + 32), z);
    const __m512 s3 = _mm512_fmadd_ps(k[3], _mm512_loadu_ps(q + 48), z);
    return _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3));
}

// Scores of 16 consecutive positions (K rows k, k + k_stride bytes, ...; head_dim 64) for NB heads
// of one group: dst[b * dst_stride + p]. Each K row is loaded once for all NB heads, and the
// batched reduction runs as the pairs of positions come in, so few vectors stay live.
template <int NB>
__attribute__((target("avx512f,fma"))) void score_block64(const char * k, size_t k_stride, const float * q,
                                                         float * dst, int64_t dst_stride) {
    __m512 w[NB], u[NB], t[NB];
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
#pragma GCC unroll 8
    for (int p = 0; p < kBlock; p += 2) {
        __m512 ka[4], kb[4];
        const auto * ra = reinterpret_cast<const ggml_fp16_t *>(k + p * k_stride);
        const auto * rb = reinterpret_cast<const ggml_fp16_t *>(k + (p + 1) * k_stride);
        for (int c = 0; c < 4; ++c) {
            ka[c] = load_f16(ra + 16 * c);
            kb[c] = load_f16(rb + 16 * c);
        }
        for (int b = 0; b < NB; ++b) {
            const __m512 pw = halves256(partial64(ka, q + 64 * b), partial64(kb, q + 64 * b));
            if (p % 4 == 0) {
                w[b] = pw;
                continue;
            }
            const __m512 pu = halves128(w[b], pw);
            if (p % 8 == 2) {
                u[b] = pu;
                continue;
            }
            const __m512 pt = pairs(u[b], pu);
            if (p < 8) {
                t[b] = pt;
                continue;
            }
            // lane 4 * (p % 4) + p / 4 of the result holds position p
            _mm512_storeu_ps(dst + b * dst_stride, _mm512_permutexvar_ps(order, lanes(t[b], pt)));
        }
    }
}

void score_block(const char * k, size_t k_stride, const float * q, float * dst, int64_t dst_stride, int64_t nb) {
    head_blocks(nb, [&](auto block, int64_t first) {
        score_block64<decltype(block)::value>(k, k_stride, q + first * 64, dst + first * dst_stride, dst_stride);
    });
}

// srcs: q [hd, nh] f32, k [hd * nkv, cap] f16, pos [1] i32; dst [n_kv, nh] f32
void scores_op(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const int64_t hd = q->ne[0], nh = q->ne[1], n_kv = dst->ne[0];
    const int64_t group = nh / (k->ne[0] / hd);
    const int64_t valid = attended(dst->src[2], n_kv);
    float * out = static_cast<float *>(dst->data);
    auto k_row = [&](int64_t j, int64_t g) {
        return reinterpret_cast<const ggml_fp16_t *>(static_cast<const char *>(k->data) + j * k->nb[1]) + g * hd;
    };

    thread_local std::vector<float> qr;
    qr.resize((size_t)(hd * nh));
    for (int64_t h = 0; h < nh; ++h) {
        round_f16(reinterpret_cast<const float *>(static_cast<const char *>(q->data) + h * q->nb[1]),
                  qr.data() + h * hd, hd);
    }
    // whole blocks of 16 positions when head_dim is 64 (the batched reduction); the rest, and other
    // head sizes, one position at a time
    const int64_t n_blocks = hd == 64 ? valid / kBlock : 0;
    const Range rb = split(n_blocks, ith, nth);
    for (int64_t b = rb.begin; b < rb.end; ++b) {
        const int64_t j0 = b * kBlock;
        if (b + 1 < rb.end) {
            const char * next = reinterpret_cast<const char *>(k_row(j0 + kBlock, 0));
            for (size_t off = 0; off < (size_t)kBlock * k->nb[1]; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
        }
        for (int64_t g = 0; g * group < nh; ++g) {
            score_block(reinterpret_cast<const char *>(k_row(j0, g)), k->nb[1], qr.data() + g * group * hd,
                        out + g * group * n_kv + j0, n_kv, group);
        }
    }
    // the last partial block, one position at a time
    const int64_t tail = n_blocks * kBlock;
    const Range rt = split(valid - tail, ith, nth);
    for (int64_t j = tail + rt.begin; j < tail + rt.end; ++j) {
        for (int64_t g = 0; g * group < nh; ++g) {
            dot_heads(k_row(j, g), qr.data() + g * group * hd, hd, hd, out + g * group * n_kv + j, n_kv, group);
        }
    }
    // later positions are masked here rather than by a mask input: -inf, which is what ggml's
    // softmax makes of score * scale + mask there
    const Range z = split(n_kv - valid, ith, nth);
    for (int64_t h = 0; h < nh && z.end > z.begin; ++h) {
        std::fill(out + h * n_kv + valid + z.begin, out + h * n_kv + valid + z.end, -INFINITY);
    }
}

// srcs: p [n_kv, nh] f32, vt [cap, hd * nkv] f16, pos [1] i32; dst [hd, nh] f32
void values_op(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * p = dst->src[0];
    const ggml_tensor * vt = dst->src[1];
    const int64_t hd = dst->ne[0], nh = dst->ne[1], n_kv = p->ne[0];
    const int64_t dkv = vt->ne[1], group = nh / (dkv / hd);
    // weights past pos are exactly 0 and add nothing to any accumulator, so whole steps of them are
    // skipped
    const int64_t span = std::min<int64_t>(n_kv, (attended(dst->src[2], n_kv) + kStep - 1) / kStep * kStep);
    float * out = static_cast<float *>(dst->data);
    const Range r = split(dkv, ith, nth);
    if (r.end <= r.begin) return;

    // this thread's heads: those of the groups its channels fall in
    const int64_t h_begin = r.begin / hd * group, h_end = ((r.end - 1) / hd + 1) * group;
    thread_local std::vector<float> pr;
    pr.resize((size_t)((h_end - h_begin) * span));
    for (int64_t h = h_begin; h < h_end; ++h) {
        round_f16(reinterpret_cast<const float *>(static_cast<const char *>(p->data) + h * p->nb[1]),
                  pr.data() + (h - h_begin) * span, span);
    }
    for (int64_t ch = r.begin; ch < r.end; ++ch) {
        const int64_t g = ch / hd, d = ch % hd;
        const auto * row = reinterpret_cast<const ggml_fp16_t *>(static_cast<const char *>(vt->data) + ch * vt->nb[1]);
        dot_heads(row, pr.data() + (g * group - h_begin) * span, span, span, out + g * group * hd + d, hd, group);
    }
}

bool cpu_has_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

}  // namespace

bool decode_attention_cpu() {
    static const bool ok = cpu_has_avx512() && ggml_cpu_has_avx512();
    return ok;
}

bool decode_attention_supported(int64_t head_dim) {
    return decode_attention_cpu() && head_dim > 0 && head_dim % kStep == 0;
}

namespace {

// q [hd, n, nh] and mask [n_kv, n] (f16 or f32) with zero rows appended up to `rows` queries
void pad_queries(ggml_context * c, ggml_tensor ** q, ggml_tensor ** mask, int64_t rows) {
    ggml_tensor * qp = *q, * mk = *mask;
    const int64_t extra = rows - qp->ne[1];
    ggml_tensor * zq = ggml_fill(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, qp->ne[0], extra, qp->ne[2]), 0.0f);
    *q = ggml_concat(c, ggml_cont(c, qp), zq, 1);
    // through f32 and back: the mask's values (0, -inf) are exact in either type
    ggml_tensor * zm = ggml_fill(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, mk->ne[0], extra), 0.0f);
    ggml_tensor * m32 = mk->type == GGML_TYPE_F32 ? mk : ggml_cast(c, mk, GGML_TYPE_F32);
    ggml_tensor * padded = ggml_concat(c, ggml_view_2d(c, m32, m32->ne[0], qp->ne[1], m32->nb[1], 0), zm, 1);
    *mask = mk->type == GGML_TYPE_F32 ? padded : ggml_cast(c, padded, mk->type);
}

}  // namespace

ggml_tensor * flash_attn_ext_tiled_as_llama(ggml_context * c, ggml_tensor * qp, ggml_tensor * k, ggml_tensor * v,
                                            ggml_tensor * mask, float kq_scale, ggml_tensor * sinks,
                                            bool tile_queries) {
    // ggml's CPU kernel runs >= kFlashTileQ queries tiled (f16/f32 K/V) and fewer scalar: they round
    // otherwise (the graph key sets tile_queries only for 2..kFlashTileQ-1 positions)
    const int64_t hd = v->ne[0], nh = qp->ne[2], n = qp->ne[1];
    const bool pad = tile_queries && (k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_F32);
    if (pad) pad_queries(c, &qp, &mask, kFlashTileQ);
    ggml_tensor * o = ggml_flash_attn_ext(c, qp, k, v, mask, kq_scale, 0.0f, 0.0f);  // [hd, nh, n]
    if (sinks) ggml_flash_attn_ext_add_sinks(o, sinks);
    ggml_prec_set_acc(o, GGML_PREC_F32);
    return pad ? ggml_cont(c, ggml_view_3d(c, o, hd, nh, n, o->nb[1], o->nb[2], 0)) : o;
}

ggml_tensor * flash_attention(ggml_context * c, ggml_tensor * q, ggml_tensor * kc, ggml_tensor * vc, ggml_tensor * mask,
                              int32_t n, int32_t n_kv, float kq_scale, ggml_tensor * sinks, bool tile_queries) {
    const int64_t hd = q->ne[0], nh = q->ne[1], nkv = kc->ne[0] / hd;
    // a head's bytes in the cache type (quantized blocks run along the head: whole blocks per head)
    ggml_tensor * k = ggml_view_3d(c, kc, hd, n_kv, nkv, kc->nb[1], ggml_row_size(kc->type, hd), 0);  // [hd, n_kv, nkv]
    ggml_tensor * v = ggml_view_3d(c, vc, hd, n_kv, nkv, vc->nb[1], ggml_row_size(vc->type, hd), 0);
    ggml_tensor * qp = ggml_permute(c, q, 0, 2, 1, 3);  // [hd, n, nh]
    ggml_tensor * o = flash_attn_ext_tiled_as_llama(c, qp, k, v, mask, kq_scale, sinks, tile_queries);
    return ggml_reshape_2d(c, o, hd * nh, n);
}

ggml_tensor * ops_attention(ggml_context * c, ggml_tensor * q, ggml_tensor * kc, ggml_tensor * vc, ggml_tensor * mask,
                            int32_t n, int32_t n_kv, float kq_scale, ggml_tensor ** scores, ggml_tensor * sinks) {
    const int64_t hd = q->ne[0], nh = q->ne[1], nkv = kc->ne[0] / hd;
    ggml_tensor * kall = ggml_view_3d(c, kc, hd, n_kv, nkv, kc->nb[1], hd * sizeof(ggml_fp16_t), 0);
    ggml_tensor * vall = ggml_view_3d(c, vc, n_kv, hd, nkv, vc->nb[1], vc->nb[1] * hd, 0);
    ggml_tensor * qp = ggml_permute(c, q, 0, 2, 1, 3);  // [hd, n, nh]
    ggml_tensor * kq = ggml_mul_mat(c, kall, qp);        // [n_kv, n, nh]
    if (scores) *scores = kq;
    if (decode_rows(n) && !sinks) {
        // [n_kv, 1, nh] -> [n_kv, nh]: the heads become softmax rows, which ggml splits across threads
        kq = ggml_reshape_2d(c, kq, n_kv, nh);
        kq = ggml_reshape_3d(c, ggml_soft_max_ext(c, kq, mask, kq_scale, 0.0f), n_kv, 1, nh);
    } else {
        kq = ggml_soft_max_ext(c, kq, mask, kq_scale, 0.0f);  // a decode mask [n_kv, nh]: its row 0 serves
        if (sinks) ggml_soft_max_add_sinks(kq, sinks);
    }
    ggml_tensor * kqv = ggml_mul_mat(c, vall, kq);  // [hd, n, nh]
    return ggml_cont_2d(c, ggml_permute(c, kqv, 0, 2, 1, 3), hd * nh, n);
}

ggml_tensor * decode_scores(ggml_context * c, ggml_tensor * q, ggml_tensor * k, ggml_tensor * pos, int64_t n_kv,
                            ggml_tensor * after) {
    ggml_tensor * args[4] = {q, k, pos, after};
    return ggml_custom_4d(c, GGML_TYPE_F32, n_kv, q->ne[1], 1, 1, args, 4, scores_op, GGML_N_TASKS_MAX, nullptr);
}

ggml_tensor * decode_values(ggml_context * c, ggml_tensor * p, ggml_tensor * vt, ggml_tensor * pos, int64_t head_dim,
                            ggml_tensor * after) {
    ggml_tensor * args[4] = {p, vt, pos, after};
    return ggml_custom_4d(c, GGML_TYPE_F32, head_dim, p->ne[1], 1, 1, args, 4, values_op, GGML_N_TASKS_MAX, nullptr);
}

ggml_tensor * kernel_attention(ggml_context * c, ggml_tensor * q, ggml_tensor * kc, ggml_tensor * vc,
                               ggml_tensor * pos, int32_t n_kv, ggml_tensor * k_put, ggml_tensor * v_put,
                               float kq_scale, ggml_tensor ** scores) {
    const int64_t hd = q->ne[0], nh = q->ne[1];
    ggml_tensor * kq = decode_scores(c, q, kc, pos, n_kv, k_put);
    if (scores) *scores = kq;
    kq = ggml_soft_max_ext(c, kq, nullptr, kq_scale, 0.0f);
    return ggml_reshape_2d(c, decode_values(c, kq, vc, pos, hd, v_put), hd * nh, 1);
}

namespace {

// splitmix64: the same test data on every machine, uniform in [-1, 1)
struct Rng {
    uint64_t s;
    float next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        z ^= z >> 31;
        return (float)(z >> 40) / (float)(1ULL << 23) - 1.0f;
    }
};

}  // namespace

bool decode_attention_self_check(ggml_backend_t cpu, int64_t hd, int64_t nh, int64_t nkv, bool corrupt,
                                 std::string * why) {
    auto say = [&](const std::string & s) {
        if (why) *why = s;
        return false;
    };
    if (!cpu || hd <= 0 || nh <= 0 || nkv <= 0 || nh % nkv != 0) return say("invalid head shape");
    // the graph's spans for 101 attended positions: ggml's ops over 256 (kv.cpp's pad_kv, masked), the
    // kernels over 128 (kernel_span); 101 crosses a 64-position step and leaves a tail of 5 after the
    // kernels' 16-position score blocks; rows past it hold stale data, as after a truncate
    constexpr int32_t kCap = 256, kLen = 101, kKernelSpan = 128;
    const int64_t dkv = hd * nkv;
    constexpr size_t kNodes = 64;
    ggml_init_params ip = {ggml_tensor_overhead() * kNodes + ggml_graph_overhead_custom(kNodes, false), nullptr, true};
    ggml_context * c = ggml_init(ip);
    if (!c) return say("cannot create a ggml context");
    ggml_tensor * q = ggml_new_tensor_3d(c, GGML_TYPE_F32, hd, nh, 1);
    ggml_tensor * kc = ggml_new_tensor_2d(c, GGML_TYPE_F16, dkv, kCap);
    ggml_tensor * vc = ggml_new_tensor_2d(c, GGML_TYPE_F16, kCap, dkv);
    ggml_tensor * pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, 1);
    ggml_tensor * mask = ggml_new_tensor_2d(c, GGML_TYPE_F32, kCap, nh);
    ggml_tensor *ref_kq = nullptr, *got_kq = nullptr;
    ggml_tensor * ref = ops_attention(c, q, kc, vc, mask, 1, kCap, 1.0f / sqrtf((float)hd), &ref_kq);
    // no write to order before the reads here: the caches themselves stand in for k_put / v_put
    ggml_tensor * got = kernel_attention(c, q, kc, vc, pos, kKernelSpan, kc, vc, 1.0f / sqrtf((float)hd), &got_kq);
    ggml_cgraph * gf = ggml_new_graph_custom(c, kNodes, false);
    ggml_build_forward_expand(gf, ref);
    ggml_build_forward_expand(gf, got);
    // every tensor gets its own memory here, so the scores can be read after the compute
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(c, cpu);
    if (!buf) {
        ggml_free(c);
        return say("cannot allocate the self-check's tensors");
    }

    Rng rng{0x5e1fc4ecULL};
    std::vector<float> f((size_t)std::max<int64_t>(hd * nh, kCap * nh));
    for (int64_t i = 0; i < hd * nh; ++i) f[i] = rng.next();
    ggml_backend_tensor_set(q, f.data(), 0, sizeof(float) * hd * nh);
    std::vector<ggml_fp16_t> h((size_t)(dkv * kCap));
    for (auto & x : h) x = ggml_fp32_to_fp16(rng.next());
    ggml_backend_tensor_set(kc, h.data(), 0, sizeof(ggml_fp16_t) * h.size());
    for (auto & x : h) x = ggml_fp32_to_fp16(rng.next());
    ggml_backend_tensor_set(vc, h.data(), 0, sizeof(ggml_fp16_t) * h.size());
    const int32_t p = kLen - 1;
    ggml_backend_tensor_set(pos, &p, 0, sizeof(p));
    for (int64_t r = 0; r < nh; ++r) {
        for (int32_t j = 0; j < kCap; ++j) f[(size_t)(r * kCap + j)] = j < kLen ? 0.0f : -INFINITY;
    }
    ggml_backend_tensor_set(mask, f.data(), 0, sizeof(float) * kCap * nh);

    bool same = false;
    if (ggml_backend_graph_compute(cpu, gf) != GGML_STATUS_SUCCESS) {
        say("ggml graph compute failed");
    } else {
        // the scores of the attended positions (rows of kCap and kKernelSpan per head), then the outputs
        std::vector<float> ra((size_t)(kCap * nh)), rb((size_t)(kKernelSpan * nh)), a((size_t)(hd * nh)),
            b((size_t)(hd * nh));
        ggml_backend_tensor_get(ref_kq, ra.data(), 0, sizeof(float) * ra.size());
        ggml_backend_tensor_get(got_kq, rb.data(), 0, sizeof(float) * rb.size());
        ggml_backend_tensor_get(ref, a.data(), 0, sizeof(float) * a.size());
        ggml_backend_tensor_get(got, b.data(), 0, sizeof(float) * b.size());
        if (corrupt) b[b.size() / 2] = std::nextafter(b[b.size() / 2], INFINITY);  // one output off by one bit
        char msg[320] = "";
        auto compare = [&](const char * what, int64_t rows, int64_t len, const float * x, int64_t x_row,
                           const float * y, int64_t y_row) {
            int64_t differ = 0, first = 0;
            for (int64_t r = 0; r < rows; ++r) {
                for (int64_t i = 0; i < len; ++i) {
                    if (memcmp(&x[r * x_row + i], &y[r * y_row + i], sizeof(float)) != 0 && !differ++) first = r * len + i;
                }
            }
            if (differ && !*msg) {
                snprintf(msg, sizeof(msg), "%lld of %lld %s differ from ggml's (first: head %lld, index %lld: %.9g vs %.9g)%s",
                         (long long)differ, (long long)(rows * len), what, (long long)(first / len),
                         (long long)(first % len), y[first / len * y_row + first % len],
                         x[first / len * x_row + first % len],
                         corrupt ? " [forced by GGSWARM_KERNEL_SELFCHECK=corrupt]" : "");
            }
        };
        compare("scores", nh, kLen, ra.data(), kCap, rb.data(), kKernelSpan);
        compare("outputs", nh, hd, a.data(), hd, b.data(), hd);
        same = !*msg;
        if (!same) say(msg);
    }
    ggml_backend_buffer_free(buf);
    ggml_free(c);
    return same;
}

}  // namespace ggswarm
