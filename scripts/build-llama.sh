#!/bin/sh
# Build and install the pinned llama-cpp-python (patches/PIN) from its source release with
# specrun's patches to the llama.cpp it vendors (patches/series, in order: row-exact batched
# kernels, docs/build.md), using $CMAKE_ARGS (-DGGML_LLAMAFILE=ON added unless it names
# LLAMAFILE: patches/ leave llamafile's sgemm only a prompt's batches, longer than any verify pass).
# Usage: [CMAKE_ARGS=...] scripts/build-llama.sh PYTHON
set -eu
PY=${1:?usage: scripts/build-llama.sh PYTHON}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/patches.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM
"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$PIN" -d "$tmp"
tar xzf "$tmp/llama_cpp_python-$PIN.tar.gz" -C "$tmp"
for p in $SERIES; do
  echo "applying $p"
  (cd "$tmp/llama_cpp_python-$PIN" && git apply -p1 "$ROOT/patches/$p")
done
# sgemm on a prompt's batches only; verify passes and single rows run the same kernels
# (docs/build.md): unless told otherwise.
case "${CMAKE_ARGS:-}" in
  *GGML_LLAMAFILE*) ;;
  *) CMAKE_ARGS="-DGGML_LLAMAFILE=ON ${CMAKE_ARGS:-}" ;;
esac
echo "CMAKE_ARGS=$CMAKE_ARGS"
CMAKE_ARGS="$CMAKE_ARGS" "$PY" -m pip install --quiet --force-reinstall --no-cache-dir --no-deps \
  "$tmp/llama_cpp_python-$PIN"
