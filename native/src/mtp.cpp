// Multi-token prediction (API v15, docs/native.md "Multi-token prediction"): a last window's nextn block.
//
// The block is a handle of its own (open_model with mtp_block: the file's layer after the trunk, its
// nextn tensors, the token embedding and the output head), opened with the trunk window's budget, so its
// sessions' state is charged like any other. Each trunk session gets a block session of the same
// capacity: position p of it holds what llama.cpp's MTP context holds there (common/speculative.cpp,
// draft-mtp): the block run on the token at p and the trunk's last hidden row of p - 1. The trunk's
// forward calls feed it (mtp_after_chunk, from ggswarm_forward); ggswarm_mtp_draft runs the positions
// after a given one (the session's length, or where a verification's drafts stopped standing) on the
// drafted tokens and cuts the block back to it after.
//
// The block's session follows the trunk's lazily: a trunk that went back (a truncate, a rewind to a
// checkpoint, a speculative verification cut short) is met at its next call or draft, where the block
// goes back to the same length (exactly: deepseek4's raw window keeps the positions a verification
// spans, glm-dsa's latent cache is a prefix). The trunk's rows of the last kKeepRows positions are kept
// per session for the row of p - 1 a step or a draft starting at p needs.

#include <algorithm>
#include <cstring>
#include <deque>
#include <utility>
#include <vector>

#include "arch.h"
#include "model.h"

