// The decode lane (API v7): a session's small steps relayed hop to hop on libggswarm's own threads.
//
// Why: served over Python's event loop a hop costs 0.6-1.0 ms per decode step beyond its compute, and a
// bare aiohttp WebSocket relay alone 0.36-0.55 ms (docs/benchmarks.md). Here a connection is one thread
// blocked in recv(): a frame is read, opened, computed and sent on with no interpreter, no event loop
// and no allocation on the hot path. Frame format and security argument: docs/lane.md.
//
// Threads: one acceptor (polls the listener so ggswarm_lane_free can stop it) and one thread per open
// connection. A session is run by one step at a time (its own mutex); the model handle's lock
// (GGSWARM_LOCK) serialises lane steps with the caller's own calls on the same handle.

#include "lane.h"

namespace ggswarm::lanes {

// AES-256-GCM in place; nonce = direction (4 bytes) + step (8 bytes); the 40-byte header is the AAD.
// One context per thread and direction of use, keyed per call (a key schedule costs well under 1 us).
struct CipherCtx {
    EVP_CIPHER_CTX * ctx = EVP_CIPHER_CTX_new();
    ~CipherCtx() { EVP_CIPHER_CTX_free(ctx); }
};

bool gcm(bool enc, const uint8_t * key, uint32_t dir, uint64_t step, uint8_t * frame, uint8_t * payload, size_t len) {
    thread_local CipherCtx c_enc, c_dec;
    EVP_CIPHER_CTX * ctx = enc ? c_enc.ctx : c_dec.ctx;
    if (!ctx) return false;
    uint8_t iv[12];
    put_u32(iv, dir);
    put_u64(iv + 4, step);
    int n = 0;
    uint8_t * tag = frame + kHeader;
    if (EVP_CipherInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key, iv, enc ? 1 : 0) != 1) return false;
    if (EVP_CipherUpdate(ctx, nullptr, &n, frame, (int)kHeader) != 1) return false;
    if (len && EVP_CipherUpdate(ctx, payload, &n, payload, (int)len) != 1) return false;
    if (!enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, (int)kTag, tag) != 1) return false;
    if (EVP_CipherFinal_ex(ctx, payload + len, &n) != 1) return false;  // decrypt: the tag check
    if (enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, (int)kTag, tag) != 1) return false;
    return true;
}

