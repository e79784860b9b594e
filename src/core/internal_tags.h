#pragma once

// Point-to-point tags from ProcessGroup::internal_tags_from() up are
// dtrain's own (the pipeline schedules' activations, gradients and shape
// headers; rank 0's word to the others during a long step of its own;
// snapshots' parts; ring attention's blocks): a user's send or recv there
// is refused, so that it can neither take such a message nor have its own
// taken. dtrain's own traffic is issued while an InternalTraffic lives on
// the issuing thread.

namespace dtrain::detail {

// The pipelines' tags count up from internal_tags_from(); these, down from
// max_tag(), kTagsAtTheTop of them.
constexpr int kRank0StepTagFromTop = 0;  // checkpoint/rank0_step.h: rank 0's word
constexpr int kSnapshotTagFromTop = 1;   // checkpoint::snapshot's parts
constexpr int kRingAttentionTagFromTop = 2;  // context_parallel::ring_attention's k and v
constexpr int kRingGradientTagFromTop = 3;   // and their gradients' accumulators (backward)
constexpr int kTagsAtTheTop = 4;

class InternalTraffic {
 public:
  InternalTraffic() : previous_(flag()) { flag() = true; }
  ~InternalTraffic() { flag() = previous_; }
  InternalTraffic(const InternalTraffic&) = delete;
  InternalTraffic& operator=(const InternalTraffic&) = delete;

  static bool active() { return flag(); }

 private:
  static bool& flag() {
    thread_local bool on = false;
    return on;
  }
  bool previous_;
};

}  // namespace dtrain::detail
