// Errors of the native core. Core code throws octavo::Error; the Python module maps its kind
// to a Python exception class (kValue -> ValueError, kType -> TypeError, kIndex -> IndexError,
// kRuntime -> RuntimeError), so C++ callers and Python callers see the same message.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace octavo {

enum class ErrorKind { kValue, kType, kIndex, kRuntime };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
// Appends " [file:line]" so that a user's report points at the check that fired.
[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace octavo

// OCTAVO_CHECK(cond, "text " << value) throws a ValueError-kind Error when cond is false.
#define OCTAVO_CHECK_KIND(kind, cond, msg)                                             \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::ostringstream octavo_check_stream_;                                         \
      octavo_check_stream_ << msg;                                                     \
      ::octavo::detail::throw_error((kind), __FILE__, __LINE__, octavo_check_stream_.str()); \
    }                                                                                  \
  } while (0)

#define OCTAVO_CHECK(cond, msg) OCTAVO_CHECK_KIND(::octavo::ErrorKind::kValue, cond, msg)
#define OCTAVO_CHECK_TYPE(cond, msg) OCTAVO_CHECK_KIND(::octavo::ErrorKind::kType, cond, msg)
#define OCTAVO_CHECK_INDEX(cond, msg) OCTAVO_CHECK_KIND(::octavo::ErrorKind::kIndex, cond, msg)
