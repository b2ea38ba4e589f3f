# The Gloo component: the INTERFACE target fedshard::gloo (include/fedshard/comm/gloo.hpp
# over Debian's libgloo and hiredis, FEDSHARD_HAS_GLOO=1), its header check and install
# rules, and the Redis server the tests start on the loopback (FEDSHARD_REDIS_SERVER).
#
# Include it from the top-level CMakeLists.txt when FEDSHARD_ENABLE_GLOO is ON.

if(NOT TARGET gloo)
  message(FATAL_ERROR "cmake/fedshard_gloo.cmake: expected the target gloo "
                      "(find_package(Gloo CONFIG)), found none")
endif()

add_library(fedshard_gloo INTERFACE)
add_library(fedshard::gloo ALIAS fedshard_gloo)
set_target_properties(fedshard_gloo PROPERTIES EXPORT_NAME gloo)
target_link_libraries(fedshard_gloo INTERFACE fedshard::fedshard gloo "${FEDSHARD_HIREDIS_LIBRARY}")
target_include_directories(fedshard_gloo INTERFACE "$<BUILD_INTERFACE:${FEDSHARD_HIREDIS_INCLUDE_DIR}>")
target_compile_definitions(fedshard_gloo INTERFACE FEDSHARD_HAS_GLOO=1)
target_sources(fedshard_gloo INTERFACE
  FILE_SET HEADERS
  BASE_DIRS "${fedshard_SOURCE_DIR}/include"
  FILES "${fedshard_SOURCE_DIR}/include/fedshard/comm/gloo.hpp")

if(FEDSHARD_VERIFY_HEADERS)
  set_target_properties(fedshard_gloo PROPERTIES VERIFY_INTERFACE_HEADER_SETS ON)
  if(TARGET fedshard_verify_headers)
    add_dependencies(fedshard_verify_headers fedshard_gloo_verify_interface_header_sets)
  endif()
endif()

if(FEDSHARD_INSTALL)
  if(NOT DEFINED FEDSHARD_INSTALL_CMAKEDIR)
    set(FEDSHARD_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/fedshard")
  endif()
  # fedshardConfig.cmake includes fedshard-glooTargets.cmake for COMPONENTS gloo, after
  # find_dependency(Gloo CONFIG).
  install(TARGETS fedshard_gloo
    EXPORT fedshard-glooTargets
    FILE_SET HEADERS DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
  install(EXPORT fedshard-glooTargets
    NAMESPACE fedshard::
    DESTINATION "${FEDSHARD_INSTALL_CMAKEDIR}")
endif()

# The Redis server of the tests that need one (they start it on 127.0.0.1 themselves and
# stop it again); tests that need it are skipped with a message when it is missing.
find_program(FEDSHARD_REDIS_SERVER redis-server DOC "redis-server, for the Redis store's tests")
