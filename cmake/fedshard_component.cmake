# fedshard_header_component(<name> <header>): the INTERFACE target fedshard::<name> (library
# fedshard_<name>, export name <name>) whose one public header is include/<header>, over
# fedshard::fedshard; with FEDSHARD_VERIFY_HEADERS its header is compiled on its own, and with
# FEDSHARD_INSTALL it is installed with the export set fedshard-<name>Targets, which
# fedshardConfig.cmake includes for COMPONENTS <name> after finding the component's
# dependencies. The caller links those dependencies to fedshard_<name>.
function(fedshard_header_component name header)
  add_library(fedshard_${name} INTERFACE)
  add_library(fedshard::${name} ALIAS fedshard_${name})
  set_target_properties(fedshard_${name} PROPERTIES EXPORT_NAME ${name})
  target_link_libraries(fedshard_${name} INTERFACE fedshard::fedshard)
  target_sources(fedshard_${name} INTERFACE
    FILE_SET HEADERS
    BASE_DIRS "${fedshard_SOURCE_DIR}/include"
    FILES "${fedshard_SOURCE_DIR}/include/${header}")

  if(FEDSHARD_VERIFY_HEADERS)
    set_target_properties(fedshard_${name} PROPERTIES VERIFY_INTERFACE_HEADER_SETS ON)
    if(TARGET fedshard_verify_headers)
      add_dependencies(fedshard_verify_headers fedshard_${name}_verify_interface_header_sets)
    endif()
  endif()

  if(FEDSHARD_INSTALL)
    set(cmakedir "${FEDSHARD_INSTALL_CMAKEDIR}")
    if(NOT cmakedir)
      set(cmakedir "${CMAKE_INSTALL_DATADIR}/cmake/fedshard")
    endif()
    install(TARGETS fedshard_${name}
      EXPORT fedshard-${name}Targets
      FILE_SET HEADERS DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
    install(EXPORT fedshard-${name}Targets
      NAMESPACE fedshard::
      DESTINATION "${cmakedir}")
  endif()
endfunction()
