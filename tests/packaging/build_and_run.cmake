# cmake -DSOURCE_DIR=<consumer> -DBINARY_DIR=<dir> -DGENERATOR=<g> -DMAKE_PROGRAM=<p>
#       -DCXX_COMPILER=<c> -DCXX_FLAGS=<f> -DCONFIG=<config> [-DEXTRA_ARGS=<-D...;...>]
#       -P build_and_run.cmake
# Configures a consumer project in an empty BINARY_DIR, builds it and runs its `consumer`
# executable; any failing step fails the test.
foreach(var IN ITEMS SOURCE_DIR BINARY_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "build_and_run.cmake: expected -D${var}=..., found none")
  endif()
endforeach()
if(NOT CONFIG)
  set(CONFIG Release)
endif()

function(run_step what)
  execute_process(COMMAND ${ARGN} COMMAND_ECHO STDOUT RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${what} failed: ${result}")
  endif()
endfunction()

file(REMOVE_RECURSE "${BINARY_DIR}")
set(configure_args -S "${SOURCE_DIR}" -B "${BINARY_DIR}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
    "-DCMAKE_BUILD_TYPE=${CONFIG}" ${EXTRA_ARGS})
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
run_step("configuring ${SOURCE_DIR}" "${CMAKE_COMMAND}" ${configure_args})
run_step("building ${SOURCE_DIR}" "${CMAKE_COMMAND}" --build "${BINARY_DIR}" --config "${CONFIG}")

find_program(consumer consumer
             PATHS "${BINARY_DIR}" "${BINARY_DIR}/${CONFIG}" NO_DEFAULT_PATH REQUIRED)
run_step("running ${consumer}" "${consumer}")
