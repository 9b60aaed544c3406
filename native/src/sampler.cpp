// Token sampling on the last window: a C++ mirror of agent/sampling.py (the reference semantics).
//
// Order: repetition penalty (float32, llama.cpp style) -> greedy when temperature <= 0 -> top-k ->
// softmax(logits / temperature) in double -> top-p -> min-p -> renormalise -> inverse-CDF draw with
// u = splitmix64(seed ^ splitmix64(position)) >> 11 * 2^-53. The logprob is the log-softmax of the raw
// logits. Sorting is lazy (nth_element + sort of a growing prefix) with the same total order as numpy's
// stable argsort of -x (value descending, then index ascending), so only the prefix a decision needs
// is ever sorted.

#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ggswarm {

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

double uniform(uint64_t seed, int64_t position) {
    uint64_t r = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(position)));
    return static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);  // 2^-53
}

namespace {

// Eight floats as one value: GCC and Clang compile the arithmetic below to whole-register operations for
// each target_clones target (one ymm on AVX2 / AVX-512, two xmm on the baseline), where loops written
// lane by lane stayed scalar (GCC 12 vectorized neither the lanes' maxima nor the exponentials).
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

// (taken and returned by reference: a vector passed by value gets GCC's -Wpsabi note in the baseline build)
__attribute__((always_inline)) inline void load8(f8 & x, const float * p) { std::memcpy(&x, p, sizeof x); }

// exp(x) for x <= 0 to within 1e-7 relative (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r,
// 2^n put in the exponent bits); 0 below -87, where a term is under 1e-38 of the sum's largest.
// NaN stays NaN. The logprob needs the vocabulary's sum of exponentials every step: the double std::exp
// loop took 270 us over 49,152 logits, ggml's in-graph softmax 90 us on one thread.
__attribute__((always_inline)) inline void exp_nonpositive(f8 & x) {
    const f8 lo = f8{} - 87.0f;
    const f8 xc = x < lo ? lo : x;
    const f8 fn = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
    f8 r = xc - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    const f8 z = r * r;
    f8 p = f8{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    // fn + 2^23 + 127 holds n + 127 in its low mantissa bits: shifted up, the float 2^n
    const i8 scale = reinterpret_cast<i8>(fn + 8388735.0f) << 23;
    const f8 y = p * reinterpret_cast<f8>(scale);
    x = x < lo ? f8{} : y;
}

// The largest of v[from, to) as `x > m` finds it (a NaN never wins): two chains of vector lanes, so
// consecutive maxima do not wait on each other; a max in any order is the same number. Inlined into
// each caller's target_clones build.
__attribute__((always_inline)) inline float range_max(const float * v, int32_t from, int32_t to) {
    f8 a = f8{} - INFINITY, b = a;
    int32_t i = from;
    for (; i + 16 <= to; i += 16) {
        f8 x, y;
        load8(x, v + i);
        load8(y, v + i + 8);
        a = x > a ? x : a;
        b = y > b ? y : b;
    }
    float m = -INFINITY;
    for (int32_t j = 0; j < 8; ++j) {
        m = a[j] > m ? a[j] : m;
        m = b[j] > m ? b[j] : m;
    }
    for (; i < to; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

// log-softmax of v at token, given m, the largest of v. The exponentials of (x - m) are summed in float
// over blocks of 512 and the blocks in double: within 1e-6 of the double-precision log-softmax.
// x86-64-v3 and v4 bring FMA (a quarter off the exponentials), which the plain "avx2" target lacks.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
double log_softmax_given_max(const float * v, int32_t n, int32_t token, float m) {
    const f8 mv = f8{} + m;
    constexpr int32_t kBlock = 512;
    double s = 0.0;
    for (int32_t from = 0; from < n; from += kBlock) {
        const int32_t to = std::min(n, from + kBlock);
        f8 acc = {};
        int32_t k = from;
        for (; k + 8 <= to; k += 8) {
            f8 x;
            load8(x, v + k);
            x -= mv;
            exp_nonpositive(x);
            acc += x;
        }
        float block = 0.0f;
        for (int32_t j = 0; j < 8; ++j) block += acc[j];
        for (; k < to; ++k) {
            f8 x = f8{} + (v[k] - m);
            exp_nonpositive(x);
            block += x[0];
        }
        s += static_cast<double>(block);
    }
    return static_cast<double>(v[token]) - static_cast<double>(m) - std::log(s);
}

}  // namespace

// built for AVX-512, AVX2 and the baseline; the loader picks what the CPU runs (the library's own code
// is otherwise compiled for the baseline, so the same file serves every x86-64 node)
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
int32_t argmax_first(const float * v, int32_t n) {
    // The scan `if (v[i] > v[best]) best = i` in two passes: the maximum of each block (range_max), the
    // first block holding the largest, then the first index in it holding that value: the same index.
    // A NaN never wins, as in the scan, except at index 0, where the scan keeps it.
    if (n <= 0 || std::isnan(v[0])) return 0;
    constexpr int32_t kBlock = 1024;
    float best_max = -INFINITY;
    int32_t best_from = 0;
    for (int32_t from = 0; from < n; from += kBlock) {
        const float m = range_max(v, from, std::min(n, from + kBlock));
        if (m > best_max) {
            best_max = m;
            best_from = from;
        }
    }
    const int32_t to = std::min(n, best_from + kBlock);
    for (int32_t i = best_from; i < to; ++i) {
        if (v[i] == best_max) return i;
    }
    return 0;  // every value -inf or NaN: the scan's answer too
}

// (its own clones: the maximum's lanes are inlined here)
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
double log_softmax_at(const float * logits, int32_t n, int32_t token) {
    return log_softmax_given_max(logits, n, token, range_max(logits, 0, n));
}

namespace {

// Sorted-prefix view of candidate indices under (value desc, index asc).
struct LazyOrder {
    std::vector<int32_t> & idx;  // scratch owned by SamplerScratch
    const double * x;
    size_t n = 0;
    size_t sorted = 0;

    bool less(int32_t a, int32_t b) const {  // "a comes before b"
        return x[a] > x[b] || (x[a] == x[b] && a < b);
    }

    void ensure(size_t m) {
        if (m <= sorted) return;
        size_t target = std::min(n, std::max({m, 4 * sorted, static_cast<size_t>(64)}));
        if (target > n / 4) target = n;  // a long walk: one full sort beats repeated selections
        auto cmp = [this](int32_t a, int32_t b) { return less(a, b); };
        if (target < n) {
            std::nth_element(idx.begin() + sorted, idx.begin() + target, idx.begin() + n, cmp);
        }
        std::sort(idx.begin() + sorted, idx.begin() + target, cmp);
        sorted = target;
    }
};

}  // namespace

SampleResult sample(const float * raw, int32_t n_vocab, const ggswarm_sampling & p, int64_t position,
                    const int32_t * history, int32_t n_history, SamplerScratch & s, bool want_logprob) {
    // 1. repetition penalty, in float32 like numpy does with a float32 array and a Python float
    const float * pen = raw;
    if (p.repeat_penalty != 1.0 && history != nullptr && n_history > 0 && p.repeat_last_n != 0) {
        s.pen.assign(raw, raw + n_vocab);
        pen = s.pen.data();
        int32_t from = 0;
        if (p.repeat_last_n > 0 && n_history > p.repeat_last_n) from = n_history - p.repeat_last_n;
        s.seen.assign(static_cast<size_t>(n_vocab), 0);
        const float factor = static_cast<float>(p.repeat_penalty);
        for (int32_t i = from; i < n_history; ++i) {
            int32_t t = history[i];
            if (t < 0 || t >= n_vocab || s.seen[t]) continue;
            s.seen[t] = 1;
            float v = raw[t];
            s.pen[t] = v > 0 ? v / factor : v * factor;
        }
    }
    SampleResult out{};
    // 2. greedy: first index of the maximum
    if (!(p.temperature > 0.0)) {
        const int32_t best = argmax_first(pen, n_vocab);
        out.token = best;
        if (want_logprob) {
            // unpenalised, the pick holds the maximum already: one pass over the vocabulary, not two
            out.logprob = pen == raw ? log_softmax_given_max(raw, n_vocab, best, raw[best])
                                     : log_softmax_at(raw, n_vocab, best);
        }
        return out;
    }
    // 3. tempered values in double
    s.x.resize(static_cast<size_t>(n_vocab));
    s.e.resize(static_cast<size_t>(n_vocab));
    for (int32_t i = 0; i < n_vocab; ++i) s.x[i] = static_cast<double>(pen[i]) / p.temperature;
    LazyOrder ord{s.idx, s.x.data()};
    ord.idx.resize(static_cast<size_t>(n_vocab));
    for (int32_t i = 0; i < n_vocab; ++i) ord.idx[i] = i;
    ord.n = static_cast<size_t>(n_vocab);
    auto cmp = [&ord](int32_t a, int32_t b) { return ord.less(a, b); };
    // 4. top-k: restrict the candidates to the k best (as a set; order comes lazily)
    if (p.top_k > 0 && p.top_k < n_vocab) {
        std::nth_element(ord.idx.begin(), ord.idx.begin() + p.top_k, ord.idx.end(), cmp);
        ord.n = static_cast<size_t>(p.top_k);
    }
    const size_t n_cand = ord.n;
    ord.ensure(1);
    const double vmax = s.x[ord.idx[0]];
    // unnormalised weights, cached by token id
    double total = 0.0;
    for (size_t i = 0; i < n_cand; ++i) {
        const int32_t t = ord.idx[i];
        s.e[t] = std::exp(s.x[t] - vmax);
        total += s.e[t];
    }
    auto prob = [&](size_t i) { return s.e[ord.idx[i]] / total; };
    // 5. top-p and min-p cut-offs over the sorted distribution
    size_t keep = n_cand;
    if (p.top_p < 1.0) {
        double cum = 0.0;
        size_t k = n_cand;
        for (size_t i = 0; i < n_cand; ++i) {
            ord.ensure(i + 1);
            cum += prob(i);
            if (cum >= p.top_p) {
                k = i + 1;
                break;
            }
        }
        keep = std::max<size_t>(1, std::min(k, n_cand));
    }
    if (p.min_p > 0.0) {
        const double thr = p.min_p * prob(0);
        size_t cnt = 0;
        while (cnt < keep) {
            ord.ensure(cnt + 1);
            if (!(prob(cnt) >= thr)) break;
            ++cnt;
        }
        keep = std::max<size_t>(1, std::min(keep, cnt));
    }
    // 6. renormalise the kept prefix and draw
    double kept = 0.0;
    if (keep == n_cand) {
        for (size_t i = 0; i < n_cand; ++i) kept += prob(i);
    } else {
        ord.ensure(keep);
        for (size_t i = 0; i < keep; ++i) kept += prob(i);
    }
    const double u = uniform(p.seed, position);
    double cum = 0.0;
    size_t pick = keep - 1;
    for (size_t i = 0; i < keep; ++i) {
        ord.ensure(i + 1);
        cum += prob(i) / kept;
        if (cum > u) {
            pick = i;
            break;
        }
    }
    out.token = ord.idx[pick];
    out.logprob = want_logprob ? log_softmax_at(raw, n_vocab, out.token) : 0.0;
    return out;
}

}  // namespace ggswarm
