# The Gloo component: the INTERFACE target fedshard::gloo (include/fedshard/comm/gloo.hpp
# over Debian's libgloo and hiredis, and the signed store comm/signed_store.hpp with its
# HMAC-SHA256 comm/detail/hmac.hpp over OpenSSL's libcrypto; FEDSHARD_HAS_GLOO=1), its
# header check and install rules, and the Redis server the tests start on the loopback (FEDSHARD_REDIS_SERVER).
#
# Include it from the top-level CMakeLists.txt when FEDSHARD_ENABLE_GLOO is ON.

if(NOT TARGET gloo)
  message(FATAL_ERROR "cmake/fedshard_gloo.cmake: expected the target gloo "
                      "(find_package(Gloo CONFIG)), found none")
endif()

include("${CMAKE_CURRENT_LIST_DIR}/fedshard_component.cmake")
fedshard_header_component(gloo fedshard/comm/gloo.hpp)
target_sources(fedshard_gloo INTERFACE
  FILE_SET HEADERS
  BASE_DIRS "${fedshard_SOURCE_DIR}/include"
  FILES "${fedshard_SOURCE_DIR}/include/fedshard/comm/signed_store.hpp"
        "${fedshard_SOURCE_DIR}/include/fedshard/comm/detail/hmac.hpp")
target_link_libraries(fedshard_gloo INTERFACE gloo "${FEDSHARD_HIREDIS_LIBRARY}" OpenSSL::Crypto)
target_include_directories(fedshard_gloo INTERFACE "$<BUILD_INTERFACE:${FEDSHARD_HIREDIS_INCLUDE_DIR}>")
target_compile_definitions(fedshard_gloo INTERFACE FEDSHARD_HAS_GLOO=1)

# The Redis server of the tests that need one (they start it on 127.0.0.1 themselves and
# stop it again); tests that need it are skipped with a message when it is missing.
find_program(FEDSHARD_REDIS_SERVER redis-server DOC "redis-server, for the Redis store's tests")
