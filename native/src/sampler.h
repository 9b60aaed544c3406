// Sampler shared by ggswarm_forward (last window) and ggswarm_sample; see sampler.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "ggswarm.h"

namespace ggswarm {

struct SampleResult {
    int32_t token;
    double logprob;
};

// Buffers reused across calls so a decode step does not allocate.
struct SamplerScratch {
    std::vector<float> pen;
    std::vector<double> x;
    std::vector<double> e;
    std::vector<int32_t> idx;
    std::vector<uint8_t> seen;
};

uint64_t splitmix64(uint64_t x);
double uniform(uint64_t seed, int64_t position);
double log_softmax_at(const float * logits, int32_t n, int32_t token);
// The first index of the largest value (greedy decoding's token), as a scan with `>` finds it.
int32_t argmax_first(const float * v, int32_t n);
SampleResult sample(const float * logits, int32_t n_vocab, const ggswarm_sampling & p, int64_t position,
                    const int32_t * history, int32_t n_history, SamplerScratch & scratch,
                    bool want_logprob = true);

}  // namespace ggswarm
