# Test helpers shared by tests/, examples/ and bench/.
#
# FEDSHARD_TEST_LAUNCHER: command list prefixed to every test this project registers.
# Empty by default; under ThreadSanitizer on Linux it runs tests without ASLR (see
# cmake/run-without-aslr.sh), so TSan works whatever the kernel's randomization.
set(FEDSHARD_TEST_LAUNCHER "" CACHE STRING
    "Command (a list) prefixed to every fedshard test; empty = automatic")

set(fedshard_test_launcher "${FEDSHARD_TEST_LAUNCHER}")
if(fedshard_test_launcher STREQUAL ""
   AND CMAKE_SYSTEM_NAME STREQUAL "Linux"
   AND "${CMAKE_CXX_FLAGS} ${CMAKE_CXX_FLAGS_${CMAKE_BUILD_TYPE}}" MATCHES "-fsanitize=([a-z,]*,)?thread")
  find_program(FEDSHARD_SETARCH setarch)
  if(FEDSHARD_SETARCH)
    set(fedshard_test_launcher "${CMAKE_CURRENT_LIST_DIR}/run-without-aslr.sh")
  endif()
endif()
if(fedshard_test_launcher)
  message(STATUS "fedshard tests run through: ${fedshard_test_launcher}")
endif()

# fedshard_add_test(<name> COMMAND <target> [args...] LABELS <labels...> [TIMEOUT <s>])
# Registers a test running an executable target through the launcher.
function(fedshard_add_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "COMMAND;LABELS")
  list(POP_FRONT arg_COMMAND target)
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 900)
  endif()
  add_test(NAME ${name}
           COMMAND ${fedshard_test_launcher} $<TARGET_FILE:${target}> ${arg_COMMAND})
  set_tests_properties(${name} PROPERTIES LABELS "${arg_LABELS}" TIMEOUT ${arg_TIMEOUT})
endfunction()
