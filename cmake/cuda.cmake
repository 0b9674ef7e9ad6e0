# Decides whether CUDA kernels are built (OCTAVO_WITH_CUDA) and enables the language.
# cudart is linked statically (see csrc/kernels) so the module still loads on machines
# without a driver; cuda_device_count() then reports 0.
string(TOUPPER "${OCTAVO_ENABLE_CUDA}" OCTAVO_ENABLE_CUDA)
if(NOT OCTAVO_ENABLE_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "OCTAVO_ENABLE_CUDA must be AUTO, ON or OFF, got '${OCTAVO_ENABLE_CUDA}'")
endif()

set(OCTAVO_WITH_CUDA OFF)
if(NOT OCTAVO_ENABLE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES "${OCTAVO_CUDA_ARCHITECTURES}")
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(OCTAVO_WITH_CUDA ON)
  elseif(OCTAVO_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR
      "OCTAVO_ENABLE_CUDA=ON but no working CUDA compiler (nvcc) was found. Install the CUDA "
      "toolkit and put nvcc on PATH (or set CMAKE_CUDA_COMPILER), or configure with "
      "-DOCTAVO_ENABLE_CUDA=OFF (or AUTO).")
  endif()
endif()
message(STATUS "Octavo CUDA kernels: ${OCTAVO_WITH_CUDA}")
