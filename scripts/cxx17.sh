#!/usr/bin/env bash
# Compiler wrapper used while building Horovod from source.
# Horovod 0.28.1's CMake asks for C++14, but the headers of torch >= 2.1
# need C++17: rewrite the standard flag and hand everything else through.
args=()
for a in "$@"; do
  case "$a" in
    -std=c++14) args+=("-std=c++17") ;;
    -std=gnu++14) args+=("-std=gnu++17") ;;
    *) args+=("$a") ;;
  esac
done
exec "${HVD_ACP_REAL_CXX:-g++}" "${args[@]}"
