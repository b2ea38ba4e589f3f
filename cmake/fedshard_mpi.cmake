# The MPI component: the INTERFACE target fedshard::mpi (include/fedshard/comm/mpi.hpp over
# MPI::MPI_CXX, FEDSHARD_HAS_MPI=1), its header check and install rules, and
# fedshard_add_mpi_test() to register doctest executables that run under mpiexec.
#
# Include it from the top-level CMakeLists.txt when FEDSHARD_ENABLE_MPI is ON (MPI::MPI_CXX
# found), after the fedshard target, the header check target and the install variables exist.

if(NOT TARGET MPI::MPI_CXX)
  message(FATAL_ERROR "cmake/fedshard_mpi.cmake: expected the target MPI::MPI_CXX "
                      "(find_package(MPI COMPONENTS CXX)), found none")
endif()

include("${CMAKE_CURRENT_LIST_DIR}/fedshard_component.cmake")
fedshard_header_component(mpi fedshard/comm/mpi.hpp)
target_link_libraries(fedshard_mpi INTERFACE MPI::MPI_CXX)
target_compile_definitions(fedshard_mpi INTERFACE FEDSHARD_HAS_MPI=1)

# Open MPI refuses to start more ranks than cores unless told (and to run as root: see the
# tests' environment). Other MPIs get no extra flag.
if(NOT DEFINED FEDSHARD_MPIEXEC_EXTRA_FLAGS)
  set(fedshard_mpiexec_default_flags "")
  if(MPIEXEC_EXECUTABLE)
    execute_process(COMMAND "${MPIEXEC_EXECUTABLE}" --version
                    OUTPUT_VARIABLE fedshard_mpiexec_version ERROR_QUIET
                    RESULT_VARIABLE fedshard_mpiexec_result TIMEOUT 30)
    if(fedshard_mpiexec_result EQUAL 0 AND fedshard_mpiexec_version MATCHES "Open MPI|OpenRTE")
      set(fedshard_mpiexec_default_flags --oversubscribe)
    endif()
  endif()
  set(FEDSHARD_MPIEXEC_EXTRA_FLAGS "${fedshard_mpiexec_default_flags}" CACHE STRING
      "Flags (a list) added after the rank count of every MPI test (default: --oversubscribe for Open MPI)")
endif()

# fedshard_add_mpi_test(<name> SOURCES <files...> [RANKS <n>] [TIMEOUT <s>] [LABELS <labels...>])
# Builds <name> from the sources and tests/mpi/main.cpp (every rank runs the doctest session;
# the job fails when a test failed on any rank) and registers a test that runs it as
#   mpiexec -n <n> [--oversubscribe] <preflags> <name> <postflags>
# labelled "mpi" (plus LABELS), with RANKS (default 4) processors reserved for ctest.
function(fedshard_add_mpi_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "RANKS;TIMEOUT" "SOURCES;LABELS")
  if(NOT arg_SOURCES)
    message(FATAL_ERROR "fedshard_add_mpi_test(${name}): expected SOURCES, found none")
  endif()
  if(NOT arg_RANKS)
    set(arg_RANKS 4)
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 300)
  endif()
  if(NOT TARGET fedshard_mpi_doctest_main)
    add_library(fedshard_mpi_doctest_main OBJECT "${fedshard_SOURCE_DIR}/tests/mpi/main.cpp")
    target_link_libraries(fedshard_mpi_doctest_main PUBLIC fedshard::mpi doctest::doctest)
    target_compile_definitions(fedshard_mpi_doctest_main PUBLIC OMPI_SKIP_MPICXX
                                                                MPICH_SKIP_MPICXX)
    if(TARGET fedshard_warnings)
      target_link_libraries(fedshard_mpi_doctest_main PRIVATE fedshard_warnings)
    endif()
  endif()
  add_executable(${name} ${arg_SOURCES})
  target_include_directories(${name} PRIVATE "${fedshard_SOURCE_DIR}/tests")
  target_link_libraries(${name} PRIVATE fedshard_mpi_doctest_main)
  if(TARGET fedshard_warnings)
    target_link_libraries(${name} PRIVATE fedshard_warnings)
  endif()
  add_test(NAME ${name}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${arg_RANKS}
                   ${FEDSHARD_MPIEXEC_EXTRA_FLAGS} ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${name}>
                   ${MPIEXEC_POSTFLAGS})
  set_tests_properties(${name} PROPERTIES
    LABELS "mpi;${arg_LABELS}"
    TIMEOUT ${arg_TIMEOUT}
    PROCESSORS ${arg_RANKS}
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endfunction()
