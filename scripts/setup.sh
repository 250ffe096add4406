#!/usr/bin/env bash
# Set up .venv with everything gpipe-plan needs; safe to run again (it only fills what is missing).
# Without an NVIDIA GPU it installs torch's CPU build first: a bare `torch` requirement would
# otherwise pull a CUDA build of several GB that such a machine cannot use.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
py=.venv/bin/python
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q "torch==2.13.0"
  else
    # The CPU wheels live on PyTorch's own index; where a local mirror or wheel cache already has
    # the CPU build, pip takes it from there and only warns that the extra index is unreachable.
    "$py" -m pip install -q "torch==2.13.0" numpy --extra-index-url https://download.pytorch.org/whl/cpu 2>&1 \
      | grep -v -e "Retrying" -e "is ignored: it is neither" >&2 || true
    "$py" -c "import torch" || { echo "setup.sh: torch did not install" >&2; exit 1; }
  fi
fi
"$py" -m pip install -q -e ".[test,plot]" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
"$py" -c "import cli, torch, ortools, pydantic" || { echo "setup.sh: install incomplete" >&2; exit 1; }
# Our own modules' bytecode, written once: where the environment turns bytecode writing off
# (PYTHONDONTWRITEBYTECODE), every command would otherwise compile them afresh (0.1 s a run).
# Python still checks each file's date, so an edited module is compiled again, in memory.
"$py" -m compileall -q cli.py planner profiler schedules codegen >/dev/null
