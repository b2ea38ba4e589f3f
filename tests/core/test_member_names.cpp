// FEDSHARD_MEMBER_NAME: "T has a member called X", of any kind, which the concept headers use to
// tell an absent optional member from one with another signature and to catch near misses.
#include "fedshard/core/member_names.hpp"

#include <doctest/doctest.h>

namespace probe {
FEDSHARD_MEMBER_NAME(gathered)

struct function_member {
  int gathered(int) { return 0; }
};
struct overloaded {
  int gathered(int) { return 0; }
  int gathered(int, int) { return 0; }
};
struct templated {
  template <class T>
  T gathered(T t) {
    return t;
  }
};
struct data_member {
  float gathered = 0;
};
struct static_member {
  static constexpr bool gathered = true;
};
struct type_member {
  using gathered = int;
};
struct other_name {
  int gather(int) { return 0; }
};
struct inherited : function_member {};
struct final_class final {
  int gathered(int) { return 0; }
};
}  // namespace probe

TEST_CASE("names_<member> finds a member of every kind, and nothing under another name") {
  CHECK(probe::names_gathered<probe::function_member>);
  CHECK(probe::names_gathered<probe::overloaded>);
  CHECK(probe::names_gathered<probe::templated>);
  CHECK(probe::names_gathered<probe::data_member>);
  CHECK(probe::names_gathered<probe::static_member>);
  CHECK(probe::names_gathered<probe::type_member>);
  CHECK(probe::names_gathered<probe::inherited>);
  CHECK_FALSE(probe::names_gathered<probe::other_name>);
  // Not derivable: read as having no members (the header says so).
  CHECK_FALSE(probe::names_gathered<probe::final_class>);
  CHECK_FALSE(probe::names_gathered<int>);
}
