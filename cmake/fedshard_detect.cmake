# Detects the optional backends and defines FEDSHARD_ENABLE_{MPI,CUDA,NCCL,GLOO,SAFETENSORS}.
# A backend that is not set explicitly is ON exactly when it is found; one that is set ON
# but cannot be found stops the configuration with what was looked for.

# ---------------------------------------------------------------- MPI
if(NOT DEFINED FEDSHARD_ENABLE_MPI OR FEDSHARD_ENABLE_MPI)
  find_package(MPI COMPONENTS CXX QUIET)
endif()
set(fedshard_mpi_found OFF)
if(MPI_CXX_FOUND)
  set(fedshard_mpi_found ON)
endif()
option(FEDSHARD_ENABLE_MPI "Build the MPI communicator (fedshard::mpi)" ${fedshard_mpi_found})
if(FEDSHARD_ENABLE_MPI AND NOT MPI_CXX_FOUND)
  message(FATAL_ERROR
    "FEDSHARD_ENABLE_MPI is ON but find_package(MPI COMPONENTS CXX) found no MPI C++ library; "
    "install one (Debian: libopenmpi-dev openmpi-bin) or configure with -DFEDSHARD_ENABLE_MPI=OFF")
endif()

# ---------------------------------------------------------------- CUDA
if(NOT DEFINED FEDSHARD_ENABLE_CUDA OR FEDSHARD_ENABLE_CUDA)
  # nvcc is usually not on PATH; the toolkit's default location is tried as well.
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX}
     AND EXISTS "/usr/local/cuda/bin/nvcc")
    set(ENV{CUDACXX} "/usr/local/cuda/bin/nvcc")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
endif()
# check_language() trusts a CMAKE_CUDA_COMPILER given by the user; at least it must exist.
set(fedshard_cuda_found OFF)
if(CMAKE_CUDA_COMPILER AND (EXISTS "${CMAKE_CUDA_COMPILER}" OR NOT IS_ABSOLUTE "${CMAKE_CUDA_COMPILER}"))
  set(fedshard_cuda_found ON)
endif()
option(FEDSHARD_ENABLE_CUDA "Build the CUDA components (fedshard::cuda)" ${fedshard_cuda_found})
if(FEDSHARD_ENABLE_CUDA AND NOT fedshard_cuda_found)
  message(FATAL_ERROR
    "FEDSHARD_ENABLE_CUDA is ON but no working CUDA compiler was found (CMAKE_CUDA_COMPILER="
    "'${CMAKE_CUDA_COMPILER}'; looked on PATH, in $CUDACXX and at /usr/local/cuda/bin/nvcc); "
    "set CMAKE_CUDA_COMPILER or configure with -DFEDSHARD_ENABLE_CUDA=OFF")
endif()

# ---------------------------------------------------------------- NCCL (needs CUDA)
if(FEDSHARD_ENABLE_CUDA AND (NOT DEFINED FEDSHARD_ENABLE_NCCL OR FEDSHARD_ENABLE_NCCL))
  get_filename_component(fedshard_cuda_bin "${CMAKE_CUDA_COMPILER}" DIRECTORY)
  get_filename_component(fedshard_cuda_root "${fedshard_cuda_bin}" DIRECTORY)
  find_path(FEDSHARD_NCCL_INCLUDE_DIR nccl.h
    HINTS ENV NCCL_ROOT "${fedshard_cuda_root}" /usr/local/cuda
    PATH_SUFFIXES include
    DOC "Folder holding nccl.h")
  find_library(FEDSHARD_NCCL_LIBRARY nccl
    HINTS ENV NCCL_ROOT "${fedshard_cuda_root}" /usr/local/cuda
    PATH_SUFFIXES lib64 lib
    DOC "The NCCL library")
