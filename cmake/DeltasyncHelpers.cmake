# ds_module(NAME SOURCES ... [DEPS ...] [PRIVATE_DEPS ...])
# A static library ds_NAME. DEPS are the earlier modules it may use. It is
# installed and exported as deltasync::NAME (cmake/DeltasyncInstall.cmake).
function(ds_module NAME)
  cmake_parse_arguments(M "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(ds_${NAME} STATIC ${M_SOURCES})
  add_library(deltasync::${NAME} ALIAS ds_${NAME})
  set_target_properties(ds_${NAME} PROPERTIES EXPORT_NAME ${NAME})
  target_include_directories(ds_${NAME}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:include>
    PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(ds_${NAME} PUBLIC ${M_DEPS} PRIVATE ${M_PRIVATE_DEPS})
  if(DELTASYNC_SANITIZE)
    # An installed sanitized library needs the sanitizer runtime in whatever
    # links it (here every target gets it from add_link_options).
    target_link_options(ds_${NAME} INTERFACE $<INSTALL_INTERFACE:-fsanitize=${DELTASYNC_SANITIZE}>)
  endif()
  set_property(GLOBAL APPEND PROPERTY DELTASYNC_INSTALLED_TARGETS ds_${NAME})
endfunction()

# ds_test(NAME SOURCES ... DEPS ...)
# A GoogleTest executable whose cases are registered with CTest one by one.
# Tests find checked-in data through the DS_SOURCE_DIR macro.
function(ds_test NAME)
  if(NOT DELTASYNC_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(T "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${NAME} ${T_SOURCES})
  target_include_directories(${NAME} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${NAME} PRIVATE ${T_DEPS} GTest::gtest GTest::gtest_main)
  target_compile_definitions(${NAME} PRIVATE DS_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                             DS_BINARY_DIR="${PROJECT_BINARY_DIR}")
  gtest_discover_tests(${NAME} DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60
                       PROPERTIES TIMEOUT 600)
endfunction()
