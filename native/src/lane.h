// The decode lane's internals shared by lane_wire.cpp (sealing, sockets, frames), lane_step.cpp (lone
// steps), lane.cpp (connections, the API) and lane_bundle.cpp (bundles of several sessions' steps). Not
// part of the public interface (include/ggswarm.h).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model.h"

namespace ggswarm::lanes {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x314c4747u;  // "GGL1" little-endian
constexpr size_t kHeader = 40;            // bytes covered by the tag (associated data)
constexpr size_t kTag = 16;
constexpr size_t kFrameHead = kHeader + kTag;
constexpr uint8_t kIds = 1, kF16 = 2, kF32 = 3, kSubscribe = 4, kAnswer = 16, kError = 17, kRefusal = 18,
                  kSubscribed = 19,
                  kBundle = 5, kBundleAnswer = 20;  // v8: several sessions' steps in one frame
constexpr uint32_t kDirRequest = 0, kDirAnswer = 1;
constexpr size_t kAnswerFixed = 24;  // token, session_len, logprob, n_hops, reserved
constexpr size_t kMessageMax = 480;
constexpr size_t kRefusalMax = 256;
constexpr int kIdleCloseS = 600;    // an upstream connection idle this long is closed
constexpr int kRecvTimeoutS = 30;   // a frame started must arrive whole within this
constexpr int kDownstreamTimeoutS = 120;

struct Header {
    uint8_t kind = 0;
    uint64_t lane_id = 0, step = 0;
    int32_t pos_start = 0, n_tokens = 0;
    uint32_t payload_len = 0;
    uint8_t n_timings = 0;  // direct mode: (compute us, handler us) pairs after a request's rows
};

inline void put_u32(uint8_t * p, uint32_t v) { memcpy(p, &v, 4); }
inline void put_u64(uint8_t * p, uint64_t v) { memcpy(p, &v, 8); }
inline uint32_t get_u32(const uint8_t * p) { uint32_t v; memcpy(&v, p, 4); return v; }
inline uint64_t get_u64(const uint8_t * p) { uint64_t v; memcpy(&v, p, 8); return v; }

inline void write_header(uint8_t * h, const Header & x) {
    memset(h, 0, kFrameHead);
    put_u32(h, kMagic);
    h[4] = x.kind;
    h[5] = x.n_timings;
    put_u64(h + 8, x.lane_id);
    put_u64(h + 16, x.step);
    put_u32(h + 24, (uint32_t)x.pos_start);
    put_u32(h + 28, (uint32_t)x.n_tokens);
    put_u32(h + 32, x.payload_len);
}

// false when the fixed fields are not ours (magic, reserved bytes)
inline bool read_header(const uint8_t * h, Header * x) {
    if (get_u32(h) != kMagic || h[5] >= GGSWARM_LANE_MAX_HOPS || h[6] || h[7] || get_u32(h + 36)) return false;
    x->kind = h[4];
    x->n_timings = h[5];
    x->lane_id = get_u64(h + 8);
    x->step = get_u64(h + 16);
    x->pos_start = (int32_t)get_u32(h + 24);
    x->n_tokens = (int32_t)get_u32(h + 28);
    x->payload_len = get_u32(h + 32);
    return true;
}

struct LaneSession {
    ggswarm_lane_session cfg{};
    // the window's shape, copied at add: read before the session's lock, when the model may be gone
    bool first = false, last = false;
    int64_t d_io = 0;
    std::string next_host;
    std::string next_key;  // "host:port": its pooled connection's key in Worker::next_fds, made once at add
    ggswarm_sampling sampling{};
    bool has_sampling = false;
    std::vector<int32_t> history;  // last window: what the penalty may read, then appended ids
    size_t n_initial = 0;
    std::mutex mu;                 // one step at a time; the fields below under it
    uint64_t next_step = 0, steps = 0;
    // written under mu, also read without it (ggswarm_lane_activity: the owner's event loop asks
    // while a step holds mu, which in relay mode waits for the later hops)
    std::atomic<Clock::time_point> last_used{Clock::now()};
    std::atomic<bool> busy{false};
    bool removed = false;
    int sub_fd = -1;  // direct mode: the connection the route's answers and errors go to
};

struct Conn {
    int fd = -1;
    std::thread th;
    std::atomic<bool> done{false};
};

bool gcm(bool enc, const uint8_t * key, uint32_t dir, uint64_t step, uint8_t * frame, uint8_t * payload, size_t len);
bool send_all(int fd, const uint8_t * p, size_t n);
int recv_all(int fd, uint8_t * p, size_t n, bool idle_ok, const std::atomic<bool> * stop);
void set_timeouts(int fd, int secs);  // receive and send timeouts, TCP_NODELAY

// One thread's state: its buffers and its connections to next hops (never shared between threads).
struct Worker {
    std::vector<uint8_t> in, out, rows, answer, pairs;
    std::vector<std::vector<uint8_t>> bundle_in, bundle_rows;  // a bundle's payloads and rows per member (reused)
    std::vector<pollfd> polls;
    std::map<std::string, int> next_fds;
    // direct mode: the last step this thread sent on without waiting, so a refusal or a closed
    // connection from the next hop can still be reported to the session's subscriber
    std::shared_ptr<LaneSession> pending;
    uint64_t pending_step = 0;
    int pending_fd = -1;
    ~Worker() { for (auto & kv : next_fds) close(kv.second); }
};

struct StepOutcome {
    int32_t status = GGSWARM_OK, hop = 0;
    std::string message;
};

void refuse(int fd, const Header & in, const char * msg);
// Append a sealed error (status, hop counted from this one, message) or answer (token, the route's
// length after the step, logprob, then `n_hops` timing pairs) for step `in` of s; false: sealing failed.
bool seal_error(std::vector<uint8_t> & out, const LaneSession & s, const Header & in, int32_t status, int32_t hop,
                const std::string & msg);
bool seal_answer(std::vector<uint8_t> & out, const LaneSession & s, const Header & in, int32_t token, double logprob,
                 const uint8_t * pairs, uint32_t n_hops);
void send_error(int fd, const LaneSession & s, const Header & in, int32_t status, int32_t hop, const std::string & msg,
                std::vector<uint8_t> & out);
int connect_to(const std::string & host, int32_t port);
size_t expected_payload(const LaneSession & s, const Header & in);

}  // namespace ggswarm::lanes

