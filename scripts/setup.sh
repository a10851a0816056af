#!/usr/bin/env bash
# spdkfac environment installer (idempotent; safe to re-run).
#
#   bash scripts/setup.sh [--check] [--rebuild-horovod] [--with-mpi] [--without-horovod]
#
# Steps:
#   1. create/reuse the virtualenv <repo>/.venv and upgrade pip/setuptools/wheel
#   2. install torch==2.13.0 and the Python dependencies
#   3. build + install Horovod 0.28.1 (PyTorch + Gloo) unless `import horovod.torch`
#      already works in the venv against the installed torch
#   4. `pip install -e` the project itself (when setup.py exists)
#   5. verify `import horovod.torch`; with --check also run a 2-process
#      horovodrun smoke test (scripts/check_horovod.py)
#   --without-horovod skips steps 3 and 5: torchrun (torch.distributed) and
#      single-process runs need no Horovod (the test suite does)
#   opt-in (--with-mpi; runs after step 3, so this run's Horovod build stays Gloo-only):
#      Open MPI via apt-get when `mpirun` is missing, and mpi4py into the venv,
#      for `python -m spdkfac.perfmodels benchmark --engine mpi4py`
#
# Environment knobs:
#   PYTHON              interpreter used to create the venv (default: python3)
#   SPDKFAC_CACHE_DIR   where built Horovod wheels are cached between fresh
#                       clones (default: ${XDG_CACHE_HOME:-$HOME/.cache}/spdkfac)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
VENV="$REPO_ROOT/.venv"
VPY="$VENV/bin/python"
BUILD_LOG="$VENV/horovod-build.log"

TORCH_VERSION="2.13.0"
HOROVOD_VERSION="0.28.1"
# Horovod's runner (horovodrun) needs cloudpickle, psutil, pyyaml, packaging.
HEAVYBALL="heavyball==3.2.1"
PY_DEPS=(numpy scikit-learn matplotlib pillow pytest pytest-xdist ruff mypy packaging cloudpickle psutil pyyaml mlxtend)
# Bump when the patch/build recipe below changes, to invalidate cached wheels.
RECIPE_REV="1"

DO_CHECK=0
FORCE_HOROVOD=0
WITH_MPI=0
WITHOUT_HOROVOD=0

log()  { printf '[setup] %s\n' "$*"; }
warn() { printf '[setup] WARNING: %s\n' "$*" >&2; }
die()  { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

usage() {
    cat <<EOF
Usage: bash scripts/setup.sh [--check] [--rebuild-horovod] [--with-mpi] [--without-horovod]

  --check            after installing, run a real 2-process horovodrun (gloo)
                     smoke test: scripts/check_horovod.py
  --rebuild-horovod  rebuild Horovod from source even if it already imports
                     (ignores and refreshes the cached wheel)
  --with-mpi         also install Open MPI (apt-get install openmpi-bin
                     libopenmpi-dev, only if mpirun is missing) and mpi4py
                     (for the perfmodels benchmark's --engine mpi4py; the
                     optimizer never needs them)
  --without-horovod  do not build or check Horovod (enough for torchrun and
                     single-process runs; the test suite needs Horovod)
  -h, --help         show this help
EOF
}

for arg in "$@"; do
    case "$arg" in
        --check) DO_CHECK=1 ;;
        --rebuild-horovod) FORCE_HOROVOD=1 ;;
        --with-mpi) WITH_MPI=1 ;;
        --without-horovod) WITHOUT_HOROVOD=1 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $arg" ;;
    esac
done

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_PROGRESS_BAR=off
NPROC="$(nproc 2>/dev/null || echo 2)"
T_START=$SECONDS

vpip() { "$VPY" -m pip "$@"; }

# --------------------------------------------------------------------------
# 1. virtualenv
# --------------------------------------------------------------------------
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || die "'$PYTHON' not found; install Python 3 (with the venv module)"

if [[ -x "$VPY" ]] && "$VPY" -c 'import sys, pip' >/dev/null 2>&1; then
    log "reusing virtualenv $VENV ($("$VPY" -V 2>&1))"
else
    if [[ -e "$VENV" ]]; then
        log "virtualenv $VENV exists but is broken; recreating it"
        "$PYTHON" -m venv --clear "$VENV"
    else
        log "creating virtualenv $VENV with $("$PYTHON" -V 2>&1)"
        "$PYTHON" -m venv "$VENV"
    fi