bool send_all(int fd, const uint8_t * p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

// 1: read whole; 0: clean EOF before the first byte; -1: error, timeout or EOF mid-way. idle_ok: a
// timeout before the first byte keeps waiting (an idle persistent connection) until idle_limit_s.
int recv_all(int fd, uint8_t * p, size_t n, bool idle_ok, const std::atomic<bool> * stop) {
    size_t got = 0;
    auto idle_since = Clock::now();
    while (got < n) {
        ssize_t r = recv(fd, p + got, n - got, 0);
        if (r > 0) { got += (size_t)r; continue; }
        if (r == 0) return got == 0 ? 0 : -1;
        if (errno == EINTR) continue;
        if ((errno == EAGAIN || errno == EWOULDBLOCK) && got == 0 && idle_ok && !(stop && *stop) &&
            Clock::now() - idle_since < std::chrono::seconds(kIdleCloseS)) {
            continue;
        }
        return -1;
    }
    return 1;
}

void set_timeouts(int fd, int secs) {
    timeval tv{secs, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}



// A refusal names no session state and is not sealed: what fails before a key is known to match.
void refuse(int fd, const Header & in, const char * msg) {
    uint8_t buf[kFrameHead + kRefusalMax];
    size_t n = std::min(strlen(msg), kRefusalMax);
    Header h{kRefusal, in.lane_id, in.step, in.pos_start, 0, (uint32_t)n};
    write_header(buf, h);
    memcpy(buf + kFrameHead, msg, n);
    send_all(fd, buf, kFrameHead + n);
}

// A sealed error answer: status, the hop it came from (0: this one) and a message.
bool seal_error(std::vector<uint8_t> & out, const LaneSession & s, const Header & in, int32_t status, int32_t hop,
                const std::string & msg) {
    const size_t n = std::min(msg.size(), kMessageMax), at = out.size();
    out.resize(at + kFrameHead + 8 + n, 0);
    uint8_t * f = out.data() + at;
    Header h{kError, in.lane_id, in.step, in.pos_start, in.n_tokens, (uint32_t)(8 + n)};
    write_header(f, h);
    put_u32(f + kFrameHead, (uint32_t)status);
    put_u32(f + kFrameHead + 4, (uint32_t)hop);
    memcpy(f + kFrameHead + 8, msg.data(), n);
    if (gcm(true, s.cfg.key_in, kDirAnswer, in.step, f, f + kFrameHead, 8 + n)) return true;
    out.resize(at);
    return false;
}

void send_error(int fd, const LaneSession & s, const Header & in, int32_t status, int32_t hop, const std::string & msg,
                std::vector<uint8_t> & out) {
    out.clear();
    if (seal_error(out, s, in, status, hop, msg)) send_all(fd, out.data(), out.size());
}

int connect_to(const std::string & host, int32_t port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) return -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    set_timeouts(fd, kDownstreamTimeoutS);
    if (connect(fd, (sockaddr *)&a, sizeof(a)) != 0) { close(fd); return -1; }
    return fd;
}

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

bool seal_answer(std::vector<uint8_t> & out, const LaneSession & s, const Header & in, int32_t token, double logprob,
                 const uint8_t * pairs, uint32_t n_hops) {
    const size_t plen = kAnswerFixed + 8 * (size_t)n_hops, at = out.size();
    out.resize(at + kFrameHead + plen, 0);
    uint8_t * f = out.data() + at;
    Header h{kAnswer, in.lane_id, in.step, in.pos_start, in.n_tokens, (uint32_t)plen};
    write_header(f, h);
    uint8_t * p = f + kFrameHead;
    put_u32(p, (uint32_t)token);
    put_u32(p + 4, (uint32_t)(in.pos_start + in.n_tokens));
    memcpy(p + 8, &logprob, 8);
    put_u32(p + 16, n_hops);
    memcpy(p + kAnswerFixed, pairs, 8 * (size_t)n_hops);
    if (gcm(true, s.cfg.key_in, kDirAnswer, in.step, f, p, plen)) return true;
    out.resize(at);
    return false;
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
    if (m->is_first() || m->needs_ids()) b.token_ids = ids;
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
    timed_under_lock(m, done, [&] { st = ggswarm_forward(m, s.cfg.sid, &b); });
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

// Direct mode: something arrived on a connection to a next hop, where nothing is expected. A refusal
// of the step this thread sent on, or the connection closing, means the route's answer will not come:
// tell the session's subscriber (the client truncates the route back). Anything else closes it too.
void downstream_event(Worker & w, int dfd) {
    uint8_t head[kFrameHead];
    Header a;
    bool refused_pending = false;
    const ssize_t r = recv(dfd, head, kFrameHead, MSG_WAITALL);
    if (r == (ssize_t)kFrameHead && read_header(head, &a) && a.kind == kRefusal && w.pending &&
        a.step == w.pending_step) {
        refused_pending = true;
    }
    const bool lost = r != (ssize_t)kFrameHead || refused_pending;
    for (auto it = w.next_fds.begin(); it != w.next_fds.end(); ++it) {
        if (it->second == dfd) { w.next_fds.erase(it); break; }
    }
    close(dfd);
    if (lost && w.pending && w.pending_fd == dfd) {
        std::lock_guard<std::mutex> lk(w.pending->mu);
        LaneSession & s = *w.pending;
        if (!s.removed && s.sub_fd >= 0) {
            Header in{kF32, s.cfg.lane_id, w.pending_step, 0, 0, 0};
            send_error(s.sub_fd, s, in, GGSWARM_E_IO, 1,
                       refused_pending ? "the next hop refused the step" : "the next hop closed the connection", w.out);
        }
    }
    if (w.pending_fd == dfd) w.pending.reset();
}

// Waits until fd has a frame to read while watching this thread's connections to next hops (direct
// mode expects nothing on them: a refusal or a close is reported by downstream_event). 1: fd is
// readable, or no next-hop connection is left to watch; -1: stopping, an error, or idle too long.
int wait_upstream(Worker & w, int fd, const std::atomic<bool> & stop) {
    const auto since = Clock::now();
    while (!w.next_fds.empty()) {
        std::vector<pollfd> & p = w.polls;  // reused across steps
        p.assign(1, pollfd{fd, POLLIN, 0});
        for (auto & kv : w.next_fds) p.push_back({kv.second, POLLIN, 0});
        const int r = poll(p.data(), p.size(), 1000);
        if (r < 0 && errno != EINTR) return -1;
        if (stop) return -1;
        if (r > 0) {
            for (size_t i = 1; i < p.size(); ++i) {
                if (p[i].revents) downstream_event(w, p[i].fd);
            }
            if (p[0].revents) return 1;
        }
        if (Clock::now() - since > std::chrono::seconds(kIdleCloseS)) return -1;
    }
    return 1;
}

void serve_conn(ggswarm_lane * lane, Conn * c) {
    Worker w;
    const int fd = c->fd;
    std::shared_ptr<LaneSession> subscribed;  // the session this connection receives answers for
    uint8_t head[kFrameHead];
    for (;;) {
        if (wait_upstream(w, fd, lane->stop) != 1) break;
        if (recv_all(fd, head, kFrameHead, true, &lane->stop) != 1) break;
        w.pending.reset();  // a new step: the previous one was answered
        Header in;
        if (!read_header(head, &in)) { refuse(fd, in, "not a lane frame"); break; }
        if (in.kind == kBundle) {
            if (!serve_bundle(lane, w, fd, in)) break;
            continue;
        }
        const bool sub = in.kind == kSubscribe;
        if (!sub && in.kind != kIds && in.kind != kF16 && in.kind != kF32) { refuse(fd, in, "not a request"); break; }
        if (sub ? (in.n_tokens != 0 || in.payload_len != 0 || in.n_timings != 0)
                : (in.n_tokens < 1 || in.n_tokens > GGSWARM_LANE_MAX_TOKENS)) {
            refuse(fd, in, "bad position count");
            break;
        }
        std::shared_ptr<LaneSession> sp;
        {
            std::lock_guard<std::mutex> lk(lane->mu);
            auto it = lane->sessions.find(in.lane_id);
            if (it != lane->sessions.end()) sp = it->second;
        }
        if (!sp) { refuse(fd, in, "unknown lane session"); break; }
        LaneSession & s = *sp;
        // sizes come from the session's window, checked before a byte of payload is buffered
        const size_t want = sub ? 0 : expected_payload(s, in);
        if (!sub && (want == 0 || in.payload_len != want)) { refuse(fd, in, "payload size does not fit the window"); break; }
        w.in.resize(want);
        if (want && recv_all(fd, w.in.data(), want, false, nullptr) != 1) break;
        // a step of the session running on another connection finishes first (a client sends one at a time)
        std::unique_lock<std::mutex> lk(s.mu);
        if (s.removed) { refuse(fd, in, "unknown lane session"); break; }
        if (in.step < s.next_step) { refuse(fd, in, "stale or replayed step"); break; }
        if (!gcm(false, s.cfg.key_in, kDirRequest, in.step, head, w.in.data(), want)) {
            refuse(fd, in, "frame does not open with the session's key");
            break;
        }
        s.next_step = in.step + 1;
        if (sub) {  // answers (last window) and errors of this session come here from now on
            s.sub_fd = fd;
            subscribed = sp;
            uint8_t ack[kFrameHead];
            Header h{kSubscribed, in.lane_id, in.step, 0, 0, 0};
            write_header(ack, h);
            if (gcm(true, s.cfg.key_in, kDirAnswer, in.step, ack, ack + kFrameHead, 0)) send_all(fd, ack, kFrameHead);
            continue;
        }
        s.busy = true;
        run_step(lane, w, fd, s, in, sp);
        s.busy = false;
        s.last_used = Clock::now();
    }
    if (subscribed) {
        std::lock_guard<std::mutex> lk(subscribed->mu);
        if (subscribed->sub_fd == fd) subscribed->sub_fd = -1;
    }
    shutdown(fd, SHUT_RDWR);
    c->done = true;
}

void accept_loop(ggswarm_lane * lane) {
    pollfd pfd{lane->listen_fd, POLLIN, 0};
    while (!lane->stop) {
        {  // join finished connections' threads
            std::lock_guard<std::mutex> lk(lane->mu);
            for (auto it = lane->conns.begin(); it != lane->conns.end();) {
                if ((*it)->done) {
                    (*it)->th.join();
                    close((*it)->fd);
                    it = lane->conns.erase(it);
                } else {
                    ++it;
                }
            }
        }
        if (poll(&pfd, 1, 100) <= 0) continue;
        int fd = accept4(lane->listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) continue;
        std::lock_guard<std::mutex> lk(lane->mu);
        if (lane->conns.size() >= GGSWARM_LANE_MAX_CONNECTIONS || lane->stop) { close(fd); continue; }
        set_timeouts(fd, kRecvTimeoutS);
        auto c = std::make_unique<Conn>();
        c->fd = fd;
        Conn * cp = c.get();
        lane->conns.push_back(std::move(c));
        cp->th = std::thread(serve_conn, lane, cp);
    }
}

void fill_stats(LaneSession & s, ggswarm_lane_stats * out) {
    out->steps = s.steps;
    out->next_step = s.next_step;
    out->idle_s = std::chrono::duration<double>(Clock::now() - s.last_used).count();
    out->busy = s.busy ? 1 : 0;
    out->n_appended = (int32_t)(s.history.size() - s.n_initial);
}

}  // namespace ggswarm::lanes

void ggswarm::lanes::note_pass(ggswarm_lane * lane, const ggswarm_lane_batch & done) {
    {
        std::lock_guard<std::mutex> lk(lane->pass_mu);
        lane->passes++;
        lane->last_pass = Clock::now();
        const size_t cap = lane->log.size();
        if (lane->log_count == cap) {  // full: the oldest goes, counted
            lane->log_head = (lane->log_head + 1) % cap;
            lane->log_count--;
            lane->log_dropped++;
        }
        lane->log[(lane->log_head + lane->log_count) % cap] = done;
        lane->log_count++;
    }
    lane->pass_cv.notify_all();
}

using ggswarm::fail;
using namespace ggswarm::lanes;

extern "C" {

ggswarm_status ggswarm_lane_open(const char * bind_host, int32_t port, ggswarm_lane ** out) {
    if (!bind_host || !out || port < 0 || port > 65535) return fail(nullptr, GGSWARM_E_INVALID_ARG, "bad lane address");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, bind_host, &a.sin_addr) != 1) {
        return fail(nullptr, GGSWARM_E_INVALID_ARG, "lane address '%s' is not a numeric IPv4 address", bind_host);
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd < 0) return fail(nullptr, GGSWARM_E_IO, "socket: %s", strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    socklen_t len = sizeof(a);
    if (bind(fd, (sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 64) != 0 || getsockname(fd, (sockaddr *)&a, &len) != 0) {
        int e = errno;
        close(fd);
        return fail(nullptr, GGSWARM_E_IO, "lane cannot listen on %s:%d: %s", bind_host, port, strerror(e));
    }
    auto * lane = new (std::nothrow) ggswarm_lane();
    if (!lane) { close(fd); return fail(nullptr, GGSWARM_E_NO_MEMORY, "out of memory"); }
    try {
        lane->log.resize(GGSWARM_LANE_BATCH_LOG);
    } catch (const std::bad_alloc &) {
        delete lane;
        close(fd);
        return fail(nullptr, GGSWARM_E_NO_MEMORY, "out of memory");
    }
    lane->listen_fd = fd;
    lane->port = ntohs(a.sin_port);
    lane->acceptor = std::thread(accept_loop, lane);
    *out = lane;
    return GGSWARM_OK;
}

int32_t ggswarm_lane_port(const ggswarm_lane * lane) { return lane ? lane->port : -1; }

int32_t ggswarm_lane_take_batches(ggswarm_lane * lane, ggswarm_lane_batch * out, int32_t max, uint64_t * dropped) {
    if (!lane || max < 0 || (max > 0 && !out)) {
        fail(nullptr, GGSWARM_E_INVALID_ARG, "lane is NULL, or max < 0, or out is NULL");
        return -1;
    }
    std::lock_guard<std::mutex> lk(lane->pass_mu);
    const size_t cap = lane->log.size();
    const size_t n = std::min(lane->log_count, (size_t)max);
    for (size_t i = 0; i < n; ++i) out[i] = lane->log[(lane->log_head + i) % cap];
    lane->log_head = cap ? (lane->log_head + n) % cap : 0;
    lane->log_count -= n;
    if (dropped) {
        *dropped = lane->log_dropped;
        lane->log_dropped = 0;
    }
    return (int32_t)n;
}

ggswarm_status ggswarm_lane_add(ggswarm_lane * lane, const ggswarm_lane_session * cfg) {
    if (!lane || !cfg || !cfg->model) return fail(nullptr, GGSWARM_E_INVALID_ARG, "lane, session or model is NULL");
    ggswarm_model * m = cfg->model;
    {
        GGSWARM_LOCK(m);
        int32_t len = 0;
        if (ggswarm_session_len(m, cfg->sid, &len) != GGSWARM_OK) return fail(nullptr, GGSWARM_E_NO_SESSION, "no session %lld", (long long)cfg->sid);
        if (!m->is_last()) {
            sockaddr_in tmp{};
            if (!cfg->next_host || inet_pton(AF_INET, cfg->next_host, &tmp.sin_addr) != 1 || cfg->next_port <= 0 ||
                cfg->next_port > 65535) {
                return fail(nullptr, GGSWARM_E_INVALID_ARG, "a window before the last needs the next hop's numeric IPv4 lane address");
            }
            if (cfg->hidden_out_type != GGSWARM_TYPE_F16 && cfg->hidden_out_type != GGSWARM_TYPE_F32) {
                return fail(nullptr, GGSWARM_E_INVALID_ARG, "hidden_out_type must be F16 or F32");
            }
        }
        if (cfg->n_history < 0 || (cfg->n_history > 0 && !cfg->history) || cfg->n_history > GGSWARM_MAX_CONTEXT) {
            return fail(nullptr, GGSWARM_E_INVALID_ARG, "bad history");
        }
    }
    auto s = std::make_shared<LaneSession>();
    s->cfg = *cfg;
    s->cfg.next_host = nullptr;
    s->cfg.sampling = nullptr;
    s->cfg.history = nullptr;
    if (!m->is_last()) {
        s->next_host = cfg->next_host;
        s->next_key = s->next_host + ":" + std::to_string(cfg->next_port);
    }
    if (cfg->sampling) { s->sampling = *cfg->sampling; s->has_sampling = true; }
    if (cfg->n_history) s->history.assign(cfg->history, cfg->history + cfg->n_history);
    s->n_initial = s->history.size();
    s->first = m->is_first();
    s->last = m->is_last();
    s->d_io = m->d_io();
    s->next_step = cfg->first_step;
    std::lock_guard<std::mutex> lk(lane->mu);
    if (lane->sessions.size() >= GGSWARM_LANE_MAX_SESSIONS) return fail(nullptr, GGSWARM_E_BUDGET, "the lane holds %d sessions", GGSWARM_LANE_MAX_SESSIONS);
    if (!lane->sessions.emplace(cfg->lane_id, s).second) return fail(nullptr, GGSWARM_E_INVALID_ARG, "lane id already in use");
    return GGSWARM_OK;
}

ggswarm_status ggswarm_lane_stats_get(ggswarm_lane * lane, uint64_t lane_id, ggswarm_lane_stats * out) {
    if (!lane || !out) return fail(nullptr, GGSWARM_E_INVALID_ARG, "lane or out is NULL");
    std::shared_ptr<LaneSession> sp;
    {
        std::lock_guard<std::mutex> lk(lane->mu);
        auto it = lane->sessions.find(lane_id);
        if (it == lane->sessions.end()) return fail(nullptr, GGSWARM_E_NO_SESSION, "no lane session %llu", (unsigned long long)lane_id);
        sp = it->second;
    }
    std::lock_guard<std::mutex> lk(sp->mu);
    fill_stats(*sp, out);
    return GGSWARM_OK;
}

ggswarm_status ggswarm_lane_remove(ggswarm_lane * lane, uint64_t lane_id, ggswarm_lane_stats * stats, int32_t * appended,
                                   int32_t capacity) {
    if (!lane || capacity < 0 || (capacity > 0 && !appended)) return fail(nullptr, GGSWARM_E_INVALID_ARG, "bad arguments");
    std::shared_ptr<LaneSession> sp;
    {
        std::lock_guard<std::mutex> lk(lane->mu);
        auto it = lane->sessions.find(lane_id);
        if (it == lane->sessions.end()) return fail(nullptr, GGSWARM_E_NO_SESSION, "no lane session %llu", (unsigned long long)lane_id);
        sp = it->second;
        lane->sessions.erase(it);
    }
    std::lock_guard<std::mutex> lk(sp->mu);  // after the step in flight
    sp->removed = true;
    ggswarm_lane_stats st{};
    fill_stats(*sp, &st);
    if (stats) *stats = st;
    const size_t n = std::min((size_t)capacity, (size_t)st.n_appended);
    if (n) memcpy(appended, sp->history.data() + sp->n_initial, n * 4);
    return GGSWARM_OK;
}

int32_t ggswarm_lane_drop_model(ggswarm_lane * lane, const ggswarm_model * model) {
    if (!lane) return 0;
    std::vector<std::shared_ptr<LaneSession>> gone;
    {
        std::lock_guard<std::mutex> lk(lane->mu);
        for (auto it = lane->sessions.begin(); it != lane->sessions.end();) {
            if (it->second->cfg.model == model) {
                gone.push_back(it->second);
                it = lane->sessions.erase(it);
            } else {
                ++it;
            }
        }
    }
    for (auto & s : gone) {
        std::lock_guard<std::mutex> lk(s->mu);
        s->removed = true;
    }
    return (int32_t)gone.size();
}

int32_t ggswarm_lane_wait_step(ggswarm_lane * lane, int32_t timeout_ms) {
    if (!lane || timeout_ms <= 0) return 0;
    const auto wait = std::chrono::milliseconds(timeout_ms);
    std::unique_lock<std::mutex> lk(lane->pass_mu);
    if (lane->stop || lane->passes == 0 || Clock::now() - lane->last_pass > wait) return 0;  // quiet
    const uint64_t seen = lane->passes;
    lane->waiters++;  // ggswarm_lane_free waits for us to leave before the lane is gone
    const bool passed = lane->pass_cv.wait_for(lk, wait, [&] { return lane->passes != seen || lane->stop; });
    const bool stopping = lane->stop;
    lane->waiters--;
    lk.unlock();
    lane->pass_cv.notify_all();
    return passed && !stopping ? 1 : 0;
}

void ggswarm_lane_free(ggswarm_lane * lane) {
    if (!lane) return;
    lane->stop = true;
    {
        std::unique_lock<std::mutex> lk(lane->pass_mu);
        lane->pass_cv.notify_all();  // a wait_step caller returns, and we wait until it has left
        lane->pass_cv.wait(lk, [&] { return lane->waiters == 0; });
    }
    if (lane->acceptor.joinable()) lane->acceptor.join();
    close(lane->listen_fd);
    {
        std::lock_guard<std::mutex> lk(lane->mu);
        for (auto & c : lane->conns) shutdown(c->fd, SHUT_RDWR);  // wakes the threads blocked in recv
    }
    for (auto & c : lane->conns) {
        c->th.join();
        close(c->fd);
    }
    delete lane;
}

}  // extern "C"
