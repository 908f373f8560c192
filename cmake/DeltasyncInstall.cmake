# Installing deltasync as a C++ dependency. After a build,
#   cmake --install <build dir> --prefix <P>
# puts the module libraries (libds_core.a, libds_checksum.a, ...) in
# <P>/lib, the public headers in <P>/include/deltasync, the `deltasync` CLI
# in <P>/bin, and a CMake package in <P>/lib/cmake/deltasync, so that a
# consumer writes
#   find_package(deltasync REQUIRED)
#   target_link_libraries(app PRIVATE deltasync::deltasync)
# or links one module and what it needs (deltasync::format, ...).
#
# The modules stay separate static libraries rather than one combined
# archive: that is what the build makes (merging archives would take a
# second build of every object, or an ar script CMake does not provide), and
# a consumer that needs only safetensors links only ds_format and ds_core.
# They are built position-independent, so they link into shared libraries
# too. deltasync::deltasync is every module.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DELTASYNC_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/deltasync)
get_property(ds_installed GLOBAL PROPERTY DELTASYNC_INSTALLED_TARGETS)
set(ds_exported deltasync ${ds_installed})
# A static library's private links are its users' link line, so the
# consumer's package must provide each of them (deltasyncConfig.cmake.in).
# The agent's HTTP library is a target of ours and is exported with it.
set(DELTASYNC_PKG_MODULES)
if(TARGET ds_checksum OR TARGET ds_codec)
  list(APPEND DELTASYNC_PKG_MODULES "XXHASH libxxhash")
endif()
if(TARGET ds_codec)
  list(APPEND DELTASYNC_PKG_MODULES "ZSTD libzstd")
endif()
if(TARGET ds_agent)
  list(APPEND ds_exported deltasync_httplib)
  if(TARGET PkgConfig::HTTPLIB)
    list(APPEND DELTASYNC_PKG_MODULES "HTTPLIB cpp-httplib")
  endif()
endif()

# Each module's include directory is $<INSTALL_INTERFACE:include>
# (ds_module).
install(TARGETS ${ds_exported} EXPORT deltasyncTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/deltasync
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
install(EXPORT deltasyncTargets NAMESPACE deltasync:: DESTINATION ${DELTASYNC_INSTALL_CMAKEDIR})
if(TARGET deltasync_cli)
  install(TARGETS deltasync_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/deltasyncConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/deltasyncConfig.cmake
                              INSTALL_DESTINATION ${DELTASYNC_INSTALL_CMAKEDIR})
# 0.x: a minor version may break the API, so only the same minor matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/deltasyncConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/deltasyncConfig.cmake
              ${PROJECT_BINARY_DIR}/deltasyncConfigVersion.cmake
        DESTINATION ${DELTASYNC_INSTALL_CMAKEDIR})
