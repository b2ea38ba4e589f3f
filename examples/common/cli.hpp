#pragma once
// Strict command-line parsing for the example programs (fedshard-demo, fedshard-sim,
// fedshard-multi-job, train_torch): each program declares its options on a cli::parser (a
// name, where the value goes and the range it must lie in) and runs its main through
// cli::run_main.
//
// The rules, the same in every program:
//  - a whole number is an optional '-' and digits, nothing else ("2.5", "1e3", "8x", " 8" and
//    "" are refused), inside the option's range [lo, hi] (a value beyond it, however many
//    digits, is refused with the range, never wrapped or truncated);
//  - a real number is a finite decimal or scientific number ("nan", "inf", "0x10", "5%" are
//    refused) inside the option's bounds, each closed or open: (0, 1];
//  - a list is comma-separated items, none empty, at least one;
//  - an option that takes a value needs one: the end of the arguments, or a next argument
//    that starts with "--", is a missing value; a text value is not empty;
//  - an argument that is no declared option is refused.
// Every refusal throws fedshard::invalid_argument whose message names the option, what it
// expects and what it found; cli::run_main prints it as one line on stderr and exits 2.
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"

namespace cli {

/// Throws fedshard::invalid_argument(message): bad input (exit status 2 under run_main).
[[noreturn]] inline void fail(const std::string& message) {
  throw fedshard::invalid_argument(message);
}

/// "'text'", with control characters shown as \xNN and a long text cut at 60 characters, for
/// the "found ..." part of a message.
inline std::string shown(std::string_view text) {
  std::string out = "'";
  std::size_t count = 0;
  for (const char c : text) {
    if (++count > 60) {
      out += "...";
      break;
    }
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "'";
}

/// Bounds of a real-valued option, each end closed (included) or open.
struct bounds {
  double lo = 0;
  double hi = 0;
  bool lo_open = false;
  bool hi_open = false;

  /// True when x lies inside (never for NaN).
  bool contain(double x) const noexcept {
    return (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
  }
  /// "[0, 10]", "(0, 1]".
  std::string text() const {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%c%.9g, %.9g%c", lo_open ? '(' : '[', lo, hi,
                  hi_open ? ')' : ']');
    return buf;
  }
};

/// [lo, hi].
constexpr bounds closed(double lo, double hi) noexcept {
  return {lo, hi, false, false};
}
/// (lo, hi]: a positive quantity up to hi when lo is 0.
constexpr bounds above(double lo, double hi) noexcept {
  return {lo, hi, true, false};
}

/// The whole number `text` for `option`, in [lo, hi] (see the file comment).
template <std::integral T>
T parse_integer(std::string_view option, std::string_view text, T lo, T hi) {
  const auto expected = [&] {
    return std::string(option) + " expects a whole number in [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "], found " + shown(text);
  };
  T value{};
  const char* first = text.data();
  const char* last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(first, last, value);
  // An error (out of T's range too), trailing characters or a value outside [lo, hi].
  if (text.empty() || ec != std::errc{} || end != last || value < lo || value > hi)
    fail(expected());
  return value;
}

/// The real number `text` for `option`, finite and within b (see the file comment).
inline double parse_real(std::string_view option, std::string_view text, const bounds& b) {
  double value = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(first, last, value, std::chars_format::general);
  if (text.empty() || ec != std::errc{} || end != last || !std::isfinite(value) ||
      !b.contain(value))
    fail(std::string(option) + " expects a finite number in " + b.text() + ", found " +
         shown(text));
  return value;
}

/// The comma-separated items of `text` for `option`: at least one, none empty.
inline std::vector<std::string> parse_items(std::string_view option, std::string_view text) {
  std::vector<std::string> out;
  std::size_t at = 0;
  for (;;) {
    const std::size_t comma = text.find(',', at);
    const std::string_view item =
        text.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
    if (item.empty())
      fail(std::string(option) + " expects a comma-separated list of non-empty items, found " +
           shown(text));
    out.emplace_back(item);
    if (comma == std::string_view::npos) return out;
    at = comma + 1;
  }
}

/// The options of one program and where their values go. Each declaration names the option
/// (several names for one option: alias) and, for a value, its range; parse() then fills the
/// targets from the arguments, left to right (an option given twice: the last one counts).
class parser {
 public:
  /// What a value option does with its argument: parse it, check it, store it.
  using handler = std::function<void(const std::string& option, const std::string& value)>;

