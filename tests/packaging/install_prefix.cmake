# cmake -DBUILD_DIR=<build> -DPREFIX=<dir> -DCONFIG=<config> -P install_prefix.cmake
# Installs the build into an empty PREFIX (anything from an earlier run is removed first).
foreach(var IN ITEMS BUILD_DIR PREFIX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "install_prefix.cmake: expected -D${var}=..., found none")
  endif()
endforeach()
file(REMOVE_RECURSE "${PREFIX}")
set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}"
                        ${config_args}
                COMMAND_ECHO STDOUT
                RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} failed: ${result}")
endif()
foreach(expected IN ITEMS include/fedshard/version.hpp include/fedshard/comm/communicator.hpp)
  if(NOT EXISTS "${PREFIX}/${expected}")
    message(FATAL_ERROR "expected ${PREFIX}/${expected} after the install, found none")
  endif()
endforeach()
