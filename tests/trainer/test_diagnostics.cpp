// The trainer's diagnostics: the catalogue text its notes print is generated from
// for_each_algorithm (the same list as algorithm_list()), and an Algorithm passes through.
#include "fedshard/trainer/diagnostics.hpp"

#include <doctest/doctest.h>

#include <string>
#include <type_traits>

using namespace fedshard;

TEST_CASE("catalogue_text is algorithm_list(), written out by hand, zero-terminated") {
  constexpr auto text = detail::catalogue_text_for<void>();
  const std::string expected =
      "ddp, zero2, fsdp, hsdp, fl_fsdp, fl_hsdp, fl_hsdp_int8, diloco, streaming_diloco, "
      "sparseloco, gasloc, fomoe, scape_fsdp, fl_scape_fsdp, hofl, lss, fcp, feast, collate";
  CHECK(std::string(text.text) == expected);
  CHECK(std::string(text.text) == algorithm_list());
  CHECK(sizeof(text.text) == expected.size() + 1);
  static_assert(!detail::choose_one_of<detail::catalogue_text_for<int>()>::value);
}

TEST_CASE("an Algorithm is the trainer's algorithm as it is") {
  static_assert(std::is_same_v<detail::trainer_algorithm<fsdp>::type, fsdp>);
  static_assert(std::is_same_v<detail::trainer_algorithm<gasloc>::type, gasloc>);
}