struct ggswarm_lane {
    int listen_fd = -1;
    int32_t port = 0;
    std::atomic<bool> stop{false};
    std::thread acceptor;
    std::mutex mu;  // sessions and conns
    std::map<uint64_t, std::shared_ptr<ggswarm::lanes::LaneSession>> sessions;
    std::list<std::unique_ptr<ggswarm::lanes::Conn>> conns;
    // v8: steps computed on this hop (a lone step or a bundle), for owners pacing their own long work
    // around them (ggswarm_lane_wait_step)
    std::mutex pass_mu;
    std::condition_variable pass_cv;
    uint64_t passes = 0;
    int waiters = 0;  // callers inside ggswarm_lane_wait_step
    std::chrono::steady_clock::time_point last_pass{};
    // v13: an owner's work that goes just before the lane's next step (ggswarm_lane_gate), under pass_mu
    int gate_waiters = 0;    // owners inside ggswarm_lane_gate
    uint64_t arrivals = 0;   // steps that found an owner waiting (and were held for it)
    bool gate_held = false;  // a held step waits until the owner releases it
    // v9: the batches computed, under pass_mu, until the owner takes them (ggswarm_lane_take_batches):
    // a ring of GGSWARM_LANE_BATCH_LOG, allocated at open so the hot path only writes into it
    std::vector<ggswarm_lane_batch> log;
    size_t log_head = 0, log_count = 0;  // oldest entry, entries held
    uint64_t log_dropped = 0;            // overwritten unread since the owner last asked
};

namespace ggswarm::lanes {
// A step (or bundle) finished computing on this hop: log it, and wake whoever paces work around the lane.
void note_pass(ggswarm_lane * lane, const ggswarm_lane_batch & done);
// A step (or bundle) is about to compute on this hop: if an owner waits in ggswarm_lane_gate, hand it
// the turn and wait until it releases (bounded by GGSWARM_LANE_GATE_MAX_MS).
void hold_for_owner(ggswarm_lane * lane);
// Seconds between two points of the lane's clock.
inline double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
// Run `compute` under m's lock (recursive: the forward calls take it again), after any owner's work
// that asked to go first, timing the wait for both apart from the compute into `done` (its t_done,
// wait_s and compute_s).
template <class F>
void timed_under_lock(ggswarm_lane * lane, ggswarm_model * m, ggswarm_lane_batch & done, F && compute) {
    const auto tw = Clock::now();
    hold_for_owner(lane);
    GGSWARM_LOCK(m);
    const auto tc = Clock::now();
    compute();
    const auto te = Clock::now();
    done.t_done = std::chrono::duration<double>(te.time_since_epoch()).count();
    done.wait_s = seconds(tw, tc);
    done.compute_s = seconds(tc, te);
}
}  // namespace ggswarm::lanes

namespace ggswarm::lanes {
// A bundle (kind 5) whose head is in `outer`: read, run as one batch, relayed, answered (lane_bundle.cpp).
// false: the connection is to be closed (a refusal was sent, or it broke).
bool serve_bundle(ggswarm_lane * lane, Worker & w, int fd, const Header & outer);
// One opened request frame (payload in w.in) run as a step of s, answered upstream on fd (relay mode) or
// by the route's last hop to the subscriber (direct mode) (lane_step.cpp).
void run_step(ggswarm_lane * lane, Worker & w, int fd, LaneSession & s, const Header & in,
              const std::shared_ptr<LaneSession> & sp);
}  // namespace ggswarm::lanes