fi
log "upgrading pip, setuptools, wheel"
vpip install --upgrade pip setuptools wheel

# --------------------------------------------------------------------------
# 2. torch + Python dependencies
# --------------------------------------------------------------------------
log "installing torch==$TORCH_VERSION"
vpip install "torch==$TORCH_VERSION"
log "installing Python dependencies: ${PY_DEPS[*]}"
vpip install "${PY_DEPS[@]}"
# HeavyBall: SOAP and Muon for the convergence benchmark (optional there; its tests use it). Pure Python, 80 kB;
# --no-deps because its only run-time needs are torch and numpy (opt-einsum is imported only by a helper not used here).
log "installing $HEAVYBALL (benchmark comparison optimizers, --no-deps)"
vpip install --no-deps "$HEAVYBALL"

TORCH_FULL_VERSION="$("$VPY" -c 'import torch; print(torch.__version__)')"
log "torch $TORCH_FULL_VERSION installed"

# --------------------------------------------------------------------------
# 3. Horovod
# --------------------------------------------------------------------------
# Prints "ok" when horovod.torch imports, has Gloo, and was built against the
# torch that is installed now; otherwise a reason.
horovod_status() {
    "$VPY" - <<'PY' 2>/dev/null || echo "import of horovod.torch failed"
import json, os
import torch
import horovod
import horovod.torch as hvd
if not hvd.gloo_built():
    print("horovod was built without Gloo")
    raise SystemExit(0)
built_for = None
try:
    with open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")) as f:
        built_for = json.load(f).get("pytorch")
except Exception:
    pass
if built_for is not None and built_for != torch.__version__:
    print(f"horovod was built against torch {built_for}, installed torch is {torch.__version__}")
else:
    print("ok")
PY
}

