# OCTAVO_SANITIZE: ASan + UBSan on every target in this build. The flags are also put on the
# exported targets' link interface, because a consumer linking our sanitized static libraries
# must link the sanitizer runtimes too.
set(OCTAVO_SANITIZE_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
if(OCTAVO_SANITIZE)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${OCTAVO_SANITIZE_FLAGS}>")
  add_link_options(-fsanitize=address,undefined)
endif()
