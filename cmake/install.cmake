# Install + export of the C++ package (octavo::core, octavo::kernels). In a wheel build
# (SKBUILD) everything goes under the octavo/ Python package, so `octavo.cmake_dir()` can point
# a consumer at it; otherwise the usual GNU layout under CMAKE_INSTALL_PREFIX.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

if(SKBUILD)
  set(OCTAVO_INSTALL_LIBDIR octavo/lib)
  set(OCTAVO_INSTALL_INCLUDEDIR octavo/include)
else()
  set(OCTAVO_INSTALL_LIBDIR ${CMAKE_INSTALL_LIBDIR})
  set(OCTAVO_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR})
endif()
set(OCTAVO_INSTALL_CMAKEDIR ${OCTAVO_INSTALL_LIBDIR}/cmake/octavo)

install(TARGETS octavo_core octavo_kernels EXPORT octavoTargets
  ARCHIVE DESTINATION ${OCTAVO_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${OCTAVO_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${OCTAVO_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ DESTINATION ${OCTAVO_INSTALL_INCLUDEDIR})
install(EXPORT octavoTargets NAMESPACE octavo:: DESTINATION ${OCTAVO_INSTALL_CMAKEDIR})

# Recorded so the installed config can find the same CUDA toolkit for cudart_static.
set(OCTAVO_CUDA_TOOLKIT_ROOT "")
if(OCTAVO_WITH_CUDA)
  get_filename_component(OCTAVO_CUDA_TOOLKIT_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/octavoConfig.cmake.in
  ${PROJECT_BINARY_DIR}/octavoConfig.cmake INSTALL_DESTINATION ${OCTAVO_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/octavoConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/octavoConfig.cmake ${PROJECT_BINARY_DIR}/octavoConfigVersion.cmake
  DESTINATION ${OCTAVO_INSTALL_CMAKEDIR})

# The extension module only makes sense inside the wheel, next to python/octavo/*.py.
if(SKBUILD AND TARGET _C)
  install(TARGETS _C LIBRARY DESTINATION octavo)
endif()