namespace ggswarm {

namespace {

constexpr size_t kKeepRows = 64;

struct MtpSess {
    int64_t sid = 0;      // the block's session (0: none yet)
    bool behind = false;  // the block missed positions (a call without token ids, a failure): no drafts
    std::deque<std::pair<int32_t, std::vector<float>>> rows;  // (position, trunk row), ascending
};

}  // namespace

struct MtpBlock {
    ggswarm_model * blk = nullptr;
    std::map<int64_t, MtpSess> sess;  // by trunk session id
};

namespace {

const std::vector<float> * row_at(const MtpSess & ms, int32_t pos) {
    for (auto it = ms.rows.rbegin(); it != ms.rows.rend(); ++it) {
        if (it->first == pos) return &it->second;
    }
    return nullptr;
}

int32_t block_len(const MtpBlock & k, const MtpSess & ms) {
    int32_t len = 0;
    if (ms.sid) ggswarm_session_len(k.blk, ms.sid, &len);
    return len;
}

// Bring the block's session back to `len` positions if it holds more; its length after.
int32_t cut_to(MtpBlock & k, MtpSess & ms, int32_t len) {
    int32_t have = block_len(k, ms);
    if (have > len) {
        int32_t kind = 0;
        if (ggswarm_session_truncate_to(k.blk, ms.sid, len, &have, &kind) != GGSWARM_OK) have = -1;
    }
    return have;
}

// One call of the block on n positions from pos: tokens, the trunk rows of the positions before them;
// greedy token of the last position into *tok, its logits into logits (n x n_vocab, may be null).
ggswarm_status run_block(MtpBlock & k, MtpSess & ms, int32_t pos, int32_t n, const int32_t * tokens, const float * rows,
                         float * logits, int32_t * tok) {
    ggswarm_model * blk = k.blk;
    ggswarm_batch mb;
    memset(&mb, 0, sizeof(mb));
    mb.n_tokens = n;
    mb.pos_start = pos;
    mb.token_ids = tokens;
    mb.hidden_in = rows;
    mb.hidden_in_count = (int64_t)n * blk->d_io();
    mb.hidden_in_type = GGSWARM_TYPE_F32;
    mb.logits_out = logits;
    mb.logits_out_count = logits ? (int64_t)n * blk->n_vocab : 0;
    mb.token_out = tok;
    return ggswarm_forward(blk, ms.sid, &mb);
}

}  // namespace

void mtp_after_chunk(ggswarm_model * m, int64_t sid, const ggswarm_batch * b, int32_t off, int32_t nc) {
    MtpBlock & k = *m->mtp;
    const Session * s = find_session(m, sid);
    if (!s || !m->graph || !m->graph->out_hidden) return;
    MtpSess & ms = k.sess[sid];
    const int32_t pos = b->pos_start + off;
    const int64_t w = m->d_io();
    if (pos == 0) ms.behind = false;  // a session starting over brings the block with it
    if (ms.behind || !b->token_ids) {  // a session that does not draft (or cannot): nothing to copy or run
        ms.behind = true;
        return;
    }
    // the trunk's rows of this chunk, kept for the positions after it (and a restart)
    std::vector<float> rows((size_t)nc * w);
    ggml_backend_tensor_get(m->graph->out_hidden, rows.data(), 0, sizeof(float) * rows.size());
    std::vector<float> prev;
    if (pos > 0) {
        const std::vector<float> * p = row_at(ms, pos - 1);
        if (p) prev = *p;
    } else {
        prev.assign((size_t)w, 0.0f);  // llama.cpp pairs the first position with zeros
    }
    while (!ms.rows.empty() && ms.rows.back().first >= pos) ms.rows.pop_back();
    for (int32_t i = std::max<int32_t>(0, nc - (int32_t)kKeepRows); i < nc; ++i) {
        ms.rows.emplace_back(pos + i, std::vector<float>(rows.begin() + (size_t)i * w, rows.begin() + (size_t)(i + 1) * w));
    }
    while (ms.rows.size() > kKeepRows) ms.rows.pop_front();
    if (!ms.sid && ggswarm_session_open(k.blk, s->capacity, &ms.sid) != GGSWARM_OK) {
        ms.sid = 0;
        ms.behind = true;
        return;
    }
    if (prev.empty() || cut_to(k, ms, pos) != pos) {
        ms.behind = true;
        return;
    }
    // position p pairs its token with the trunk's row of p - 1
    std::vector<float> in((size_t)nc * w);
    memcpy(in.data(), prev.data(), sizeof(float) * w);
    if (nc > 1) memcpy(in.data() + w, rows.data(), sizeof(float) * (size_t)(nc - 1) * w);
    int32_t tok = 0;
    if (run_block(k, ms, pos, nc, b->token_ids + off, in.data(), nullptr, &tok) != GGSWARM_OK) ms.behind = true;
}

void mtp_set_threads(ggswarm_model * m, int32_t n) {
    if (m->mtp) ggswarm_set_threads(m->mtp->blk, n);
}

void mtp_session_closed(ggswarm_model * m, int64_t sid) {
    if (!m->mtp) return;
    auto it = m->mtp->sess.find(sid);
    if (it == m->mtp->sess.end()) return;
    if (it->second.sid) ggswarm_session_close(m->mtp->blk, it->second.sid);
    m->mtp->sess.erase(it);
}

// The snapshot trailer (docs/native.md "Snapshot format"): u32 n_rows, u32 width, n_rows x (i32 position,
// f32[width] trunk row), u64 block_bytes, then the block's own session snapshot at the trunk's length.
// Written only for a session whose block follows the trunk and holds the row its next draft reads.
namespace {

MtpSess * following(const ggswarm_model * m, int64_t sid, int32_t len) {
    if (!m->mtp) return nullptr;
    auto it = m->mtp->sess.find(sid);
    if (it == m->mtp->sess.end() || it->second.behind || !it->second.sid) return nullptr;
    MtpSess & ms = it->second;
    if (len > 0 && !row_at(ms, len - 1)) return nullptr;
    return &ms;
}

size_t rows_upto(const MtpSess & ms, int32_t len) {
    size_t n = 0;
    for (const auto & r : ms.rows) n += r.first < len;
    return n;
}

}  // namespace

uint64_t mtp_snapshot_bytes(const ggswarm_model * m, int64_t sid, int32_t len) {
    MtpSess * ms = following(m, sid, len);
    if (!ms) return 0;
    MtpBlock & k = *m->mtp;
    if (cut_to(k, *ms, len) != len) {  // the block goes back lazily anyway; one that cannot drafts no more
        ms->behind = true;
        return 0;
    }
    uint64_t blk = 0;
    if (ggswarm_session_snapshot_size(k.blk, ms->sid, &blk) != GGSWARM_OK) return 0;
    return 8 + rows_upto(*ms, len) * (4 + sizeof(float) * (uint64_t)m->d_io()) + 8 + blk;
}

bool mtp_snapshot_write(const ggswarm_model * m, int64_t sid, int32_t len, uint8_t * p, uint64_t n) {
    MtpSess * ms = following(m, sid, len);
    if (!ms || n < 16) return false;
    const uint32_t w = (uint32_t)m->d_io(), nr = (uint32_t)rows_upto(*ms, len);
    const uint64_t rows_bytes = 8 + (uint64_t)nr * (4 + sizeof(float) * w);
    if (n < rows_bytes + 8) return false;
    memcpy(p, &nr, 4);
    memcpy(p + 4, &w, 4);
    uint8_t * q = p + 8;
    for (const auto & r : ms->rows) {
        if (r.first >= len) continue;
        memcpy(q, &r.first, 4);
        memcpy(q + 4, r.second.data(), sizeof(float) * w);
        q += 4 + sizeof(float) * w;
    }
    const uint64_t blk = n - rows_bytes - 8;
    memcpy(q, &blk, 8);
    uint64_t written = 0;
    return ggswarm_session_snapshot(m->mtp->blk, ms->sid, q + 8, blk, &written) == GGSWARM_OK && written == blk;
}

namespace {

// The trailer's rows and block snapshot, checked against this window (nothing restored): status, and
// where the block's snapshot starts and its size.
ggswarm_status parse_trailer(const ggswarm_model * m, int32_t len, const uint8_t * p, uint64_t n, MtpSess * ms,
                             const uint8_t ** blk, uint64_t * blk_bytes) {
    uint32_t nr = 0, w = 0;
    if (n < 8) return fail(m, GGSWARM_E_FORMAT, "snapshot's nextn trailer is %llu bytes, shorter than its head", (unsigned long long)n);
    memcpy(&nr, p, 4);
    memcpy(&w, p + 4, 4);
    if (w != (uint32_t)m->d_io() || nr > kKeepRows) {
        return fail(m, GGSWARM_E_MISMATCH, "snapshot's nextn trailer holds %u rows of width %u (this window: at most %zu of %lld)",
                    nr, w, kKeepRows, (long long)m->d_io());
    }
    const uint64_t row = 4 + sizeof(float) * (uint64_t)w;
    if (n < 16 + nr * row) return fail(m, GGSWARM_E_FORMAT, "snapshot's nextn trailer is truncated");
    const uint8_t * q = p + 8;
    int32_t prev = -1;
    for (uint32_t i = 0; i < nr; ++i, q += row) {
        int32_t pos = 0;
        memcpy(&pos, q, 4);
        if (pos <= prev || pos >= len) {
            return fail(m, GGSWARM_E_FORMAT, "snapshot's nextn trailer has row position %d (of %d, ascending)", pos, len);
        }
        prev = pos;
        if (ms) ms->rows.emplace_back(pos, std::vector<float>((const float *)(q + 4), (const float *)(q + 4) + w));
    }
    if (len > 0 && prev != len - 1) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot's nextn trailer lacks the trunk row of position %d", len - 1);
    }
    memcpy(blk_bytes, q, 8);
    *blk = q + 8;
    if (*blk_bytes != n - 16 - nr * row) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot's nextn trailer: a block snapshot of %llu bytes in %llu",
                    (unsigned long long)*blk_bytes, (unsigned long long)n);
    }
    return GGSWARM_OK;
}

}  // namespace

