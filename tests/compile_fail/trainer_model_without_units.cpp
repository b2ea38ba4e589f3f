// A model without units() is refused where the trainer is declared, not at its first step.
// expect: the model must provide units\(\) -> std::vector<unit_spec>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"

using namespace fedshard;
struct model_without_units {
#ifdef FEDSHARD_COMPILE_OK
  std::vector<unit_spec> units() const {
    return {};
  }
#else
  std::vector<unit_spec> unit() const {
    return {};
  }  // misspelt
#endif
  float forward_backward(step_context&, const std::vector<float>&) {
    return 0;
  }
};
using checked = trainer<model_without_units, fsdp, optim::sgd, inproc::communicator>;
[[maybe_unused]] constexpr auto size = sizeof(checked);
