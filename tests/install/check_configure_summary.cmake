# CTest package_configure_summary: configures this source tree in a scratch
# build directory (tests and benchmarks off, so it stays cheap) and checks
# what configure reports against the source tree itself:
# - the "modules built" line names exactly the module directories present
#   (optional ones only when their component is on);
# - an optional component whose directory is absent is reported absent, its
#   dependency is not probed (no "Looking for a CUDA compiler"), and asking
#   for it with ON is an error naming the directory.
#   cmake -DSOURCE_DIR=<src> -DWORK_DIR=<scratch> -DGENERATOR=<gen>
#         -DMAKE_PROGRAM=<ninja> -DC_COMPILER=<cc> -DCXX_COMPILER=<c++>
#         -P check_configure_summary.cmake
cmake_minimum_required(VERSION 3.25)
foreach(var SOURCE_DIR WORK_DIR GENERATOR C_COMPILER CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_configure_summary.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
set(args -S ${SOURCE_DIR} -B ${WORK_DIR} -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DDELTASYNC_BUILD_TESTS=OFF -DDELTASYNC_BUILD_BENCH=OFF)
if(MAKE_PROGRAM)
  list(APPEND args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
execute_process(COMMAND ${CMAKE_COMMAND} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configure failed (${rc}):\n${out}")
endif()

# Optional components, the directory each module lives in, and the words
# configure used for them before (probing even an absent module). `stream`
# holds the NCCL and Gloo communicators but is built without them, so it is
# not an optional module: present, it must be reported built.
set(optional_dirs CUDA=src/cuda NCCL=src/stream GLOO=src/stream PYTHON=python)
set(optional_modules cuda python)

# The modules the tree holds: src/<m>/CMakeLists.txt.
file(GLOB present RELATIVE ${SOURCE_DIR}/src ${SOURCE_DIR}/src/*/CMakeLists.txt)
list(TRANSFORM present REPLACE "/CMakeLists.txt$" "")
string(REGEX MATCH "deltasync: modules built: ([^\n]*)" line "${out}")
if(NOT line)
  message(FATAL_ERROR "configure printed no 'deltasync: modules built:' line:\n${out}")
endif()
string(REPLACE " " ";" built "${CMAKE_MATCH_1}")
foreach(module IN LISTS built)
  if(NOT module IN_LIST present AND NOT EXISTS ${SOURCE_DIR}/${module}/CMakeLists.txt)
    message(FATAL_ERROR "configure reports module '${module}' built, but the tree has no "
                        "src/${module} or ${module}/:\n${line}")
  endif()
endforeach()
foreach(module IN LISTS present)
  if(NOT module IN_LIST built AND NOT module IN_LIST optional_modules)
    message(FATAL_ERROR "the tree has src/${module} but configure does not report it built:\n"
                        "${line}")
  endif()
endforeach()

foreach(pair IN LISTS optional_dirs)
  string(REPLACE "=" ";" pair "${pair}")
  list(GET pair 0 component)
  list(GET pair 1 dir)
  if(EXISTS ${SOURCE_DIR}/${dir}/CMakeLists.txt)
    continue()
  endif()
  if(NOT out MATCHES "optional components:[^\n]*${component} \\(no ${dir} in this tree\\)")
    message(FATAL_ERROR "${component} has no ${dir} but configure does not say so:\n${out}")
  endif()
  if(out MATCHES "${component}[^\n]* enabled")
    message(FATAL_ERROR "configure reports ${component} enabled without ${dir}:\n${out}")
  endif()
  if(component STREQUAL "CUDA" AND out MATCHES "Looking for a CUDA compiler")
    message(FATAL_ERROR "configure probed for CUDA though there is no ${dir}:\n${out}")
  endif()
  # ON for a module that is not there is an error naming what is missing
  # (the other components stay AUTO: an earlier round left its ON behind).
  set(modes)
  foreach(other IN ITEMS CUDA NCCL GLOO PYTHON)
    if(other STREQUAL component)
      list(APPEND modes -DDELTASYNC_WITH_${other}=ON)
    else()
      list(APPEND modes -DDELTASYNC_WITH_${other}=AUTO)
    endif()
  endforeach()
  execute_process(COMMAND ${CMAKE_COMMAND} ${modes} ${WORK_DIR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE on_out ERROR_VARIABLE on_out)
  string(REGEX REPLACE "[ \n]+" " " on_text "${on_out}")  # the message may be wrapped
  if(rc EQUAL 0 OR NOT on_text MATCHES "DELTASYNC_WITH_${component}=ON but this source tree has no ${dir}")
    message(FATAL_ERROR "DELTASYNC_WITH_${component}=ON without ${dir} was not refused "
                        "(${rc}):\n${on_out}")
  endif()
endforeach()
message(STATUS "configure summary matches the tree: ${line}")
file(REMOVE_RECURSE ${WORK_DIR})
