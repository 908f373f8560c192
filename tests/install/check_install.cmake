# CTest package_install_consumer: installs the already-built tree into a
# fresh prefix (nothing is rebuilt), then configures, builds and runs the
# program in consumer/ against that prefix alone, as a project that depends
# on deltasync would.
#   cmake -DBUILD_DIR=<build> -DWORK_DIR=<scratch> -DGENERATOR=<gen>
#         -DMAKE_PROGRAM=<ninja> -DCXX_COMPILER=<c++> -DVERSION=<x.y.z>
#         -P check_install.cmake
cmake_minimum_required(VERSION 3.25)
foreach(var BUILD_DIR WORK_DIR GENERATOR CXX_COMPILER VERSION)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_install.cmake: -D${var}=... is required")
  endif()
endforeach()
set(prefix ${WORK_DIR}/prefix)
set(consumer_build ${WORK_DIR}/consumer)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/scratch)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

run("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})

# What a dependent project needs is there; what is internal is not.
foreach(path include/deltasync/status.h include/deltasync/checkpoint.h include/deltasync/codec.h
             bin/deltasync)
  if(NOT EXISTS ${prefix}/${path})
    message(FATAL_ERROR "the install lacks ${path}")
  endif()
endforeach()
file(GLOB_RECURSE config ${prefix}/*/deltasyncConfig.cmake)
file(GLOB_RECURSE libraries ${prefix}/*/libds_core.a)
if(NOT config OR NOT libraries)
  message(FATAL_ERROR "the install lacks deltasyncConfig.cmake or libds_core.a")
endif()
file(GLOB_RECURSE internal RELATIVE ${prefix} ${prefix}/*_test ${prefix}/*_internal.h
     ${prefix}/include/format/* ${prefix}/include/store/*)
if(internal)
  message(FATAL_ERROR "the install holds internal files: ${internal}")
endif()

# The CLI runs from the prefix.
run("the installed deltasync --version" ${prefix}/bin/deltasync --version)
if(NOT run_output MATCHES "${VERSION}")
  message(FATAL_ERROR "the installed deltasync --version printed '${run_output}', not ${VERSION}")
endif()

# Only the prefix: no package registry, no build tree.
set(configure_args -S ${CMAKE_CURRENT_LIST_DIR}/consumer -B ${consumer_build} -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
if(MAKE_PROGRAM)
  list(APPEND configure_args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
run("configuring the consumer" ${CMAKE_COMMAND} ${configure_args})
file(STRINGS ${consumer_build}/CMakeCache.txt found_at REGEX "^deltasync_DIR:")
string(FIND "${found_at}" "${prefix}/" at)
if(NOT at GREATER -1)
  message(FATAL_ERROR "the consumer found deltasync outside the prefix: ${found_at}")
endif()
run("building the consumer" ${CMAKE_COMMAND} --build ${consumer_build})
run("the consumer" ${consumer_build}/consumer ${WORK_DIR}/scratch)
if(NOT run_output STREQUAL "ok\n")
  message(FATAL_ERROR "the consumer printed '${run_output}'")
endif()
message(STATUS "installed into ${prefix}; the consumer built against it and passed")
file(REMOVE_RECURSE ${WORK_DIR})
