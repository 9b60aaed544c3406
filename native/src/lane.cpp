// The decode lane (API v7), its connections and C API: a session's small steps relayed hop to hop on
// libggswarm's own threads (frames and sockets: lane_wire.cpp; a lone step: lane_step.cpp; bundles:
// lane_bundle.cpp).
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
        s.last_used = Clock::now();  // before busy goes: ggswarm_lane_activity reads busy, then this
        s.busy = false;
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

// The session `lane_id` names (nullptr when the lane has none), kept alive by the pointer after the
// table's lock is let go.
std::shared_ptr<LaneSession> find_session(ggswarm_lane * lane, uint64_t lane_id) {
    std::lock_guard<std::mutex> lk(lane->mu);
    auto it = lane->sessions.find(lane_id);
    return it == lane->sessions.end() ? nullptr : it->second;
}

void fill_stats(LaneSession & s, ggswarm_lane_stats * out) {
    out->steps = s.steps;
    out->next_step = s.next_step;
    out->idle_s = std::chrono::duration<double>(Clock::now() - s.last_used.load()).count();
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

void ggswarm::lanes::hold_for_owner(ggswarm_lane * lane) {
    std::unique_lock<std::mutex> lk(lane->pass_mu);
    if (lane->gate_waiters == 0) return;
    lane->arrivals++;
    lane->gate_held = true;
    lane->pass_cv.notify_all();
    // an owner that never releases (a bug, a crash in its thread) holds one step for a bounded time
    lane->pass_cv.wait_for(lk, std::chrono::milliseconds(GGSWARM_LANE_GATE_MAX_MS),
                           [&] { return !lane->gate_held || lane->stop; });
    lane->gate_held = false;
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
    std::shared_ptr<LaneSession> sp = find_session(lane, lane_id);
    if (!sp) return fail(nullptr, GGSWARM_E_NO_SESSION, "no lane session %llu", (unsigned long long)lane_id);
    std::lock_guard<std::mutex> lk(sp->mu);
    fill_stats(*sp, out);
    return GGSWARM_OK;
}

ggswarm_status ggswarm_lane_activity(ggswarm_lane * lane, uint64_t lane_id, double * idle_s, int32_t * busy) {
    if (!lane || !idle_s || !busy) return fail(nullptr, GGSWARM_E_INVALID_ARG, "lane or an out pointer is NULL");
    std::shared_ptr<LaneSession> sp = find_session(lane, lane_id);
    if (!sp) return fail(nullptr, GGSWARM_E_NO_SESSION, "no lane session %llu", (unsigned long long)lane_id);
    // without the session's lock, which a step in flight holds: busy first (a step's end writes
    // last_used, then busy), so a step ending between the two reads is seen as busy or just used
    *busy = sp->busy.load() ? 1 : 0;
    *idle_s = std::chrono::duration<double>(Clock::now() - sp->last_used.load()).count();
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

int32_t ggswarm_lane_gate(ggswarm_lane * lane, int32_t timeout_ms) {
    if (!lane || timeout_ms <= 0) return 0;
    const auto wait = std::chrono::milliseconds(timeout_ms);
    std::unique_lock<std::mutex> lk(lane->pass_mu);
    if (lane->stop || lane->passes == 0 || Clock::now() - lane->last_pass > wait) return 0;  // quiet
    const uint64_t seen = lane->arrivals;
    lane->waiters++;  // ggswarm_lane_free waits for us to leave before the lane is gone
    lane->gate_waiters++;
    // the predicate is read under pass_mu, as hold_for_owner counts an arrival only while we wait: a
    // step counted is a step held for us
    const bool arrived = lane->pass_cv.wait_for(lk, wait, [&] { return lane->arrivals != seen || lane->stop; });
    lane->gate_waiters--;
    const bool stopping = lane->stop;
    lane->waiters--;
    lk.unlock();
    lane->pass_cv.notify_all();
    return arrived && !stopping ? 1 : 0;
}

void ggswarm_lane_gate_release(ggswarm_lane * lane) {
    if (!lane) return;
    {
        std::lock_guard<std::mutex> lk(lane->pass_mu);
        lane->gate_held = false;
        // the released step is the lane's latest sign of life: an owner asking the gate right after
        // a chunk must wait for the next step, not find the lane quiet because the step it held
        // arrived (and passed) longer ago than its timeout while the chunk computed
        lane->last_pass = Clock::now();
    }
    lane->pass_cv.notify_all();
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
