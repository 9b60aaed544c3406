// The decode lane's lone step: one session's request computed on this hop, relayed on, and answered.

#include "lane.h"

namespace ggswarm::lanes {

// Where a session's errors go: its subscriber (direct mode) or the connection the step came on.
int error_fd(const LaneSession & s, int fd) { return s.sub_fd >= 0 ? s.sub_fd : fd; }

// Whether a pooled connection has something to read now (data or EOF): in direct mode nothing is
// expected on it, so it was closed (idle) or carries a late refusal.
bool readable_now(int fd) {
    pollfd p{fd, POLLIN, 0};
    return poll(&p, 1, 0) > 0;
}

// Send the step on to the next hop: ids, rows, then (direct mode) the timing pairs in `tail`. Relay
// mode waits for the answer and leaves it, opened, in w.answer; direct mode returns once it is sent.
// On failure the outcome names the hop (1: the next one, deeper: its own count) and why.
StepOutcome relay(Worker & w, LaneSession & s, const Header & in, const int32_t * ids, size_t rows_bytes,
                  const std::vector<uint8_t> & tail) {
    const std::string & key = s.next_key;
    const bool direct = s.cfg.answer_direct != 0;
    for (int attempt = 0; attempt < 2; ++attempt) {  // a pooled connection the next hop closed: dial once more
        auto it = w.next_fds.find(key);
        if (it != w.next_fds.end() && direct && readable_now(it->second)) {
            close(it->second);  // closed by the next hop while idle (or a stale frame): start afresh
            w.next_fds.erase(it);
            it = w.next_fds.end();
        }
        int fd = it != w.next_fds.end() ? it->second : connect_to(s.next_host, s.cfg.next_port);
        if (fd < 0) return {GGSWARM_E_IO, 1, "next hop " + key + " unreachable"};
        w.next_fds[key] = fd;
        const size_t ids_bytes = (size_t)in.n_tokens * 4;
        const size_t plen = ids_bytes + rows_bytes + tail.size();
        w.out.resize(kFrameHead + plen);
        Header h{(uint8_t)(s.cfg.hidden_out_type == GGSWARM_TYPE_F16 ? kF16 : kF32), s.cfg.next_lane_id, in.step,
                 in.pos_start, in.n_tokens, (uint32_t)plen, (uint8_t)(tail.size() / 8)};
        write_header(w.out.data(), h);
        memcpy(w.out.data() + kFrameHead, ids, ids_bytes);
        memcpy(w.out.data() + kFrameHead + ids_bytes, w.rows.data(), rows_bytes);
        if (!tail.empty()) memcpy(w.out.data() + kFrameHead + ids_bytes + rows_bytes, tail.data(), tail.size());
        if (!gcm(true, s.cfg.key_out, kDirRequest, in.step, w.out.data(), w.out.data() + kFrameHead, plen)) {
            return {GGSWARM_E_COMPUTE, 0, "sealing failed"};
        }
        const bool sent = send_all(fd, w.out.data(), w.out.size());
        if (direct) {
            if (!sent) {
                close(fd);
                w.next_fds.erase(key);
                if (attempt == 0) continue;
                return {GGSWARM_E_IO, 1, "next hop " + key + " closed"};
            }
            return {};
        }
        uint8_t head[kFrameHead];
        Header a;
        const int got = sent ? recv_all(fd, head, kFrameHead, false, nullptr) : -1;
        if (got != 1) {
            close(fd);
            w.next_fds.erase(key);
            if (attempt == 0 && (!sent || got == 0)) continue;  // closed while idle: the step never ran there
            return {GGSWARM_E_IO, 1, "next hop " + key + " closed or timed out"};
        }
        const bool sane = read_header(head, &a) && a.lane_id == s.cfg.next_lane_id && a.step == in.step &&
                          ((a.kind == kAnswer && a.payload_len >= kAnswerFixed &&
                            a.payload_len <= kAnswerFixed + 8 * GGSWARM_LANE_MAX_HOPS) ||
                           (a.kind == kError && a.payload_len >= 8 && a.payload_len <= 8 + kMessageMax) ||
                           (a.kind == kRefusal && a.payload_len <= kRefusalMax));
        if (!sane) {
            close(fd);
            w.next_fds.erase(key);
            return {GGSWARM_E_FORMAT, 1, "next hop " + key + " answered a malformed frame"};
        }
        w.answer.resize(a.payload_len);
        if (recv_all(fd, w.answer.data(), a.payload_len, false, nullptr) != 1) {
            close(fd);
            w.next_fds.erase(key);
            return {GGSWARM_E_IO, 1, "next hop " + key + " closed mid-answer"};
        }
        if (a.kind == kRefusal) {
            close(fd);  // the next hop closes after a refusal
            w.next_fds.erase(key);
            return {GGSWARM_E_INVALID_ARG, 1, "next hop refused: " + std::string(w.answer.begin(), w.answer.end())};
        }
        memcpy(w.out.data(), head, kFrameHead);  // the tag sits in the header: open against it
        if (!gcm(false, s.cfg.key_out, kDirAnswer, in.step, w.out.data(), w.answer.data(), a.payload_len)) {
            close(fd);
            w.next_fds.erase(key);
            return {GGSWARM_E_FORMAT, 1, "next hop's answer does not open with its key"};
        }
        if (a.kind == kError) {
            StepOutcome o;
            o.status = (int32_t)get_u32(w.answer.data());
            o.hop = 1 + (int32_t)get_u32(w.answer.data() + 4);
            o.message.assign(w.answer.begin() + 8, w.answer.end());
            return o;
        }
        const uint32_t n_hops = get_u32(w.answer.data() + 16);
        if (n_hops > GGSWARM_LANE_MAX_HOPS - 1 || a.payload_len != kAnswerFixed + 8 * n_hops) {
            return {GGSWARM_E_FORMAT, 1, "next hop's answer has a bad hop count"};
        }
        return {};
    }
    return {GGSWARM_E_IO, 1, "next hop " + key + " unreachable"};
}

// An answer frame sealed with the session's key, sent to `to`.
void send_answer(Worker & w, int to, LaneSession & s, const Header & in, int32_t token, double logprob,
                 const uint8_t * pairs, uint32_t n_hops) {
    w.out.clear();
    if (seal_answer(w.out, s, in, token, logprob, pairs, n_hops)) send_all(to, w.out.data(), w.out.size());
}

// Run one opened request frame (payload in w.in) as a step of s and answer upstream on fd (relay mode)
// or let the route's last hop answer the subscriber (direct mode).
void run_step(ggswarm_lane * lane, Worker & w, int fd, LaneSession & s, const Header & in,
              const std::shared_ptr<LaneSession> & sp) {
    ggswarm_model * m = s.cfg.model;
    const auto t0 = Clock::now();
    const int32_t n = in.n_tokens;
    const int32_t * ids = (const int32_t *)w.in.data();
    const int64_t n_rows = (int64_t)n * m->d_io();
    const bool direct = s.cfg.answer_direct != 0;
    const size_t in_rows_bytes = m->is_first() ? 0 : (size_t)n_rows * (in.kind == kF16 ? 2 : 4);
    const uint8_t * timings_in = w.in.data() + (size_t)n * 4 + in_rows_bytes;  // direct mode: earlier hops'
    const size_t n_timings_in = direct ? in.n_timings : 0;
    ggswarm_batch b{};
    b.n_tokens = n;
    b.pos_start = in.pos_start;
    if (m->is_first() || m->needs_ids() || m->mtp) b.token_ids = ids;  // an attached nextn block reads them
    if (!m->is_first()) {
        b.hidden_in = w.in.data() + (size_t)n * 4;
        b.hidden_in_count = n_rows;
        b.hidden_in_type = in.kind == kF16 ? GGSWARM_TYPE_F16 : GGSWARM_TYPE_F32;
    }
    int32_t token = -1;
    double logprob = 0.0, compute_s = 0.0;
    size_t rows_bytes = 0;
    if (m->is_last()) {
        if (direct && s.sub_fd < 0) {
            send_error(fd, s, in, GGSWARM_E_INVALID_ARG, 0, "no subscriber for the route's answers", w.out);
            return;
        }
        s.history.insert(s.history.end(), ids, ids + n);
        const ggswarm_sampling & p = s.sampling;
        const bool penalty = s.has_sampling && p.repeat_penalty != 1.0 && p.repeat_last_n != 0;
        if (penalty) {
            const size_t keep = p.repeat_last_n < 0 ? s.history.size()
                                                     : std::min(s.history.size(), (size_t)p.repeat_last_n);
            b.history = s.history.data() + (s.history.size() - keep);
            b.n_history = (int32_t)keep;
        }
        b.sampling = s.has_sampling ? &s.sampling : nullptr;
        b.token_out = &token;
        b.logprob_out = &logprob;
    } else {
        b.hidden_out_type = s.cfg.hidden_out_type;
        rows_bytes = (size_t)n_rows * (s.cfg.hidden_out_type == GGSWARM_TYPE_F16 ? 2 : 4);
        w.rows.resize(rows_bytes);
        b.hidden_out = w.rows.data();
        b.hidden_out_count = n_rows;
    }
    b.compute_s_out = &compute_s;
    ggswarm_lane_batch done{};
    ggswarm_status st = GGSWARM_OK;
    timed_under_lock(lane, m, done, [&] { st = ggswarm_forward(m, s.cfg.sid, &b); });
    if (st != GGSWARM_OK) {
        if (m->is_last()) s.history.resize(s.history.size() - (size_t)n);
        send_error(error_fd(s, fd), s, in, st, 0, ggswarm_last_error(), w.out);
        return;
    }
    s.steps++;
    done.steps = 1;
    done.positions = n;
    done.sampled = m->is_last() ? 1 : 0;
    note_pass(lane, done);
    // this hop's timing pair, after the earlier hops' (direct mode) or before the later ones' (relay)
    uint8_t own[8];
    put_u32(own, (uint32_t)(compute_s * 1e6));
    put_u32(own + 4, (uint32_t)(std::chrono::duration<double>(Clock::now() - t0).count() * 1e6));
    std::vector<uint8_t> & pairs = w.pairs;  // reused: nothing is allocated per step once warm
    pairs.assign(timings_in, timings_in + 8 * n_timings_in);
    if (direct) {
        pairs.insert(pairs.end(), own, own + 8);
        if (m->is_last()) {
            send_answer(w, s.sub_fd, s, in, token, logprob, pairs.data(), (uint32_t)(pairs.size() / 8));
            return;
        }
        StepOutcome o = relay(w, s, in, ids, rows_bytes, pairs);
        if (o.status != GGSWARM_OK) {
            send_error(error_fd(s, fd), s, in, o.status, o.hop, o.message, w.out);
            return;
        }
        w.pending = sp;
        w.pending_step = in.step;
        w.pending_fd = w.next_fds[s.next_key];
        return;
    }
    uint32_t n_hops_below = 0;
    pairs.assign(own, own + 8);
    if (!m->is_last()) {
        StepOutcome o = relay(w, s, in, ids, rows_bytes, {});
        if (o.status != GGSWARM_OK) {
            // the hops below did not take the step: undo it here so the route stays at one length
            ggswarm_session_truncate(m, s.cfg.sid, in.pos_start);
            send_error(fd, s, in, o.status, o.hop, o.message, w.out);
            return;
        }
        memcpy(&token, w.answer.data(), 4);
        memcpy(&logprob, w.answer.data() + 8, 8);
        n_hops_below = get_u32(w.answer.data() + 16);
        pairs.insert(pairs.end(), w.answer.begin() + kAnswerFixed, w.answer.begin() + kAnswerFixed + 8 * n_hops_below);
    }
    send_answer(w, fd, s, in, token, logprob, pairs.data(), n_hops_below + 1);
}

// The bytes a request of `n` positions must carry for this session's window (ids, boundary rows, then
// in direct mode the earlier hops' timing pairs).
size_t expected_payload(const LaneSession & s, const Header & in) {
    const size_t n = (size_t)in.n_tokens;
    const size_t tail = s.cfg.answer_direct ? 8 * (size_t)in.n_timings : 0;
    if (!s.cfg.answer_direct && in.n_timings) return 0;
    if (s.first) return in.kind == kIds ? n * 4 + tail : 0;
    if (in.kind != kF16 && in.kind != kF32) return 0;
    return n * 4 + n * (size_t)s.d_io * (in.kind == kF16 ? 2 : 4) + tail;
}

}  // namespace ggswarm::lanes
