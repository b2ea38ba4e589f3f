#pragma once
/// A small JSON reader for the simulator's calibration inputs (Google Benchmark's
/// --benchmark_out files): objects, arrays, strings (with \uXXXX escapes kept as UTF-8),
/// numbers, true, false and null. Errors name the source and the line.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "fedshard/error.hpp"

namespace fedshard::sim::detail {

/// One JSON value.
struct json_value {
  using array = std::vector<json_value>;
  using object = std::vector<std::pair<std::string, json_value>>;  ///< in file order
  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<array>,
               std::shared_ptr<object>>
      v = nullptr;
  int line = 0;  ///< where the value starts

  bool is_null() const noexcept { return std::holds_alternative<std::nullptr_t>(v); }
  const bool* as_bool() const noexcept { return std::get_if<bool>(&v); }
  const double* as_number() const noexcept { return std::get_if<double>(&v); }
  const std::string* as_string() const noexcept { return std::get_if<std::string>(&v); }
  const array* as_array() const noexcept {
    auto p = std::get_if<std::shared_ptr<array>>(&v);
    return p ? p->get() : nullptr;
  }
  const object* as_object() const noexcept {
    auto p = std::get_if<std::shared_ptr<object>>(&v);
    return p ? p->get() : nullptr;
  }
  /// The member called key of an object (the first one), or nullptr.
  const json_value* find(std::string_view key) const noexcept {
    if (const object* o = as_object())
      for (const auto& [k, x] : *o)
        if (k == key) return &x;
    return nullptr;
  }
};

/// Parses one JSON document; invalid_argument naming source:line and what was expected.
class json_parser {
 public:
  json_parser(std::string_view text, std::string source)
      : text_(text), source_(std::move(source)) {}

  json_value parse() {
    json_value v = value(0);
    skip_space();
    expect(pos_ == text_.size(), "the end of the document");
    return v;
  }

 private:
  static constexpr int max_depth = 256;

  [[noreturn]] void fail(std::string_view expected) const {
    const std::string found = pos_ >= text_.size()
                                  ? std::string("the end of the input")
                                  : "'" + std::string(text_.substr(pos_, 12)) + "'";
    FEDSHARD_EXPECTS(false, "sim: ", source_, ":", line_, ": malformed JSON, expected ", expected,
                     ", found ", found);
    std::abort();  // unreachable: FEDSHARD_EXPECTS(false, ...) throws
  }
  void expect(bool ok, std::string_view expected) const {
    if (!ok) fail(expected);
  }

  void skip_space() {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == '\n')
        ++line_;
      else if (c != ' ' && c != '\t' && c != '\r')
        return;
      ++pos_;
    }
  }

  bool literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  json_value value(int depth) {
    expect(depth < max_depth, "at most 256 nested arrays and objects");
    skip_space();
    json_value out;
    out.line = line_;
    expect(pos_ < text_.size(), "a value");
    const char c = text_[pos_];
    if (c == '{') {
      auto members = std::make_shared<json_value::object>();
      ++pos_;
      skip_space();
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
      } else {
        for (;;) {
          skip_space();
          expect(pos_ < text_.size() && text_[pos_] == '"', "a member name in double quotes");
          std::string key = string();
          skip_space();
          expect(pos_ < text_.size() && text_[pos_] == ':', "':' after a member name");
          ++pos_;
          members->emplace_back(std::move(key), value(depth + 1));
          skip_space();
          expect(pos_ < text_.size() && (text_[pos_] == ',' || text_[pos_] == '}'),
                 "',' or '}' in an object");
          if (text_[pos_++] == '}') break;
        }
      }
      out.v = std::move(members);
    } else if (c == '[') {
      auto items = std::make_shared<json_value::array>();
      ++pos_;
      skip_space();
      if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
      } else {
        for (;;) {
          items->push_back(value(depth + 1));
          skip_space();
          expect(pos_ < text_.size() && (text_[pos_] == ',' || text_[pos_] == ']'),
                 "',' or ']' in an array");
          if (text_[pos_++] == ']') break;
        }
      }
      out.v = std::move(items);
    } else if (c == '"') {
      out.v = string();
    } else if (literal("true")) {
      out.v = true;
    } else if (literal("false")) {
      out.v = false;
    } else if (literal("null")) {
      out.v = nullptr;
    } else {
      out.v = number();
    }
    return out;
  }

  double number() {
    const std::size_t start = pos_;
    auto digits = [&] {
      const std::size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ > from;
    };
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    expect(digits(), "a value (object, array, string, number, true, false or null)");
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      expect(digits(), "digits after '.' in a number");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      expect(digits(), "digits in a number's exponent");
    }
    const std::string s(text_.substr(start, pos_ - start));
    return std::strtod(s.c_str(), nullptr);
  }

  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::uint32_t hex4() {
    expect(pos_ + 4 <= text_.size(), "four hex digits after \\u");
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= static_cast<std::uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= static_cast<std::uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= static_cast<std::uint32_t>(c - 'A' + 10);
      else
        fail("four hex digits after \\u");
    }
    return v;
  }

  std::string string() {
    ++pos_;  // the opening quote
    std::string out;
    for (;;) {
      expect(pos_ < text_.size(), "a closing '\"'");
      const char c = text_[pos_++];
      if (c == '"') return out;
      expect(c != '\n', "a closing '\"' before the end of the line");
      if (c != '\\') {
        out += c;
        continue;
      }
      expect(pos_ < text_.size(), "an escape after '\\'");
      switch (text_[pos_++]) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && literal("\\u")) {
            const std::uint32_t low = hex4();
            expect(low >= 0xDC00 && low < 0xE000, "a low surrogate after a high one");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: --pos_; fail("one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u after '\\'");
      }
    }
  }

  std::string_view text_;
  std::string source_;
  std::size_t pos_ = 0;
  int line_ = 1;
};

/// The JSON document in text; invalid_argument naming source:line when it is malformed.
inline json_value parse_json(std::string_view text, const std::string& source) {
  return json_parser(text, source).parse();
}

}  // namespace fedshard::sim::detail
