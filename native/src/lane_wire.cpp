// The decode lane's wire: AES-256-GCM sealing, socket I/O, and the refusal, error and answer frames.

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

}  // namespace ggswarm::lanes
