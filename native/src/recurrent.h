// Per-layer recurrent session state (StateKind::Recurrent: a delta-net layer's conv state and f32
// recurrent state, fixed size whatever the length) and the checkpoints that make a truncate possible:
// a recurrent state cannot be cut back to an arbitrary position, so a session keeps host copies of its
// recurrent states at chosen positions (charged to the node's budget) and a truncate restores the
// newest at or before the target; the caller re-prefills the rest (docs/native.md, "Recurrent state,
// checkpoints and MoE").
#pragma once

#include <cstdint>
#include <vector>

#include "model.h"

namespace ggswarm {

struct Checkpoint {
    int32_t pos = 0;
    std::vector<uint8_t> data;  // per layer with fixed-size state, in order, what its StateOps::ckpt_io writes
    // taken by ggswarm_session_checkpoint (a speculative verification's start) and dropped by its caller:
    // outside ckpt_max, at most kPinnedMax per session, never pushed out by (nor pushing out) the others
    bool pinned = false;
    uint64_t taken = 0;  // ggswarm_model::ckpt_clock when taken: reclaim_checkpoints takes the oldest first
};

// checkpoints a session holds for ggswarm_session_checkpoint at a time (a newer one replaces the oldest)
constexpr int32_t kPinnedMax = 1;

struct Checkpoints {
    std::vector<Checkpoint> list;  // ascending positions
    uint64_t bytes = 0;            // charged to the budget
};

// ggswarm_session_truncate_to's *out_kind (GGSWARM_TRUNCATE_*)
constexpr int32_t kTruncExact = 0;
constexpr int32_t kTruncCheckpoint = 1;
constexpr int32_t kTruncFromZero = 2;

// True when the window has state that cannot be cut back to any position (recurrent states, rings):
// its sessions keep checkpoints.
bool has_fixed_state(const ggswarm_model * m);
// Checkpoint bytes the session holds (already in the budget).
uint64_t checkpoint_bytes(const Session & s);
// Credit the budget with the session's checkpoints and drop them (free_kv, restore).
void drop_checkpoints(ggswarm_model * m, Session & s);
// A checkpoint of the fixed-size state at s.len, unless one is there (an automatic one meeting a pinned
// one there takes it over). Automatic (pinned false: the ends of multi-token calls, intervals): at most
// ckpt_max, the oldest automatic one going first, also when the budget is short (without room, none is
// taken). Pinned: at most kPinnedMax, the oldest pinned one going first; a short budget pushes out
// nothing for it. With ckpt_max 0 none of either kind is taken.
void take_checkpoint(ggswarm_model * m, Session & s, bool pinned = false);
// The length of the next micro-batch from pos (at most nc) so that checkpoint positions end one.
int32_t checkpoint_chunk(const ggswarm_model * m, int32_t pos, int32_t nc);
// After a micro-batch that ended at s.len: a checkpoint when s.len is a multiple of the interval.
void checkpoint_after_chunk(ggswarm_model * m, Session & s);
// Automatic checkpoints are a cache of the budget's free room, not part of a session's state: growing a
// session (or restoring one) that finds the budget short takes them back before it fails, so a node holds
// as many sessions as their state alone allows (docs/native.md, "Checkpoints"). Pinned ones (a
// verification in flight) are never taken back. The bytes this handle's automatic checkpoints hold:
uint64_t reclaimable_checkpoint_bytes(const ggswarm_model * m);
// Drop automatic checkpoints of the handle's sessions, the least recently taken first, until `want` bytes
// are credited to the budget or none is left; returns the bytes credited.
uint64_t reclaim_checkpoints(ggswarm_model * m, uint64_t want);
// Bring the session back to at most `target` positions: exactly where every layer's live state can go
// there (KV caches always; rings while they still hold what target needs); else to the newest
// checkpoint at or before target (or 0). Sets s.len; *kind as above.
void rewind(ggswarm_model * m, Session & s, int32_t target, int32_t * kind);

}  // namespace ggswarm