endif()
set(fedshard_nccl_found OFF)
if(FEDSHARD_ENABLE_CUDA AND FEDSHARD_NCCL_INCLUDE_DIR AND FEDSHARD_NCCL_LIBRARY)
  set(fedshard_nccl_found ON)
endif()
option(FEDSHARD_ENABLE_NCCL "Build the NCCL communicator (fedshard::nccl)" ${fedshard_nccl_found})
if(FEDSHARD_ENABLE_NCCL AND NOT fedshard_nccl_found)
  if(NOT FEDSHARD_ENABLE_CUDA)
    message(FATAL_ERROR "FEDSHARD_ENABLE_NCCL is ON but FEDSHARD_ENABLE_CUDA is OFF; NCCL needs CUDA")
  endif()
  message(FATAL_ERROR
    "FEDSHARD_ENABLE_NCCL is ON but nccl.h / libnccl were not found (looked in $NCCL_ROOT, "
    "${fedshard_cuda_root} and the system folders); set FEDSHARD_NCCL_INCLUDE_DIR and "
    "FEDSHARD_NCCL_LIBRARY or configure with -DFEDSHARD_ENABLE_NCCL=OFF")
endif()

# ---------------------------------------------------------------- Gloo (TCP collectives
# between jobs), hiredis (its Redis store) and OpenSSL's libcrypto (HMAC-SHA256 of the
# signed store)
if(NOT DEFINED FEDSHARD_ENABLE_GLOO OR FEDSHARD_ENABLE_GLOO)
  find_package(Gloo CONFIG QUIET)
  find_path(FEDSHARD_HIREDIS_INCLUDE_DIR hiredis/hiredis.h DOC "Folder holding hiredis/hiredis.h")
  find_library(FEDSHARD_HIREDIS_LIBRARY hiredis DOC "The hiredis library")
  find_package(OpenSSL 3.0 COMPONENTS Crypto QUIET)
endif()
set(fedshard_gloo_found OFF)
if(TARGET gloo AND FEDSHARD_HIREDIS_INCLUDE_DIR AND FEDSHARD_HIREDIS_LIBRARY
   AND TARGET OpenSSL::Crypto)
  set(fedshard_gloo_found ON)
endif()
option(FEDSHARD_ENABLE_GLOO "Build the Gloo communicator (fedshard::gloo)" ${fedshard_gloo_found})
if(FEDSHARD_ENABLE_GLOO AND NOT fedshard_gloo_found)
  message(FATAL_ERROR
    "FEDSHARD_ENABLE_GLOO is ON but Gloo (find_package(Gloo CONFIG)), hiredis "
    "(hiredis/hiredis.h, libhiredis) or OpenSSL >= 3.0's libcrypto (find_package(OpenSSL)) "
    "was not found; install them (Debian: libgloo-dev libhiredis-dev libssl-dev) or "
    "configure with -DFEDSHARD_ENABLE_GLOO=OFF")
endif()

# ---------------------------------------------------------------- nlohmann_json (the
# safetensors header parser and writer)
if(NOT DEFINED FEDSHARD_ENABLE_SAFETENSORS OR FEDSHARD_ENABLE_SAFETENSORS)
  find_package(nlohmann_json 3 CONFIG QUIET)
endif()
set(fedshard_safetensors_found OFF)
if(TARGET nlohmann_json::nlohmann_json)
  set(fedshard_safetensors_found ON)
endif()
option(FEDSHARD_ENABLE_SAFETENSORS
       "Build the safetensors export and import (fedshard::safetensors)" ${fedshard_safetensors_found})
if(FEDSHARD_ENABLE_SAFETENSORS AND NOT fedshard_safetensors_found)
  message(FATAL_ERROR
    "FEDSHARD_ENABLE_SAFETENSORS is ON but find_package(nlohmann_json 3 CONFIG) found no "
    "nlohmann_json; install it (Debian: nlohmann-json3-dev) or configure with "
    "-DFEDSHARD_ENABLE_SAFETENSORS=OFF")
endif()