  /// A switch without a value: `set` runs when it is given.
  parser& flag(const std::string& name, std::function<void()> set) {
    flags_[name] = std::move(set);
    return *this;
  }
  /// A switch without a value that sets target to true.
  parser& flag(const std::string& name, bool& target) {
    return flag(name, [&target] { target = true; });
  }
  /// An option with a value handled by h (h throws fedshard::invalid_argument for a bad one;
  /// the message is prefixed with the option's name when it does not mention it).
  parser& custom(const std::string& name, handler h) {
    values_[name] = std::move(h);
    return *this;
  }
  /// A non-empty text.
  parser& text(const std::string& name, std::string& target) {
    return custom(name, [&target](const std::string&, const std::string& v) { target = v; });
  }
  /// A whole number in [lo, hi].
  template <std::integral T>
  parser& integer(const std::string& name, T& target, std::type_identity_t<T> lo,
                  std::type_identity_t<T> hi) {
    return custom(name, [&target, lo, hi](const std::string& o, const std::string& v) {
      target = parse_integer<T>(o, v, lo, hi);
    });
  }
  /// A whole number in [lo, hi], set only when given.
  template <std::integral T>
  parser& integer(const std::string& name, std::optional<T>& target, std::type_identity_t<T> lo,
                  std::type_identity_t<T> hi) {
    return custom(name, [&target, lo, hi](const std::string& o, const std::string& v) {
      target = parse_integer<T>(o, v, lo, hi);
    });
  }
  /// A real number within b (float targets: b must lie within float's range).
  template <std::floating_point T>
  parser& real(const std::string& name, T& target, const bounds& b) {
    return custom(name, [&target, b](const std::string& o, const std::string& v) {
      target = static_cast<T>(parse_real(o, v, b));
    });
  }
  /// A real number within b, set only when given.
  template <std::floating_point T>
  parser& real(const std::string& name, std::optional<T>& target, const bounds& b) {
    return custom(name, [&target, b](const std::string& o, const std::string& v) {
      target = static_cast<T>(parse_real(o, v, b));
    });
  }
  /// `name` is another name of the option `of` (declared before or after).
  parser& alias(const std::string& name, const std::string& of) {
    aliases_[name] = of;
    return *this;
  }

  /// Parses args (the arguments after the program's name); fedshard::invalid_argument for
  /// the first bad one.
  void parse(const std::vector<std::string>& args) const {
    for (std::size_t i = 0; i < args.size(); ++i) {
      const std::string& given = args[i];
      const auto a = aliases_.find(given);
      const std::string& name = a == aliases_.end() ? given : a->second;
      if (const auto f = flags_.find(name); f != flags_.end()) {
        f->second();
        continue;
      }
      const auto v = values_.find(name);
      if (v == values_.end())
        fail("unknown option " + shown(given) + " (--help lists the options)");
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)
        fail(given + " expects a value, found " +
             (i + 1 >= args.size() ? std::string("nothing") : "the option " + shown(args[i + 1])));
      const std::string& value = args[++i];
      if (value.empty()) fail(given + " expects a value, found an empty argument");
      try {
        v->second(given, value);
      } catch (const fedshard::invalid_argument& e) {
        const std::string what = e.what();
        if (what.find(given) != std::string::npos) throw;
        fail(given + ": " + what);
      }
    }
  }
  /// Parses argv[first, argc).
  void parse(int argc, const char* const* argv, int first = 1) const {
    std::vector<std::string> args;
    for (int i = first; i < argc; ++i) args.emplace_back(argv[i]);
    parse(args);
  }

 private:
  std::map<std::string, std::function<void()>, std::less<>> flags_;
  std::map<std::string, handler, std::less<>> values_;
  std::map<std::string, std::string, std::less<>> aliases_;
};

/// Makes `dir` (and its parents) when missing and checks that a file can be written in it:
/// fedshard::invalid_argument naming `option` otherwise. Run it before any long work whose
/// results go there.
inline void check_writable_dir(std::string_view option, const std::string& dir) {
  const auto refuse = [&](const std::string& why) {
    fail(std::string(option) + " expects a directory it can write, found " + shown(dir) + ": " +
         why);
  };
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) refuse(ec.message());
  if (!std::filesystem::is_directory(dir, ec)) refuse("not a directory");
  const std::filesystem::path probe = std::filesystem::path(dir) / ".fedshard-write-check";
  {
    std::ofstream f(probe, std::ios::binary);
    if (!(f << "ok") || !f.flush()) refuse("cannot create a file in it");
  }
  std::filesystem::remove(probe, ec);
}

/// Runs body() (returning the exit status) as a program's main: a fedshard::invalid_argument
/// escaping it is bad input, printed as "program: message" on one line of stderr, exit 2;
/// any other exception is a failure while running, printed alike, exit 1.
template <class Body>
int run_main(std::string_view program, Body&& body) noexcept {
  const auto say = [program](const char* what) {
    std::string line(what);
    for (char& c : line)
      if (c == '\n' || c == '\r') c = ' ';
    std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(program.size()), program.data(),
                 line.c_str());
  };
  try {
    return std::forward<Body>(body)();
  } catch (const fedshard::invalid_argument& e) {
    say(e.what());
    return 2;
  } catch (const std::exception& e) {
    say(e.what());
    return 1;
  } catch (...) {
    say("an exception that is not a std::exception");
    return 1;
  }
}

}  // namespace cli
