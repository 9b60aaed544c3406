// Checks the own ggml's copy of a transposed view (native/patches/ggml-dup-transposed.patch) element for
// element against the source, for f16 and f32, sizes that are and are not multiples of its 32 x 32
// tiles, one and several heads, and 1-3 threads (which split the destination rows). Prints one line per
// mismatch and "all equal" or "FAILED"; exits 1 on any mismatch. Built by tests/native/test_ggml_copy.py.
#include "ggml-cpu.h"
#include "ggml.h"

#include <cstdint>
#include <cstdio>
#include <initializer_list>

namespace {

template <typename T>
bool transposed_copy_is_exact(ggml_type type, int lat, int cols, int rows, int heads, int threads) {
    ggml_init_params params = {(size_t)lat * rows * heads * 16 + (16u << 20), nullptr, false};
    ggml_context * ctx = ggml_init(params);
    // a cache of `rows` positions of `lat` elements per head, as attention's latent cache is stored
    ggml_tensor * cache = ggml_new_tensor_3d(ctx, type, lat, rows, heads);
    T * src = (T *)cache->data;
    for (int64_t i = 0; i < (int64_t)lat * rows * heads; i++) src[i] = (T)(i * 2654435761u);  // distinct bits
    ggml_tensor * v = ggml_view_3d(ctx, cache, cols, rows, heads, cache->nb[1], cache->nb[2], 0);
    ggml_tensor * vt = ggml_cont(ctx, ggml_transpose(ctx, v));  // [rows, cols, heads]
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, vt);
    ggml_graph_compute_with_ctx(ctx, graph, threads);
    const T * dst = (const T *)vt->data;
    bool ok = true;
    for (int h = 0; h < heads && ok; h++) {
        for (int j = 0; j < cols && ok; j++) {
            for (int k = 0; k < rows && ok; k++) {
                const T got = dst[((int64_t)h * cols + j) * rows + k];
                const T want = src[((int64_t)h * rows + k) * lat + j];
                if (got != want) {
                    printf("mismatch: %s lat %d cols %d rows %d heads %d threads %d at head %d col %d row %d\n",
                           ggml_type_name(type), lat, cols, rows, heads, threads, h, j, k);
                    ok = false;
                }
            }
        }
    }
    ggml_free(ctx);
    return ok;
}

}  // namespace

int main() {
    // {lat, cols, rows}: the tiny suite's MLA (96, 64, 256), DeepSeek-V3's (576, 512, ...), and edges
    const int sizes[][3] = {{96, 64, 256}, {576, 512, 300}, {100, 37, 45}, {33, 33, 33}, {8, 1, 70}, {70, 65, 1}};
    bool ok = true;
    for (const auto & s : sizes) {
        for (int heads : {1, 3}) {
            for (int threads : {1, 2, 3}) {
                ok &= transposed_copy_is_exact<uint16_t>(GGML_TYPE_F16, s[0], s[1], s[2], heads, threads);
                ok &= transposed_copy_is_exact<uint32_t>(GGML_TYPE_F32, s[0], s[1], s[2], heads, threads);
            }
        }
    }
    printf(ok ? "all equal\n" : "FAILED\n");
    return ok ? 0 : 1;
}
