#pragma once
/// fedshard's version; CMake reads the numbers from this file.

#define FEDSHARD_VERSION_MAJOR 0
#define FEDSHARD_VERSION_MINOR 1
#define FEDSHARD_VERSION_PATCH 0

namespace fedshard {
/// The library version as a "major.minor.patch" string.
inline constexpr const char* version_string = "0.1.0";
/// The library version as major * 10000 + minor * 100 + patch.
inline constexpr int version_number =
    FEDSHARD_VERSION_MAJOR * 10000 + FEDSHARD_VERSION_MINOR * 100 + FEDSHARD_VERSION_PATCH;
}  // namespace fedshard
