// The reducer under DDPOptions::shard_gradients (ZeRO-2): each bucket is
// reduce-scattered, and a rank keeps only its share of the average
// (sharded_gradients.h). A bucket's buffer exists from its first gradient
// to the end of its reduce-scatter, and .grad is emptied as soon as its
// gradient is in the bucket: a rank holds its shares plus the buckets in
// flight, not a full copy of the gradients.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "common/enforce.h"
#include "ddp/reducer.h"
#include "ddp/reducer_bucket.h"

namespace dtrain::ddp {
void Reducer::release_buffer(Bucket& b) {
  b.grad.gradients.clear();
  b.grad.buffer = at::Tensor();
}

void Reducer::describe_shards() {
  auto shards = std::make_shared<ShardedGradients>();
  shards->world = group_.size();
  int64_t offset = 0;
  for (const auto& b : buckets_) {
    ShardedGradients::Bucket sb;
    sb.members = b->members;
    sb.numel = b->numel;
    sb.slice = (b->numel + shards->world - 1) / shards->world;
    sb.shard_offset = offset;
    offset += sb.slice;
    shards->buckets.push_back(std::move(sb));
  }
  shards->grad = at::zeros({offset}, params_.front().options().requires_grad(false));
  sharded_ = std::move(shards);
}

// The bucket's buffer, padded with zeros to world * slice elements.
void Reducer::materialize(Bucket& bucket) {
  const auto& layout = sharded_->buckets[static_cast<size_t>(bucket.grad.index)];
  const auto& first = params_[bucket.members.front()];
  bucket.grad.buffer = at::empty({layout.slice * sharded_->world}, first.options().requires_grad(false));
  bucket.grad.buffer.narrow(0, layout.numel, bucket.grad.buffer.numel() - layout.numel).zero_();
  make_views(bucket);
}

// The average's share goes straight into `grad` unless it holds gradients
// not stepped on yet (several synchronized backwards before a step): then
// into scratch, added by settle_sharded.
void Reducer::launch_sharded(size_t index) {
  release_finished_buckets();
  Bucket* b = buckets_[index].get();
  const auto& layout = sharded_->buckets[index];
  at::Tensor share;
  if (sharded_->pending) {
    b->scratch = at::empty({layout.slice}, sharded_->grad.options());
    share = b->scratch;
  } else {
    share = sharded_->grad.narrow(0, layout.shard_offset, layout.slice);
  }
  b->work = group_.reduce_scatter_tensor(share, b->grad.buffer, ReduceOp::SUM);
  b->work->on_success([b] { b->done = Clock::now(); });
}

// Buckets whose reduce-scatter has ended need their buffers no more.
void Reducer::release_finished_buckets() {
  for (size_t k = 0; k < next_launch_; ++k) {
    auto& b = *buckets_[k];
    if (b.work && b.grad.buffer.defined() && b.work->is_completed()) release_buffer(b);
  }
}

// After every bucket's work ended well: add what went to scratch.
void Reducer::settle_sharded() {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    auto& b = *buckets_[k];
    if (!b.scratch.defined()) continue;
    const auto& layout = sharded_->buckets[k];
    sharded_->grad.narrow(0, layout.shard_offset, layout.slice).add_(b.scratch);
    b.scratch = at::Tensor();
  }
  sharded_->pending = true;
}

void Reducer::release_sharded_buffers() {
  for (auto& b : buckets_) {
    release_buffer(*b);
    b->scratch = at::Tensor();
  }
}

}  // namespace dtrain::ddp