ggswarm_status mtp_check_trailer(const ggswarm_model * m, int32_t len, const uint8_t * p, uint64_t n) {
    if (!m->mtp || n == 0) return GGSWARM_OK;  // no block here: the trailer is not read
    const uint8_t * blk = nullptr;
    uint64_t blk_bytes = 0;
    return parse_trailer(m, len, p, n, nullptr, &blk, &blk_bytes);
}

ggswarm_status mtp_restore(ggswarm_model * m, int64_t sid, int32_t len, int32_t capacity, const uint8_t * p, uint64_t n) {
    mtp_session_closed(m, sid);  // whatever the block held for this session goes first
    if (!m->mtp || n == 0) return GGSWARM_OK;  // no block here, or none in the snapshot: drafting starts over
    MtpSess ms;
    const uint8_t * blk = nullptr;
    uint64_t blk_bytes = 0;
    ggswarm_status st = parse_trailer(m, len, p, n, &ms, &blk, &blk_bytes);
    if (st) return st;
    MtpBlock & k = *m->mtp;
    if ((st = ggswarm_session_open(k.blk, capacity, &ms.sid))) return fail(m, st, "nextn block: %s", ggswarm_last_error());
    if ((st = ggswarm_session_restore(k.blk, ms.sid, blk, blk_bytes)) || block_len(k, ms) != len) {
        std::string why = st ? std::string(ggswarm_last_error()) : "its snapshot holds another length";
        ggswarm_session_close(k.blk, ms.sid);
        return fail(m, st ? st : GGSWARM_E_MISMATCH, "nextn block: %s", why.c_str());
    }
    k.sess[sid] = std::move(ms);
    return GGSWARM_OK;
}

