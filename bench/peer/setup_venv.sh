#!/usr/bin/env bash
# Creates the benchmark-only Python peer venv (torch, torchft 0.2.0 and numpy from PyPI) used by
# bench/peer/torch_gloo_allreduce.py, torch_data_parallel.py, torchft_local_sgd.py and (its
# LibTorch) overhead.sh, data_parallel.sh and local_sgd.sh. Not a dependency of fedshard; CI
# never runs it.
# Idempotent: an existing venv is reused and pip runs only if one of the imports fails there.
#
# Usage: bench/peer/setup_venv.sh        (venv at ${FEDSHARD_PEER_VENV:-/opt/peer-venv})
set -euo pipefail

venv=${FEDSHARD_PEER_VENV:-/opt/peer-venv}

if [[ -x "$venv/bin/python" ]]; then
  echo "setup_venv: venv exists at $venv"
else
  echo "setup_venv: creating venv at $venv"
  python3 -m venv "$venv"
fi

if "$venv/bin/python" -c 'import torch, numpy, torchft' 2>/dev/null; then
  echo "setup_venv: torch, numpy and torchft already importable, nothing to install"
else
  # Plain PyPI wheels; torch's CPU side is all the peer uses.
  echo "setup_venv: installing torch, numpy and torchft from PyPI into $venv"
  "$venv/bin/python" -m pip install --upgrade pip
  "$venv/bin/python" -m pip install torch numpy torchft==0.2.0
fi
"$venv/bin/python" -c 'import torch, numpy; print("setup_venv: torch", torch.__version__, "numpy", numpy.__version__)'
"$venv/bin/python" -c 'import importlib.metadata as m; print("setup_venv: torchft", m.version("torchft"))'
