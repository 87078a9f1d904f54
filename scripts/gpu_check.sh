#!/usr/bin/env bash
# The GPU check on a lent CUDA machine, as it is (its own Python and torch): the wheels carried in
# .whl (docs/gpu_runbook.md says which) are installed first, then scripts/gpu_check.py runs with
# the arguments given (--out DIR at least).
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
exec python3 scripts/gpu_check.py "$@"
