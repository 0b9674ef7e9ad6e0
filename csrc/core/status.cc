#include "octavo/status.h"

namespace octavo::detail {

void throw_error(ErrorKind kind, const char* file, int line, const std::string& message) {
  const char* base = file;
  for (const char* p = file; *p; ++p) {
    if (*p == '/' || *p == '\\') base = p + 1;
  }
  throw Error(kind, message + " [" + base + ":" + std::to_string(line) + "]");
}

}  // namespace octavo::detail
