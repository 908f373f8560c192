# Optional components. Each is a cache option DELTASYNC_WITH_<X> = AUTO|ON|OFF
# tied to the source directory that holds its module:
#   AUTO  builds the module when its dependency is found, skips it otherwise;
#   ON    makes a missing dependency (or a missing module) an error;
#   OFF   never builds it.
# A component whose directory is not in this source tree is never built, and
# its dependency is not even looked for: what configure reports must be what
# is built.
#
# ds_optional(<X> DIR <dir> WHAT <text> PROBE <macro>)
#   <dir> is relative to the source root (src/comm, python, ...). The macro
#   <macro>(<out>) sets <out> to ON when the dependency is found, OFF when
#   not. It runs inside this function: the imported targets and cache entries
#   it creates are there for the module, its plain variables are not (the
#   module repeats its find_package, answered from the cache).
# Sets DELTASYNC_WITH_<X>_ENABLED (ON or OFF) in the caller's scope and
# records the outcome for ds_optional_summary().
function(ds_optional X)
  cmake_parse_arguments(O "" "DIR;WHAT;PROBE" "" ${ARGN})
  set(option DELTASYNC_WITH_${X})
  set(${option} AUTO CACHE STRING "${O_WHAT} (AUTO|ON|OFF)")
  set_property(CACHE ${option} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${${option}}" mode)
  if(NOT mode MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "deltasync: ${option}=${${option}}: must be AUTO, ON or OFF")
  endif()
  set_property(GLOBAL APPEND PROPERTY DELTASYNC_OPTIONAL_COMPONENTS ${X})
  set_property(GLOBAL PROPERTY DELTASYNC_OPTIONAL_${X}_DIR "${O_DIR}")
  set_property(GLOBAL PROPERTY DELTASYNC_OPTIONAL_${X}_WHAT "${O_WHAT}")

  set(enabled OFF)
  if(NOT EXISTS ${PROJECT_SOURCE_DIR}/${O_DIR}/CMakeLists.txt)
    if(mode STREQUAL "ON")
      message(FATAL_ERROR "deltasync: ${option}=ON but this source tree has no ${O_DIR} "
                          "(the ${O_WHAT} module)")
    endif()
    set(outcome "absent")
  elseif(mode STREQUAL "OFF")
    set(outcome "off")
  else()
    cmake_language(CALL ${O_PROBE} found)
    if(found)
      set(enabled ON)
      set(outcome "on")
    elseif(mode STREQUAL "ON")
      message(FATAL_ERROR "deltasync: ${option}=ON but ${O_WHAT} was not found")
    else()
      set(outcome "not found")
    endif()
  endif()
  set_property(GLOBAL PROPERTY DELTASYNC_OPTIONAL_${X}_OUTCOME "${outcome}")
  set(${option}_ENABLED ${enabled} PARENT_SCOPE)
endfunction()

# One line for the components: what became of each and why.
function(ds_optional_summary)
  get_property(components GLOBAL PROPERTY DELTASYNC_OPTIONAL_COMPONENTS)
  set(parts)
  foreach(X IN LISTS components)
    get_property(dir GLOBAL PROPERTY DELTASYNC_OPTIONAL_${X}_DIR)
    get_property(outcome GLOBAL PROPERTY DELTASYNC_OPTIONAL_${X}_OUTCOME)
    if(outcome STREQUAL "absent")
      list(APPEND parts "${X} (no ${dir} in this tree)")
    elseif(outcome STREQUAL "on")
      list(APPEND parts "${X} on (${dir})")
    elseif(outcome STREQUAL "off")
      list(APPEND parts "${X} off (DELTASYNC_WITH_${X}=OFF)")
    else()
      list(APPEND parts "${X} skipped (dependency not found)")
    endif()
  endforeach()
  list(JOIN parts ", " text)
  message(STATUS "deltasync: optional components: ${text}")
endfunction()

# Dependency probes, one per component.
# nvcc from PATH, $CUDACXX, or CUDA's default place; the host code needs
# the runtime library too.
macro(ds_probe_cuda out)
  include(CheckLanguage)
  if(NOT DEFINED ENV{CUDACXX} AND NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    find_program(ds_nvcc_on_path nvcc)
    if(NOT ds_nvcc_on_path)
      set(ENV{CUDACXX} /usr/local/cuda/bin/nvcc)
    endif()
  endif()
  check_language(CUDA)
  find_package(CUDAToolkit QUIET)
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND AND CUDA_cudart_LIBRARY)
    set(${out} ON)
  else()
    set(${out} OFF)
  endif()
endmacro()

# NCCL's unique id travels through Gloo's rendezvous stores, so the nccl
# communicator needs Gloo's headers and library as well (not the gloo
# communicator itself: DELTASYNC_WITH_GLOO may be OFF).
macro(ds_probe_nccl out)
  set(${out} OFF)
  find_package(CUDAToolkit QUIET)
  find_path(DS_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(DS_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  ds_probe_gloo(ds_nccl_gloo_found)
  if(CUDAToolkit_FOUND AND CUDA_cudart_LIBRARY AND DS_NCCL_INCLUDE_DIR AND DS_NCCL_LIBRARY
     AND ds_nccl_gloo_found)
    set(${out} ON)
  endif()
endmacro()

# hiredis is optional: Gloo's RedisStore needs it, a file rendezvous does not.
macro(ds_probe_gloo out)
  set(${out} OFF)
  find_path(DS_GLOO_INCLUDE_DIR gloo/context.h)
  find_library(DS_GLOO_LIBRARY gloo)
  find_path(DS_HIREDIS_INCLUDE_DIR hiredis/hiredis.h)
  find_library(DS_HIREDIS_LIBRARY hiredis)
  if(DS_GLOO_INCLUDE_DIR AND DS_GLOO_LIBRARY)
    set(${out} ON)
  endif()
endmacro()

# Debian's interpreter by default (its numpy and torch run the tests); pass
# -DPython3_EXECUTABLE=... to build for another (pip install does).
macro(ds_probe_python out)
  set(${out} OFF)
  if(NOT Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python3_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "The Python the bindings are built for")
  endif()
  find_package(Python3 COMPONENTS Interpreter Development QUIET)
  find_package(pybind11 CONFIG QUIET)
  if(Python3_FOUND AND pybind11_FOUND)
    set(${out} ON)
  endif()
endmacro()

# The components and the module each belongs to. NCCL and Gloo are the two
# communicators of one module, comm (CONTRIBUTING.md).
ds_optional(CUDA DIR src/cuda WHAT "CUDA kernels" PROBE ds_probe_cuda)
ds_optional(NCCL DIR src/comm WHAT "NCCL communicator (CUDA, NCCL and Gloo)" PROBE ds_probe_nccl)
ds_optional(GLOO DIR src/comm WHAT "Gloo communicator" PROBE ds_probe_gloo)
ds_optional(PYTHON DIR python WHAT "Python bindings (pybind11)" PROBE ds_probe_python)