build_horovod() {
    local tmp src std variant key cache_dir wheel status=""
    local -a cmake_files

    # --- pick build options --------------------------------------------------
    std="$("$VPY" - <<'PY'
import torch
from packaging.version import Version
print(20 if Version(torch.__version__).release >= (2, 15) else 17)
PY
)"

    unset HOROVOD_GPU HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER \
          HOROVOD_GPU_BROADCAST HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER \
          HOROVOD_WITHOUT_GLOO HOROVOD_WITHOUT_PYTORCH HOROVOD_WITH_MPI HOROVOD_WITHOUT_MPI || true
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    export HOROVOD_CPU_OPERATIONS=gloo
    export MAKEFLAGS="${MAKEFLAGS:--j$NPROC}"   # parallel make (an explicit MAKEFLAGS wins)
    variant="gloo"

    # MPI only on request, so that the default build is the same on every machine
    # (and CI reuses one cached wheel whether or not an MPI happens to be installed).
    if (( WITH_MPI )) && command -v mpicxx >/dev/null 2>&1; then
        export HOROVOD_WITH_MPI=1
        variant+="-mpi"
        log "--with-mpi and mpicxx found ($(command -v mpicxx)): building with MPI support"
    else
        export HOROVOD_WITHOUT_MPI=1
        log "building without MPI (Gloo only; --with-mpi on a machine with mpicxx adds MPI)"
    fi

    local use_cuda=0
    if command -v nvcc >/dev/null 2>&1; then
        if "$VPY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
            use_cuda=1
        else
            log "nvcc found but torch.cuda.is_available() is False: CPU-only build"
        fi
    else
        log "no nvcc on PATH: CPU-only build"
    fi
    if (( use_cuda )); then
        export HOROVOD_GPU_OPERATIONS=NCCL
        variant+="-nccl"
        local cuda_home nccl_home=""
        cuda_home="$("$VPY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")' 2>/dev/null || true)"
        if [[ -n "$cuda_home" && -x "$cuda_home/bin/nvcc" ]]; then
            export HOROVOD_CUDA_HOME="$cuda_home"
        fi
        # NCCL: explicit env, then the CUDA toolkit, system dirs, then the
        # nvidia-nccl-cu* wheel that CUDA builds of torch pull in.
        local cand
        for cand in "${HOROVOD_NCCL_HOME:-}" "${NCCL_HOME:-}" "${cuda_home:-}" /usr/local/nccl /usr/local/cuda /usr \
                    $("$VPY" -c 'import os, nvidia.nccl as m; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])' 2>/dev/null || true); do
            if [[ -n "$cand" && -f "$cand/include/nccl.h" ]]; then
                nccl_home="$cand"
                break
            fi
        done
        if [[ -n "$nccl_home" ]]; then
            export HOROVOD_NCCL_HOME="$nccl_home"
            if ! ls "$nccl_home"/lib*/libnccl_static.a >/dev/null 2>&1; then
                export HOROVOD_NCCL_LINK=SHARED
            fi
            log "CUDA build: HOROVOD_GPU_OPERATIONS=NCCL, HOROVOD_NCCL_HOME=$nccl_home"
        else
            log "CUDA build: HOROVOD_GPU_OPERATIONS=NCCL (NCCL location not found; leaving it to CMake)"
        fi
    fi

    local pytag
    pytag="$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
    key="horovod-${HOROVOD_VERSION}_torch-${TORCH_FULL_VERSION}_${pytag}_cxx${std}_${variant}_r${RECIPE_REV}"
    cache_dir="${SPDKFAC_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/spdkfac}/wheels/$key"

    # --- reuse a wheel built earlier (e.g. by a previous fresh clone) --------
    if (( ! FORCE_HOROVOD )); then
        wheel="$(ls "$cache_dir"/horovod-*.whl 2>/dev/null | head -n 1 || true)"
        if [[ -n "$wheel" ]]; then
            log "installing cached Horovod wheel $wheel"
            if vpip install --force-reinstall --no-deps "$wheel" && status="$(horovod_status)" && [[ "$status" == ok ]]; then
                log "cached Horovod wheel works; skipping the build"
                return 0
            fi
            warn "cached wheel unusable ($status); rebuilding"
            rm -rf "$cache_dir"
        fi
    fi

    # --- preflight: toolchain ---------------------------------------------------
    local missing=()
    command -v g++ >/dev/null 2>&1 || missing+=(g++)
    command -v make >/dev/null 2>&1 || missing+=(make)
    if ((${#missing[@]})); then
        if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
            log "installing missing build tools (${missing[*]}) with apt-get"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential
        else
            die "missing build tools: ${missing[*]} (install a C++ compiler and make, e.g. 'apt-get install build-essential')"
        fi
    fi
    if ! command -v cmake >/dev/null 2>&1 || \
       ! "$VPY" -c 'import re, subprocess, sys; v = re.search(r"(\d+)\.(\d+)", subprocess.check_output(["cmake", "--version"], text=True)); sys.exit(0 if (int(v[1]), int(v[2])) >= (3, 13) else 1)'; then
        log "no cmake >= 3.13 on PATH: installing the cmake wheel into the venv"
        vpip install 'cmake>=3.13,<4'
    fi
    "$VPY" -c 'import os, sys, sysconfig; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)' \
        || die "Python.h not found for $("$VPY" -V 2>&1); install the Python development headers (e.g. python3-dev)"

    # --- fetch + patch the sdist ----------------------------------------------
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/spdkfac-horovod.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT

    log "downloading the Horovod $HOROVOD_VERSION source distribution"
    vpip download --no-deps --no-binary :all: --dest "$tmp" "horovod==$HOROVOD_VERSION" \
        || die "could not download horovod==$HOROVOD_VERSION from the package index"
    tar -xzf "$tmp"/horovod-"$HOROVOD_VERSION".tar.gz -C "$tmp"
    src="$tmp/horovod-$HOROVOD_VERSION"
    [[ -f "$src/setup.py" ]] || die "unexpected sdist layout in $tmp"

    log "patching Horovod CMake files: C++14 -> C++$std (torch $TORCH_FULL_VERSION headers need it)"
    mapfile -t cmake_files < <(cd "$src" && find . -path ./third_party -prune -o \
        \( -name CMakeLists.txt -o -name '*.cmake' \) -type f -print)
    (cd "$src" && sed -i -E \
        -e "s/(CMAKE_CXX_STANDARD[[:space:]]+)14\b/\1$std/g" \
        -e "s/-std=(c|gnu)\+\+14\b/-std=\1++$std/g" \
        "${cmake_files[@]}")
    if grep -nE 'CMAKE_CXX_STANDARD[[:space:]]+14|-std=(c|gnu)\+\+14' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; then
        die "failed to patch the C++ standard in Horovod's CMakeLists"
    fi
    grep -q "CMAKE_CXX_STANDARD $std" "$src/horovod/torch/CMakeLists.txt" \
        || die "horovod/torch/CMakeLists.txt no longer sets CMAKE_CXX_STANDARD; patch recipe is out of date"

    # distutils is deprecated (gone in Python 3.12): use sysconfig instead.
    sed -i 's/from distutils.sysconfig import get_python_inc; print(get_python_inc())/import sysconfig; print(sysconfig.get_paths()[\x27include\x27])/' \
        "$src/horovod/torch/CMakeLists.txt"

    if (( use_cuda )); then
        # nvcc from CUDA 12.x/13.x no longer accepts -std=c++11 for host code.
        sed -i -E 's/(CMAKE_CUDA_STANDARD[[:space:]]+)11\b/\117/' "$src/horovod/common/ops/cuda/CMakeLists.txt"
    else
        # CPU-only: Horovod's top-level CMakeLists enables the CUDA language
        # whenever it sees nvcc (even with no GPU build requested); skip that.
        "$VPY" - "$src/CMakeLists.txt" <<'PY' || warn "could not disable CUDA probing in CMakeLists.txt (continuing)"
import sys
path = sys.argv[1]
text = open(path).read()
start = text.find("include(CheckLanguage)\n")
end_marker = "    enable_language(CUDA)\nendif()\n"
end = text.find(end_marker, start)
if start < 0 or end < 0:
    sys.exit(1)
text = (text[:start] + "# [spdkfac setup.sh] CPU-only build: CUDA language probing removed\n"
        + text[end + len(end_marker):])
open(path, "w").write(text)
PY
    fi

    # --- build -------------------------------------------------------------------
    log "building Horovod $HOROVOD_VERSION (torch $TORCH_FULL_VERSION, C++$std, $variant, MAKEFLAGS=$MAKEFLAGS);"
    log "this takes several minutes; full log: $BUILD_LOG"
    local t0=$SECONDS
    mkdir -p "$tmp/wheelhouse"
    {
        echo "# Horovod $HOROVOD_VERSION build, $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
        env | grep -E '^(HOROVOD_|MAKEFLAGS=)' | sort
        echo "# C++ standard: $std; torch $TORCH_FULL_VERSION; $("$VPY" -V 2>&1)"
    } >"$BUILD_LOG"
    if ! PATH="$VENV/bin:$PATH" vpip wheel -v --no-deps --no-build-isolation \
            --wheel-dir "$tmp/wheelhouse" "$src" >>"$BUILD_LOG" 2>&1; then
        echo "----- first error lines in $BUILD_LOG -----" >&2
        grep -n -m 15 -E 'CMake Error|fatal error|error:|Error [0-9]+' "$BUILD_LOG" >&2 || true
        echo "----- last 60 lines of $BUILD_LOG -----" >&2
        tail -n 60 "$BUILD_LOG" >&2
        echo "----------------------------------------" >&2
        cat >&2 <<EOF
[setup] ERROR: building Horovod $HOROVOD_VERSION failed (full log: $BUILD_LOG).
[setup] Horovod is compiled from source against the installed torch ($TORCH_FULL_VERSION).
[setup] Common causes:
[setup]   - C++ standard mismatch: torch >= 2.13 headers need C++17 (>= 2.15: C++20);
[setup]     this script patched Horovod's CMakeLists to C++$std.
[setup]   - missing toolchain pieces: g++ (>= 9), make, cmake >= 3.13, Python headers.
[setup]   - out of memory while compiling: lower the parallelism, e.g. MAKEFLAGS=-j1.
[setup]   - a newer torch than this script knows: check the C++ standard it needs.
[setup] Fix the cause and re-run: bash scripts/setup.sh  (add --rebuild-horovod to force a rebuild)
EOF
        exit 1
    fi
    log "Horovod build finished in $((SECONDS - t0)) s"

    wheel="$(ls "$tmp"/wheelhouse/horovod-*.whl | head -n 1)"
    log "installing $(basename "$wheel")"
    vpip install --force-reinstall --no-deps "$wheel" >>"$BUILD_LOG" 2>&1 \
        || { tail -n 20 "$BUILD_LOG" >&2; die "installing the built Horovod wheel failed"; }
    vpip install cloudpickle psutil pyyaml packaging >/dev/null   # runtime deps (no-op if present)

    if mkdir -p "$cache_dir" 2>/dev/null && cp "$wheel" "$cache_dir/.tmp.whl" 2>/dev/null; then
        rm -f "$cache_dir"/horovod-*.whl
        mv "$cache_dir/.tmp.whl" "$cache_dir/$(basename "$wheel")"
        log "cached the wheel in $cache_dir"
    else
        warn "could not cache the Horovod wheel in $cache_dir (continuing)"
    fi
    rm -rf "$tmp"
    trap - EXIT
}

hvd_state="$(horovod_status)"
if (( WITHOUT_HOROVOD )); then
    (( ! FORCE_HOROVOD && ! DO_CHECK )) || die "--without-horovod cannot be combined with --rebuild-horovod or --check"
    log "--without-horovod: not building Horovod (launch with torchrun, or run a single process)"
elif (( FORCE_HOROVOD )); then
    log "--rebuild-horovod given: rebuilding Horovod $HOROVOD_VERSION"
    build_horovod
elif [[ "$hvd_state" == ok ]]; then
    log "horovod.torch already imports in the venv ($("$VPY" -c 'import horovod; print(horovod.__version__)')); skipping the Horovod build"
else
    log "Horovod needs installing: $hvd_state"
    build_horovod
fi

# --------------------------------------------------------------------------
# 3b. optional: Open MPI + mpi4py (--with-mpi)
# --------------------------------------------------------------------------
if (( WITH_MPI )); then
    if command -v mpirun >/dev/null 2>&1; then
        log "--with-mpi: mpirun found ($(command -v mpirun)); not installing Open MPI"
    elif [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "--with-mpi: mpirun not found; running: apt-get update && apt-get install -y openmpi-bin libopenmpi-dev"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev
        command -v mpirun >/dev/null 2>&1 || die "--with-mpi: mpirun still not on PATH after installing openmpi-bin"
    else
        die "--with-mpi: mpirun not found and apt-get cannot be used here (needs root and apt-get); install an MPI, e.g. 'apt-get install openmpi-bin libopenmpi-dev', and re-run"
    fi
    log "--with-mpi: installing mpi4py into the venv"
    vpip install mpi4py
    "$VPY" -c 'from mpi4py import MPI; print("[setup] mpi4py", __import__("mpi4py").__version__, "|", MPI.Get_library_version().splitlines()[0].strip())' \
        || die "--with-mpi: 'from mpi4py import MPI' failed after installation"
fi

# --------------------------------------------------------------------------
# 4. the project itself
# --------------------------------------------------------------------------
if [[ -f "$REPO_ROOT/setup.py" ]]; then
    log "installing spdkfac in editable mode (pip install -e, --no-deps)"
    vpip install --no-deps --no-build-isolation -e "$REPO_ROOT"
else
    log "no setup.py at $REPO_ROOT yet; skipping the editable install"
fi

# --------------------------------------------------------------------------
# 5. verification
# --------------------------------------------------------------------------
if (( WITHOUT_HOROVOD )); then
    log "done in $(( SECONDS - T_START )) s (without Horovod)"
    exit 0
fi
log "verifying: import horovod.torch"
"$VPY" -c "import horovod.torch as hvd; import horovod, torch; print('[setup] horovod', horovod.__version__, '| torch', torch.__version__, '| gloo built:', hvd.gloo_built(), '| mpi built:', hvd.mpi_built(), '| nccl built:', bool(hvd.nccl_built()))" \
    || die "import horovod.torch failed after installation"
state="$(horovod_status)"
[[ "$state" == ok ]] || die "horovod is installed but not usable: $state (re-run with --rebuild-horovod)"

if (( DO_CHECK )); then
    log "running the 2-process horovodrun (gloo) check: scripts/check_horovod.py"
    (
        cd "$REPO_ROOT"
        export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"
        timeout 300 "$VENV/bin/horovodrun" -np 2 --gloo -H localhost:2 \
            "$VPY" "$SCRIPT_DIR/check_horovod.py" </dev/null
    ) || die "the horovodrun check failed (see output above)"
    log "horovodrun check passed"
fi

log "done in $((SECONDS - T_START)) s; activate with: source .venv/bin/activate"
