#include <dtrain/dtrain.h>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  dtrain::init_process_group(dtrain::InitOptions()
                                 .store(std::make_shared<dtrain::HashStore>())
                                 .rank(0)
                                 .world_size(1));
  auto t = at::full({3}, 2.0);
  dtrain::all_reduce(t, dtrain::AllReduceOptions().op(dtrain::ReduceOp::AVG));
  std::cout << "consumer ok: world " << dtrain::get_world_size() << " value " << t[0].item<double>()
            << std::endl;
  dtrain::destroy_process_group();
  return t.eq(2.0).all().item<bool>() ? 0 : 1;
}
