# The safetensors component: the INTERFACE target fedshard::safetensors
# (include/fedshard/io/safetensors.hpp over nlohmann_json), its header check and install
# rules, and the Python of the cross-check test (FEDSHARD_TEST_PYTHON).
#
# Include it from the top-level CMakeLists.txt when FEDSHARD_ENABLE_SAFETENSORS is ON.

if(NOT TARGET nlohmann_json::nlohmann_json)
  message(FATAL_ERROR "cmake/fedshard_safetensors.cmake: expected the target "
                      "nlohmann_json::nlohmann_json (find_package(nlohmann_json 3 CONFIG)), found none")
endif()

include("${CMAKE_CURRENT_LIST_DIR}/fedshard_component.cmake")
fedshard_header_component(safetensors fedshard/io/safetensors.hpp)
target_link_libraries(fedshard_safetensors INTERFACE nlohmann_json::nlohmann_json)

if(NOT FEDSHARD_BUILD_TESTS)
  return()
endif()

# The Python that loads exported files with the `safetensors` package (tests/io): given (the
# cache variable, or the environment variable FEDSHARD_TEST_PYTHON at configure time), it
# must import safetensors and numpy, or the configuration stops, and the test fails rather
# than skips without it; not given, the virtual environment of cmake/install-deps.sh
# ($FEDSHARD_VENV, default /opt/fedshard/venv) is used when it has them, and the test is
# skipped with a message otherwise.
set(FEDSHARD_TEST_PYTHON "" CACHE FILEPATH "Python with safetensors and numpy for the \
safetensors cross-check test (empty: the environment variable FEDSHARD_TEST_PYTHON, else the \
virtual environment of install-deps.sh when present)")
set(fedshard_test_python "${FEDSHARD_TEST_PYTHON}")
if(fedshard_test_python STREQUAL "" AND NOT "$ENV{FEDSHARD_TEST_PYTHON}" STREQUAL "")
  set(fedshard_test_python "$ENV{FEDSHARD_TEST_PYTHON}")
endif()
set(fedshard_test_python_required OFF)
if(NOT fedshard_test_python STREQUAL "")
  set(fedshard_test_python_required ON)
else()
  set(fedshard_venv "/opt/fedshard/venv")
  if(NOT "$ENV{FEDSHARD_VENV}" STREQUAL "")
    set(fedshard_venv "$ENV{FEDSHARD_VENV}")
  endif()
  if(EXISTS "${fedshard_venv}/bin/python")
    set(fedshard_test_python "${fedshard_venv}/bin/python")
  endif()
endif()
if(NOT fedshard_test_python STREQUAL "")
  execute_process(COMMAND "${fedshard_test_python}" -c "import numpy, safetensors.numpy"
                  RESULT_VARIABLE fedshard_python_result
                  OUTPUT_QUIET ERROR_VARIABLE fedshard_python_error)
  if(NOT fedshard_python_result EQUAL 0)
    if(fedshard_test_python_required)
      message(FATAL_ERROR
        "FEDSHARD_TEST_PYTHON='${fedshard_test_python}' cannot import numpy and "
        "safetensors.numpy (${fedshard_python_result}): ${fedshard_python_error}"
        "run cmake/install-deps.sh, or point FEDSHARD_TEST_PYTHON at a Python that has them")
    endif()
    message(STATUS "fedshard: ${fedshard_test_python} lacks numpy or safetensors; the "
                   "safetensors cross-check test will be skipped")
    set(fedshard_test_python "")
  endif()
endif()
if(fedshard_test_python STREQUAL "")
  message(STATUS "fedshard: no Python with safetensors and numpy (run cmake/install-deps.sh); "
                 "the safetensors cross-check test will be skipped")
else()
  message(STATUS "fedshard: safetensors cross-check test runs ${fedshard_test_python}")
endif()
