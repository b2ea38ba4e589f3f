#pragma once
/// FEDSHARD_MEMBER_NAME(member): declares `names_<member><T>`, true when class T has a member
/// (of any kind: function, overload set, data member, type) called <member>.
///
/// The concept headers use it, and only they, to tell an optional capability that is absent
/// from one that is present under another signature, and to catch near-miss names: a class
/// deriving from T and from one with an int <member> finds the name twice when T has it too,
/// so taking its address is ambiguous. Invoke it inside a namespace of your own (a concept
/// header's detail namespace); a final T or a non-class reads as having no members.

#include <type_traits>

#define FEDSHARD_MEMBER_NAME(member)                                                \
  struct names_##member##_probe {                                                   \
    int member;                                                                     \
  };                                                                                \
  template <class T>                                                                \
  struct names_##member##_both : T, names_##member##_probe {};                      \
  template <class T, bool = std::is_class_v<T> && !std::is_final_v<T>>              \
  struct names_##member##_in {                                                      \
    static constexpr bool value = false;                                            \
  };                                                                                \
  template <class T>                                                                \
  struct names_##member##_in<T, true> {                                             \
    static constexpr bool value = !requires { &names_##member##_both<T>::member; }; \
  };                                                                                \
  template <class T>                                                                \
  inline constexpr bool names_##member = names_##member##_in<T>::value;

/// FEDSHARD_MEMBER_TYPE_OR(trait, member, fallback): declares `trait<T>`, whose `type` is
/// T::member when T declares a type of that name, else the fallback type, and `trait_t<T>`.
/// For an optional member type a concept header declares with its default.
#define FEDSHARD_MEMBER_TYPE_OR(trait, member, ...) \
  template <class T>                                \
  struct trait {                                    \
    using type = __VA_ARGS__;                       \
  };                                                \
  template <class T>                                \
  requires requires {                               \
    typename T::member;                             \
  }                                                 \
  struct trait<T> {                                 \
    using type = typename T::member;                \
  };                                                \
  template <class T>                                \
  using trait##_t = typename trait<T>::type;
