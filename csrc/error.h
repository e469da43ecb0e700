// Error messages for TORCH_CHECK, built without std::ostream.
//
// TORCH_CHECK(cond, a, b, ...) formats a message of several parts through c10::str, that is through
// a std::ostringstream compiled into this extension. With some toolchains that is fatal: on one
// torch 2.11 image (GCC 13.3 building against the system's libstdc++.so.6.0.33) any
// std::ostringstream in an extension built there crashed the process (SIGSEGV), even one never
// thrown, so a bad argument killed the server instead of raising. A message of one std::string (or
// one const char*) reaches c10::Error untouched, so every check whose message has several parts
// builds it here: TORCH_CHECK(cond, kiln::message("token ", t, ": slot ", slot, " out of range")).
// Nothing else in csrc/ may use std::ostream.

#pragma once

#include <c10/core/ScalarType.h>

#include <string>
#include <type_traits>

namespace kiln {

inline void append_part(std::string& s, const char* part) { s += part; }
inline void append_part(std::string& s, const std::string& part) { s += part; }
inline void append_part(std::string& s, c10::ScalarType t) { s += c10::toString(t); }

template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
void append_part(std::string& s, T value) {
  s += std::to_string(value);
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (append_part(s, parts), ...);
  return s;
}

}  // namespace kiln
