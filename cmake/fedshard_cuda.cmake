# The CUDA components and everything built with nvcc:
#  - fedshard::cuda (target fedshard_cuda): include/fedshard/cuda/*.cuh except nccl.cuh
#    (device buffers, streams and events, kernels, CUB reductions), CUDA::cudart,
#    FEDSHARD_HAS_CUDA=1, C++20 for CUDA sources;
#  - fedshard::nccl (target fedshard_nccl): include/fedshard/cuda/nccl.cuh and libnccl,
#    FEDSHARD_HAS_NCCL=1;
#  - a header check that compiles every .cuh on its own in a .cu (with
#    FEDSHARD_VERIFY_HEADERS);
#  - the GPU tests, one executable per tests/cuda/test_<name>.cu, named test_cuda_<name>,
#    labelled gpu and cuda (test_nccl, and test_trainer_gpu when NCCL is enabled, also link
#    fedshard::nccl), built by the target fedshard_gpu_tests; without a device they
#    exit with 77, which ctest reports as skipped (tests/support/doctest_gpu_main.cpp);
#  - install rules: exports fedshard-cudaTargets and fedshard-ncclTargets.
#
# Included by the top-level CMakeLists.txt after tests/ and examples/ and before bench/;
# does nothing unless FEDSHARD_ENABLE_CUDA (cmake/fedshard_detect.cmake). The architectures
# default to sm_80 and sm_90 (CMAKE_CUDA_ARCHITECTURES or the CUDAARCHS environment variable
# override them; "native" builds for the GPUs of the machine).

if(NOT FEDSHARD_ENABLE_CUDA)
  return()
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
  set(CMAKE_CUDA_ARCHITECTURES 80 90 CACHE STRING
      "CUDA architectures of fedshard's CUDA targets (default: sm_80 and sm_90)")
