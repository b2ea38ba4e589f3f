#pragma once
// The local rules' settings the tests share: two probes of eps 1e-3 for the zeroth-order
// units, and a pool of three with both regularisers (member 1 joins after 1 local step,
// member 2 after 2) for the soup.

#include "fedshard/optim/soup.hpp"
#include "fedshard/optim/zeroth_order.hpp"

namespace fedshard::test {

inline const optim::zeroth_order_settings zo_two_probes{.eps = 1e-3f, .probes = 2, .seed = 9};
inline const optim::soup_config soup_of_three{.pool_size = 3,
                                              .affinity = 1e-3f,
                                              .diversity = 1e-3f,
                                              .first_steps = 1,
                                              .add_every = 1,
                                              .seed = 4};

}  // namespace fedshard::test