void mtp_free(ggswarm_model * m) {
    if (!m->mtp) return;
    ggswarm_model_free(m->mtp->blk);  // its sessions, their state and its budget reference
    delete m->mtp;
    m->mtp = nullptr;
}

}  // namespace ggswarm

using namespace ggswarm;

extern "C" {

ggswarm_status ggswarm_mtp_open(ggswarm_model * m, const char * path) {
    GGSWARM_LOCK(m);
    if (!m || !path) return fail(m, GGSWARM_E_INVALID_ARG, "model or path is NULL");
    if (m->mtp) return ok(m);
    if (m->arch != "deepseek4" && m->arch != "glm-dsa") {
        return fail(m, GGSWARM_E_UNSUPPORTED, "multi-token prediction is implemented for deepseek4 and glm-dsa, not %s",
                    m->arch.c_str());
    }
    if (!m->is_last()) return fail(m, GGSWARM_E_INVALID_ARG, "the nextn block attaches to the last window only");
    if (!m->sessions.empty()) return fail(m, GGSWARM_E_INVALID_ARG, "attach the nextn block before opening sessions");
    ggswarm_model * blk = nullptr;
    ggswarm_status st = open_model(path, m->n_layers_total, m->n_layers_total + 1, m->n_threads, m->budget,
                                   m->model_id.c_str(), true, &blk);
    if (st) return fail(m, st, "nextn block: %s", ggswarm_last_error());
    if (blk->d_io() != m->d_io() || blk->n_vocab != m->n_vocab) {
        ggswarm_model_free(blk);
        return fail(m, GGSWARM_E_MISMATCH, "the nextn block of %s does not match this window's rows", path);
    }
    // the window's cache type and attention mode, as llama.cpp's MTP context takes the target's
    int32_t type = GGSWARM_TYPE_F16;
    switch (m->cache_type) {
        case GGML_TYPE_F32: type = GGSWARM_TYPE_F32; break;
        case GGML_TYPE_Q8_0: type = GGSWARM_TYPE_Q8_0; break;
        case GGML_TYPE_Q4_0: type = GGSWARM_TYPE_Q4_0; break;
        default: break;
    }
    if ((st = ggswarm_set_cache_type(blk, type)) ||
        (!ggml_is_quantized(m->cache_type) && blk->flash() != m->flash() &&
         (st = ggswarm_set_flash_attention(blk, m->flash() ? 1 : 0)))) {
        std::string why = ggswarm_last_error();
        ggswarm_model_free(blk);
        return fail(m, st, "nextn block: %s", why.c_str());
    }
    // the block's own head norm and head where the file has them (llama.cpp's shared_head_*)
    Layer & L = blk->layers[0];
    if (L.extra["shared_head_norm"]) blk->output_norm = L.extra["shared_head_norm"];
    if (L.extra["shared_head_head"]) blk->output = L.extra["shared_head_head"];
    m->mtp = new MtpBlock();
    m->mtp->blk = blk;
    m->graphs.clear();  // rebuilt with the rows the block reads (Graph::out_hidden)
    m->graph = nullptr;
    return ok(m);
}

ggswarm_status ggswarm_mtp_draft(ggswarm_model * m, int64_t sid, int32_t pos, int32_t token, int32_t n_draft,
                                 int32_t * drafts_out, float * logits_out, int64_t logits_out_count, int32_t * n_out) {
    GGSWARM_LOCK(m);
    if (!m || !drafts_out || !n_out) return fail(m, GGSWARM_E_INVALID_ARG, "model, drafts_out or n_out is NULL");
    *n_out = 0;
    if (!m->mtp) return fail(m, GGSWARM_E_INVALID_ARG, "no nextn block is attached (ggswarm_mtp_open)");
    if (n_draft < 1 || n_draft > GGSWARM_MTP_MAX_DRAFT) {
        return fail(m, GGSWARM_E_INVALID_ARG, "n_draft %d is outside 1..%d", n_draft, GGSWARM_MTP_MAX_DRAFT);
    }
    if (token < 0 || token >= m->n_vocab) return fail(m, GGSWARM_E_INVALID_ARG, "token %d is outside 0..%d", token, m->n_vocab - 1);
    if (logits_out && logits_out_count < (int64_t)n_draft * m->n_vocab) {
        return fail(m, GGSWARM_E_INVALID_ARG, "logits_out holds %lld elements, need %lld", (long long)logits_out_count,
                    (long long)n_draft * m->n_vocab);
    }
    const Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    MtpBlock & k = *m->mtp;
    auto it = k.sess.find(sid);
    if (pos < 0 || pos > s->len) {
        return fail(m, GGSWARM_E_RANGE, "drafts after position %d: the session holds %d", pos, s->len);
    }
    const int32_t len = pos;  // the positions before the drafts (a verification's that stood: <= the session's)
    if (it == k.sess.end() || it->second.behind || !it->second.sid) {
        return fail(m, GGSWARM_E_RANGE, "session %lld: the nextn block has not followed its positions", (long long)sid);
    }
    MtpSess & ms = it->second;
    if (cut_to(k, ms, len) != len) {
        ms.behind = true;
        return fail(m, GGSWARM_E_RANGE, "session %lld: the nextn block does not hold its first %d positions", (long long)sid, len);
    }
    if (len + n_draft > s->capacity) return fail(m, GGSWARM_E_RANGE, "%d drafts after %d positions exceed the capacity %d", n_draft, len, s->capacity);
    const int64_t w = m->d_io();
    std::vector<float> row;
    if (len == 0) {
        row.assign((size_t)w, 0.0f);
    } else if (const std::vector<float> * p = row_at(ms, len - 1)) {
        row = *p;
    } else {
        return fail(m, GGSWARM_E_RANGE, "session %lld: the trunk's row of position %d is no longer kept", (long long)sid, len - 1);
    }
    ggswarm_status st = GGSWARM_OK;
    int32_t tok = token, n = 0;
    for (; n < n_draft; ++n) {
        int32_t d = 0;
        st = run_block(k, ms, len + n, 1, &tok, row.data(), logits_out ? logits_out + (int64_t)n * m->n_vocab : nullptr, &d);
        if (st) break;
        drafts_out[n] = d;
        // the next draft reads the block's own row of this one (llama.cpp's h_nextn of its MTP context)
        ggml_backend_tensor_get(k.blk->graph->out_hidden, row.data(), 0, sizeof(float) * w);
        tok = d;
    }
    std::string why = st ? std::string(ggswarm_last_error()) : std::string();
    if (cut_to(k, ms, len) != len) ms.behind = true;  // the drafted positions go: the block stays at len
    if (st) return fail(m, st, "nextn block: %s", why.c_str());
    *n_out = n;
    return ok(m);
}

}  // extern "C"
