// dtrain-llama's sample text: the whole model, in rank 0 alone, loaded from
// the distributed checkpoint the layout wrote (whatever its tp, pp and dp),
// continuing a prompt byte by byte.

#include <algorithm>

#include "corpus.h"
#include "job.h"

namespace llama {

std::string describe(const Config& c) {
  return "llama vocab " + std::to_string(c.vocab) + " dim " + std::to_string(c.dim) + " layers " +
         std::to_string(c.layers) + " heads " + std::to_string(c.heads) + " hidden " +
         std::to_string(c.hidden) + " seq " + std::to_string(c.seq) +
         (c.experts > 0 ? " experts " + std::to_string(c.experts) + " top " + std::to_string(c.top_k) +
                              (c.shared_expert ? " shared" : "")
                        : "");
}

std::string sample(const Flags& f, const std::shared_ptr<dtrain::ProcessGroup>& solo,
                   const std::string& prompt) {
  const Config& c = f.model;
  Stage whole(c, Layout::over(solo), initial_values(c, f.seed, 0, c.layers, true, true), 0,
              c.layers, true, true);
  dtrain::checkpoint::DistributedState state;
  dtrain::checkpoint::add_module(state, *whole, "model/");
  dtrain::checkpoint::load(f.checkpoint_dir, state);
  torch::NoGradGuard no_grad;
  whole->eval();
  auto gen = at::detail::createCPUGenerator(f.seed + 17);
  std::string text = prompt;
  for (int64_t i = 0; i < f.sample_bytes; ++i) {
    const int64_t length = std::min<int64_t>(c.seq, static_cast<int64_t>(text.size()));
    auto context = torch::empty({1, length}, torch::kLong);
    for (int64_t j = 0; j < length; ++j)
      context[0][j] = static_cast<unsigned char>(text[text.size() - static_cast<size_t>(length - j)]);
    const auto logits = whole(context)[0][length - 1] / 0.8;  // temperature 0.8
    const auto next = at::multinomial(torch::softmax(logits, -1), 1, false, gen).item<int64_t>();
    text += static_cast<char>(next);
  }
  return text;
}

}  // namespace llama
