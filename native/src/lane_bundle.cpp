// Lane bundles (API v8, docs/lane.md "Bundles"): several sessions' steps in one frame, run as one
// ggswarm_forward_many batch and sent on to the next hop as one bundle.
//
// Why: sessions decoding together are what a swarm serves, and on the Python path eight of them cost
// about 2 ms of interpreter per hop step beyond their batch (docs/benchmarks.md); sent as lone lane
// frames they would not batch at all (each would wait for the handle's lock). A bundle keeps both: no
// interpreter on the path, and one graph for all of its members.
//
// A bundle is checked whole before anything runs: every member's head against its session and window,
// then, under every member's lock (taken in address order, so two bundles sharing sessions cannot
// deadlock), its step number and its seal. Any failure refuses the whole bundle and spends no step, so
// the client may send the same steps again alone. Once it runs, each member succeeds or fails on its
// own: a member the next hop fails is truncated back here, as a lone step would be.

#include <algorithm>
#include <numeric>

#include "lane.h"

namespace ggswarm::lanes {
namespace {

// Longest answer member a next hop may send: an answer with every hop's timings, or an error.
constexpr size_t kAnswerMemberMax = kFrameHead + std::max(kAnswerFixed + 8 * GGSWARM_LANE_MAX_HOPS, 8 + kMessageMax);

struct Member {
    std::shared_ptr<LaneSession> sp;
    Header in;
    uint8_t head[kFrameHead];
    int32_t status = GGSWARM_OK, hop = 0;  // outcome: its hop counted from this one when failed
    std::string message;
    int32_t token = -1;
    double logprob = 0.0, compute_s = 0.0;
    std::vector<uint8_t> below;  // timing pairs of the hops after this one
    bool ran = false;            // the step ran on this hop (and must be undone if a later hop fails it)
};

void fail_member(Member & mb, int32_t status, int32_t hop, std::string msg) {
    mb.status = status;
    mb.hop = hop;
    mb.message = std::move(msg);
}

// Send the members that ran here on to the next hop as one bundle and read its answers into them.
// Returns false when the bundle as a whole failed (the members then carry that failure).
bool relay_bundle(Worker & w, std::vector<Member> & ms, const std::vector<size_t> & todo, const LaneSession & s0) {
    const std::string & key = s0.next_key;
    const bool f16 = s0.cfg.hidden_out_type == GGSWARM_TYPE_F16;
    auto fail_all = [&](int32_t status, const std::string & msg) {
        for (size_t i : todo) fail_member(ms[i], status, 1, msg);
        return false;
    };
    for (int attempt = 0; attempt < 2; ++attempt) {  // a pooled connection the next hop closed: dial once more
        auto it = w.next_fds.find(key);
        int fd = it != w.next_fds.end() ? it->second : connect_to(s0.next_host, s0.cfg.next_port);
        if (fd < 0) return fail_all(GGSWARM_E_IO, "next hop " + key + " unreachable");
        w.next_fds[key] = fd;
        w.out.assign(kFrameHead, 0);
        for (size_t j = 0; j < todo.size(); ++j) {
            Member & mb = ms[todo[j]];
            const LaneSession & s = *mb.sp;
            const std::vector<uint8_t> & rows = w.bundle_rows[todo[j]];
            const size_t ids_bytes = (size_t)mb.in.n_tokens * 4, plen = ids_bytes + rows.size(), at = w.out.size();
            w.out.resize(at + kFrameHead + plen);
            uint8_t * f = w.out.data() + at;
            Header h{(uint8_t)(f16 ? kF16 : kF32), s.cfg.next_lane_id, mb.in.step, mb.in.pos_start, mb.in.n_tokens,
                     (uint32_t)plen};
            write_header(f, h);
            memcpy(f + kFrameHead, w.bundle_in[todo[j]].data(), ids_bytes);  // the ids, opened in place
            memcpy(f + kFrameHead + ids_bytes, rows.data(), rows.size());
            if (!gcm(true, s.cfg.key_out, kDirRequest, mb.in.step, f, f + kFrameHead, plen)) {
                return fail_all(GGSWARM_E_COMPUTE, "sealing failed");
            }
        }
        Header outer{kBundle, 0, 0, 0, (int32_t)todo.size(), (uint32_t)(w.out.size() - kFrameHead)};
        write_header(w.out.data(), outer);
        const bool sent = send_all(fd, w.out.data(), w.out.size());
        uint8_t head[kFrameHead];
        Header a;
        const int got = sent ? recv_all(fd, head, kFrameHead, false, nullptr) : -1;
        auto drop = [&]() {
            close(fd);
            w.next_fds.erase(key);
        };
        if (got != 1) {
            drop();
            if (attempt == 0 && (!sent || got == 0)) continue;  // closed while idle: the bundle never ran there
            return fail_all(GGSWARM_E_IO, "next hop " + key + " closed or timed out");
        }
        const bool sane = read_header(head, &a) && a.lane_id == 0 && a.step == 0 &&
                          ((a.kind == kBundleAnswer && a.n_tokens == (int32_t)todo.size() &&
                            a.payload_len <= todo.size() * kAnswerMemberMax) ||
                           (a.kind == kRefusal && a.payload_len <= kRefusalMax));
        if (!sane) {
            drop();
            return fail_all(GGSWARM_E_FORMAT, "next hop " + key + " answered a malformed bundle");
        }
        w.answer.resize(a.payload_len);
        if (recv_all(fd, w.answer.data(), a.payload_len, false, nullptr) != 1) {
            drop();
            return fail_all(GGSWARM_E_IO, "next hop " + key + " closed mid-answer");
        }
        if (a.kind == kRefusal) {
            drop();  // the next hop closes after a refusal
            return fail_all(GGSWARM_E_INVALID_ARG, "next hop refused: " + std::string(w.answer.begin(), w.answer.end()));
        }
        size_t off = 0;
        for (size_t i : todo) {
            Member & mb = ms[i];
            const LaneSession & s = *mb.sp;
            Header r;
            uint8_t * f = w.answer.data() + off;
            const bool ok = off + kFrameHead <= w.answer.size() && read_header(f, &r) &&
                            r.lane_id == s.cfg.next_lane_id && r.step == mb.in.step &&
                            off + kFrameHead + r.payload_len <= w.answer.size() &&
                            ((r.kind == kAnswer && r.payload_len >= kAnswerFixed &&
                              r.payload_len <= kAnswerFixed + 8 * (GGSWARM_LANE_MAX_HOPS - 1)) ||
                             (r.kind == kError && r.payload_len >= 8 && r.payload_len <= 8 + kMessageMax)) &&
                            gcm(false, s.cfg.key_out, kDirAnswer, mb.in.step, f, f + kFrameHead, r.payload_len);
            if (!ok) {
                drop();
                return fail_all(GGSWARM_E_FORMAT, "next hop " + key + " answered a malformed or unsealed bundle member");
            }
            const uint8_t * p = f + kFrameHead;
            if (r.kind == kError) {
                fail_member(mb, (int32_t)get_u32(p), 1 + (int32_t)get_u32(p + 4),
                            std::string((const char *)p + 8, r.payload_len - 8));
            } else {
                const uint32_t n_hops = get_u32(p + 16);
                if (r.payload_len != kAnswerFixed + 8 * (size_t)n_hops) {
                    drop();
                    return fail_all(GGSWARM_E_FORMAT, "next hop's answer has a bad hop count");
                }
                memcpy(&mb.token, p, 4);
                memcpy(&mb.logprob, p + 8, 8);
                mb.below.assign(p + kAnswerFixed, p + kAnswerFixed + 8 * (size_t)n_hops);
            }
            off += kFrameHead + r.payload_len;
        }
        if (off != w.answer.size()) {
            drop();
            return fail_all(GGSWARM_E_FORMAT, "next hop's bundle answer is longer than its members");
        }
        return true;
    }
    return fail_all(GGSWARM_E_IO, "next hop " + key + " unreachable");
}

}  // namespace

bool serve_bundle(ggswarm_lane * lane, Worker & w, int fd, const Header & outer) {
    if (outer.lane_id || outer.step || outer.pos_start || outer.n_timings || outer.n_tokens < 1 ||
        outer.n_tokens > GGSWARM_LANE_MAX_BUNDLE) {
        refuse(fd, outer, "bad bundle head");
        return false;
    }
    const size_t k = (size_t)outer.n_tokens;
    std::vector<Member> ms(k);
    if (w.bundle_in.size() < k) w.bundle_in.resize(k);
    if (w.bundle_rows.size() < k) w.bundle_rows.resize(k);
    // 1. every member's head against its session and window, before its payload is buffered
    size_t left = outer.payload_len;
    for (size_t i = 0; i < k; ++i) {
        Member & mb = ms[i];
        if (left < kFrameHead) { refuse(fd, outer, "bundle shorter than its members"); return false; }
        if (recv_all(fd, mb.head, kFrameHead, false, nullptr) != 1) return false;
        left -= kFrameHead;
        Header & in = mb.in;
        if (!read_header(mb.head, &in) || (in.kind != kIds && in.kind != kF16 && in.kind != kF32) || in.n_timings) {
            refuse(fd, outer, "a bundle member is not a request");
            return false;
        }
        if (in.n_tokens < 1 || in.n_tokens > GGSWARM_LANE_MAX_TOKENS) { refuse(fd, outer, "bad position count"); return false; }
        {
            std::lock_guard<std::mutex> lk(lane->mu);
            auto it = lane->sessions.find(in.lane_id);
            if (it != lane->sessions.end()) mb.sp = it->second;
        }
        if (!mb.sp) { refuse(fd, outer, "unknown lane session"); return false; }
        const LaneSession & s = *mb.sp;
        const LaneSession & s0 = *ms[0].sp;
        for (size_t j = 0; j < i; ++j) {
            if (ms[j].sp == mb.sp) { refuse(fd, outer, "a session twice in one bundle"); return false; }
        }
        // cfg and next_key are fixed at admission: comparing them needs no lock
        if (s.cfg.answer_direct) { refuse(fd, outer, "direct-mode sessions travel alone"); return false; }
        if (s.cfg.model != s0.cfg.model || s.next_key != s0.next_key || s.cfg.hidden_out_type != s0.cfg.hidden_out_type) {
            refuse(fd, outer, "a bundle's sessions must share a window and a next hop");
            return false;
        }
        const size_t want = expected_payload(s, in);
        if (want == 0 || in.payload_len != want || want > left) {
            refuse(fd, outer, "payload size does not fit the window");
            return false;
        }
        w.bundle_in[i].resize(want);
        if (recv_all(fd, w.bundle_in[i].data(), want, false, nullptr) != 1) return false;
        left -= want;
    }
    if (left) { refuse(fd, outer, "bundle longer than its members"); return false; }
    // 2. under every member's lock: still admitted, a step not yet spent, sealed with its key
    std::vector<size_t> order(k);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ms[a].sp.get() < ms[b].sp.get(); });
    std::vector<std::unique_lock<std::mutex>> locks;
    locks.reserve(k);
    for (size_t i : order) locks.emplace_back(ms[i].sp->mu);
    for (size_t i = 0; i < k; ++i) {
        Member & mb = ms[i];
        LaneSession & s = *mb.sp;
        if (s.removed) { refuse(fd, outer, "unknown lane session"); return false; }
        if (mb.in.step < s.next_step) { refuse(fd, outer, "stale or replayed step"); return false; }
        if (!gcm(false, s.cfg.key_in, kDirRequest, mb.in.step, mb.head, w.bundle_in[i].data(), mb.in.payload_len)) {
            refuse(fd, outer, "frame does not open with the session's key");
            return false;
        }
    }
    // 3. spent and run as one batch
    const auto t0 = Clock::now();
    ggswarm_model * m = ms[0].sp->cfg.model;  // alive: no member was removed, and removal waits for our locks
    const bool last = m->is_last(), first = m->is_first();
    std::vector<int64_t> sids(k);
    std::vector<ggswarm_batch> batches(k);
    std::vector<ggswarm_status> statuses(k, GGSWARM_OK);
    for (size_t i = 0; i < k; ++i) {
        Member & mb = ms[i];
        LaneSession & s = *mb.sp;
        s.next_step = mb.in.step + 1;
        s.busy = true;
        const int32_t n = mb.in.n_tokens;
        const int32_t * ids = (const int32_t *)w.bundle_in[i].data();
        const int64_t n_rows = (int64_t)n * m->d_io();
        ggswarm_batch & b = batches[i];
        b.n_tokens = n;
        b.pos_start = mb.in.pos_start;
        if (first || m->needs_ids() || m->mtp) b.token_ids = ids;  // an attached nextn block reads them
        if (!first) {
            b.hidden_in = w.bundle_in[i].data() + (size_t)n * 4;
            b.hidden_in_count = n_rows;
            b.hidden_in_type = mb.in.kind == kF16 ? GGSWARM_TYPE_F16 : GGSWARM_TYPE_F32;
        }
        if (last) {
            s.history.insert(s.history.end(), ids, ids + n);
            const ggswarm_sampling & p = s.sampling;
            if (s.has_sampling && p.repeat_penalty != 1.0 && p.repeat_last_n != 0) {
                const size_t keep = p.repeat_last_n < 0 ? s.history.size()
                                                         : std::min(s.history.size(), (size_t)p.repeat_last_n);
                b.history = s.history.data() + (s.history.size() - keep);
                b.n_history = (int32_t)keep;
            }
            b.sampling = s.has_sampling ? &s.sampling : nullptr;
            b.token_out = &mb.token;
            b.logprob_out = &mb.logprob;
        } else {
            b.hidden_out_type = s.cfg.hidden_out_type;
            std::vector<uint8_t> & rows = w.bundle_rows[i];
            rows.resize((size_t)n_rows * (s.cfg.hidden_out_type == GGSWARM_TYPE_F16 ? 2 : 4));
            b.hidden_out = rows.data();
            b.hidden_out_count = n_rows;
        }
        b.compute_s_out = &mb.compute_s;
        sids[i] = s.cfg.sid;
    }
    ggswarm_lane_batch done{};
    timed_under_lock(lane, m, done, [&] {  // the per-step messages are read under the lock: they stay ours till then
        ggswarm_forward_many(m, (int32_t)k, sids.data(), batches.data(), statuses.data());
        for (size_t i = 0; i < k; ++i) {
            if (statuses[i] != GGSWARM_OK) fail_member(ms[i], statuses[i], 0, ggswarm_forward_many_error(m, (int32_t)i));
        }
    });
    const uint32_t handler_us = (uint32_t)(std::chrono::duration<double>(Clock::now() - t0).count() * 1e6);
    std::vector<size_t> ran;
    for (size_t i = 0; i < k; ++i) {
        Member & mb = ms[i];
        if (mb.status != GGSWARM_OK) {
            if (last) mb.sp->history.resize(mb.sp->history.size() - (size_t)mb.in.n_tokens);
            continue;
        }
        mb.ran = true;
        mb.sp->steps++;
        ran.push_back(i);
        done.steps++;
        done.positions += mb.in.n_tokens;
    }
    done.sampled = last ? done.steps : 0;
    note_pass(lane, done);
    // 4. on to the next hop; a member it did not take is undone here, so the route keeps one length
    if (!last && !ran.empty()) {
        relay_bundle(w, ms, ran, *ms[ran[0]].sp);
        for (size_t i : ran) {
            if (ms[i].status != GGSWARM_OK) ggswarm_session_truncate(m, ms[i].sp->cfg.sid, ms[i].in.pos_start);
        }
    }
    // 5. one answer: each member's sealed answer or error, in the bundle's order
    w.out.assign(kFrameHead, 0);
    bool sealed = true;
    for (size_t i = 0; i < k && sealed; ++i) {
        Member & mb = ms[i];
        if (mb.status != GGSWARM_OK) {
            sealed = seal_error(w.out, *mb.sp, mb.in, mb.status, mb.hop, mb.message);
            continue;
        }
        uint8_t own[8];
        put_u32(own, (uint32_t)(mb.compute_s * 1e6));
        put_u32(own + 4, handler_us);
        w.pairs.assign(own, own + 8);
        w.pairs.insert(w.pairs.end(), mb.below.begin(), mb.below.end());
        sealed = seal_answer(w.out, *mb.sp, mb.in, mb.token, mb.logprob, w.pairs.data(), (uint32_t)(w.pairs.size() / 8));
    }
    const auto now = Clock::now();
    for (Member & mb : ms) {
        mb.sp->last_used = now;  // before busy goes (ggswarm_lane_activity reads busy, then this)
        mb.sp->busy = false;
    }
    if (!sealed) return false;
    Header h{kBundleAnswer, 0, 0, 0, (int32_t)k, (uint32_t)(w.out.size() - kFrameHead)};
    write_header(w.out.data(), h);
    return send_all(fd, w.out.data(), w.out.size());
}

}  // namespace ggswarm::lanes
