#!/usr/bin/env bash
# Downloads the wheels that `make gpu-check` needs on the GPU machine beyond what its image
# already has, for Python 3.12 on manylinux x86_64, into ./.whl (ignored by git).
#
# The GPU machine (Python 3.12, torch 2.11 + CUDA 13, transformers 5.17) has no network. Its
# image already holds everything the check imports: torch, transformers, accelerate,
# safetensors, tqdm, matplotlib, numpy, pytest, pytest-timeout, setuptools, wheel and ninja.
# So the list below is empty today; add a package here (NAME==VERSION) when the check starts
# to need one, and the check installs what lies in ./.whl before it runs.
#
# Transformer Engine is left out: its PyTorch extension (transformer_engine_torch) is
# published as a source distribution that compiles against the local torch and CUDA, not as
# a wheel, and its test needs two GPUs, where the machine has one.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=()

mkdir -p .whl
if [ ${#WHEELS[@]} -eq 0 ]; then
  echo "fetch_gpu_wheels: nothing to fetch; the GPU image has every package the check needs"
  exit 0
fi
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
