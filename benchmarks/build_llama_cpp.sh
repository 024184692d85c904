#!/usr/bin/env bash
# llama.cpp's own binaries as a benchmark peer: llama-server, llama-bench and llama-quantize,
# built from the llama.cpp source that llama-cpp-python's sdist vendors, so that every
# comparison names one llama.cpp version, and llama-window-ppl (benchmarks/llama_window_ppl.c,
# linked against the libraries of that build). Nothing is installed: the binaries land in
# build/llama.cpp/bin (git ignores build/), where benchmarks/llama_cpp_peer.py looks for them.
#
#   bash benchmarks/build_llama_cpp.sh            # about 10 minutes on 2 cores
#   LLAMA_CPP_PYTHON=0.3.36 OUT=/elsewhere bash benchmarks/build_llama_cpp.sh
#
# CPU flags: a portable build (GGML_NATIVE=OFF) with AVX2, or AVX-512 (F, VBMI, VNNI, BF16)
# where /proc/cpuinfo has it, and ggml's AMX path left out: on the Intel Xeons these sessions
# get, llama.cpp built with AMX segfaults on quantized models. No web UI download, no curl,
# no OpenSSL: the build never reaches the network after pip has fetched the sdist.
set -euo pipefail

version="${LLAMA_CPP_PYTHON:-0.3.36}"
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$root/build/llama.cpp}"
python="${PYTHON:-$root/.venv/bin/python}"
jobs="${JOBS:-$(nproc)}"

mkdir -p "$out/src"
sdist="$out/src/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    "$python" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$out/src"
fi
src="$out/src/llama_cpp_python-$version/vendor/llama.cpp"
[ -d "$src" ] || tar -xzf "$sdist" -C "$out/src"

simd=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if grep -qw avx512f /proc/cpuinfo; then
    simd+=(-DGGML_AVX512=ON)
    for feature in avx512vbmi:VBMI avx512_vnni:VNNI avx512_bf16:BF16; do
        grep -qw "${feature%%:*}" /proc/cpuinfo && simd+=("-DGGML_AVX512_${feature##*:}=ON")
    done
fi

cmake -S "$src" -B "$out/cmake" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF "${simd[@]}" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON
cmake --build "$out/cmake" -j "$jobs" --target llama-server llama-bench llama-quantize

mkdir -p "$out/bin"
for binary in llama-server llama-bench llama-quantize; do
    cp "$out/cmake/bin/$binary" "$out/bin/$binary"
done
# llama.cpp's C API on token windows (quantization.py's "llama.cpp ppl"), against the static
# libraries the targets above built
"${CXX:-c++}" -O2 -x c "$root/benchmarks/llama_window_ppl.c" -x none \
    -I"$src/include" -I"$src/ggml/include" "$out/cmake/src/libllama.a" \
    "$out/cmake/ggml/src/libggml.a" "$out/cmake/ggml/src/libggml-cpu.a" \
    "$out/cmake/ggml/src/libggml-base.a" -fopenmp -lpthread -lm -o "$out/bin/llama-window-ppl"
echo "$version" > "$out/bin/VERSION"
"$out/bin/llama-server" --version 2>&1 | head -n 2
echo "llama.cpp binaries in $out/bin"