endif()
# nvcc compiles the host code with the project's C++ compiler unless told otherwise.
if(NOT DEFINED CMAKE_CUDA_HOST_COMPILER AND NOT DEFINED ENV{CUDAHOSTCXX}
   AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  set(CMAKE_CUDA_HOST_COMPILER "${CMAKE_CXX_COMPILER}" CACHE FILEPATH
      "Host compiler of nvcc (default: the C++ compiler)")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# Our CUDA sources are standard C++20 as well.
if(PROJECT_IS_TOP_LEVEL AND NOT DEFINED CMAKE_CUDA_EXTENSIONS)
  set(CMAKE_CUDA_EXTENSIONS OFF)
endif()

file(GLOB fedshard_cuda_headers CONFIGURE_DEPENDS
     RELATIVE "${PROJECT_SOURCE_DIR}"
     "${PROJECT_SOURCE_DIR}/include/fedshard/cuda/*.cuh")
list(SORT fedshard_cuda_headers)
set(fedshard_nccl_headers "include/fedshard/cuda/nccl.cuh")
list(REMOVE_ITEM fedshard_cuda_headers ${fedshard_nccl_headers})

# ---------------------------------------------------------------- fedshard::cuda
add_library(fedshard_cuda INTERFACE)
add_library(fedshard::cuda ALIAS fedshard_cuda)
set_target_properties(fedshard_cuda PROPERTIES EXPORT_NAME cuda)
target_link_libraries(fedshard_cuda INTERFACE fedshard::fedshard CUDA::cudart)
target_compile_definitions(fedshard_cuda INTERFACE FEDSHARD_HAS_CUDA=1)
if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
  target_compile_features(fedshard_cuda INTERFACE cuda_std_20)
else()
  # CMake before 3.26 knows no C++20 for nvcc (nvcc >= 12 has it): pass the flag. A consumer
  # that sets CUDA_STANDARD itself must then leave it unset or set the same standard.
  target_compile_options(fedshard_cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
endif()
target_sources(fedshard_cuda INTERFACE
  FILE_SET HEADERS
  BASE_DIRS include
  FILES ${fedshard_cuda_headers})

# ---------------------------------------------------------------- fedshard::nccl
if(FEDSHARD_ENABLE_NCCL)
  add_library(fedshard_nccl INTERFACE)
  add_library(fedshard::nccl ALIAS fedshard_nccl)
  set_target_properties(fedshard_nccl PROPERTIES EXPORT_NAME nccl)
  target_link_libraries(fedshard_nccl INTERFACE fedshard::cuda "${FEDSHARD_NCCL_LIBRARY}")
  target_include_directories(fedshard_nccl SYSTEM INTERFACE "${FEDSHARD_NCCL_INCLUDE_DIR}")
  target_compile_definitions(fedshard_nccl INTERFACE FEDSHARD_HAS_NCCL=1)
  target_sources(fedshard_nccl INTERFACE
    FILE_SET HEADERS
    BASE_DIRS include
    FILES ${fedshard_nccl_headers})
endif()

# Warnings for the CUDA code this project compiles itself (nvcc's own and the host
# compiler's), never propagated to users.
if(FEDSHARD_BUILD_TESTS OR FEDSHARD_BUILD_BENCH OR FEDSHARD_VERIFY_HEADERS)
  add_library(fedshard_cuda_warnings INTERFACE)
  target_compile_options(fedshard_cuda_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${FEDSHARD_WARNINGS_AS_ERRORS}>>:--Werror=all-warnings>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${FEDSHARD_WARNINGS_AS_ERRORS}>>:-Xcompiler=-Werror>)
endif()

# ---------------------------------------------------------------- header check
# One .cu per header that includes only it, compiled for every architecture.
if(FEDSHARD_VERIFY_HEADERS)
  set(fedshard_cuda_check_dir "${PROJECT_BINARY_DIR}/fedshard_cuda_header_check")
  foreach(component IN ITEMS cuda nccl)
    if(component STREQUAL "nccl" AND NOT FEDSHARD_ENABLE_NCCL)
      continue()
    endif()
    set(sources "")
    foreach(header IN LISTS fedshard_${component}_headers)
      string(REGEX REPLACE "^include/" "" include_path "${header}")
      get_filename_component(stem "${header}" NAME_WE)
      set(source "${fedshard_cuda_check_dir}/${stem}.cu")
      file(CONFIGURE OUTPUT "${source}"
           CONTENT "#include \"${include_path}\"  // must compile on its own\n")
      list(APPEND sources "${source}")
    endforeach()
    add_library(fedshard_${component}_header_check OBJECT ${sources})
    target_link_libraries(fedshard_${component}_header_check
                          PRIVATE fedshard::${component} fedshard_cuda_warnings)
  endforeach()
endif()

# ---------------------------------------------------------------- GPU tests
if(FEDSHARD_BUILD_TESTS)
  find_package(doctest REQUIRED)
  add_library(fedshard_gpu_test_main OBJECT tests/support/doctest_gpu_main.cpp)
  target_link_libraries(fedshard_gpu_test_main PUBLIC doctest::doctest CUDA::cudart)
  target_compile_features(fedshard_gpu_test_main PUBLIC cxx_std_20)

  file(GLOB fedshard_gpu_test_sources CONFIGURE_DEPENDS
       RELATIVE "${PROJECT_SOURCE_DIR}"
       "${PROJECT_SOURCE_DIR}/tests/cuda/test_*.cu")
  list(SORT fedshard_gpu_test_sources)
  add_custom_target(fedshard_gpu_tests)
  foreach(source IN LISTS fedshard_gpu_test_sources)
    get_filename_component(stem "${source}" NAME_WE)
    string(REGEX REPLACE "^test_" "" name "${stem}")
    if(name STREQUAL "nccl" AND NOT FEDSHARD_ENABLE_NCCL)
      continue()
    endif()
    set(target "test_cuda_${name}")
    add_executable(${target} "${source}")
    target_include_directories(${target} PRIVATE "${PROJECT_SOURCE_DIR}/tests")
    if(name STREQUAL "trainer_gpu" OR name STREQUAL "alias_gpu")
      # Their model is the example's device MLP (examples/gpu/device_mlp.cuh).
      target_include_directories(${target} PRIVATE "${PROJECT_SOURCE_DIR}/examples")
    endif()
    target_link_libraries(${target} PRIVATE fedshard::cuda fedshard_gpu_test_main
                                            fedshard_cuda_warnings)
    # The NCCL test, and the trainer's GPU test when NCCL is there (it instantiates the
    # trainer with nccl::communicator under FEDSHARD_HAS_NCCL).
    if(name STREQUAL "nccl" OR (name STREQUAL "trainer_gpu" AND FEDSHARD_ENABLE_NCCL))
      target_link_libraries(${target} PRIVATE fedshard::nccl)
    endif()
    fedshard_add_test(${target} COMMAND ${target} LABELS gpu cuda)
    set_tests_properties(${target} PROPERTIES SKIP_RETURN_CODE 77)
    add_dependencies(fedshard_gpu_tests ${target})
  endforeach()
endif()

# ---------------------------------------------------------------- install
if(FEDSHARD_INSTALL)
  foreach(component IN ITEMS cuda nccl)
    if(TARGET fedshard_${component})
      install(TARGETS fedshard_${component}
        EXPORT fedshard-${component}Targets
        FILE_SET HEADERS DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
      install(EXPORT fedshard-${component}Targets
        NAMESPACE fedshard::
        DESTINATION "${FEDSHARD_INSTALL_CMAKEDIR}")
    endif()
  endforeach()
endif()
