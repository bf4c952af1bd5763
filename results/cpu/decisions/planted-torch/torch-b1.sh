#!/bin/sh
# Build b1 of a planted series over .venv/torch (results/cpu/decisions/README.md): no plant: the same interpreter, unchanged.
here=$(cd "$(dirname "$0")" && pwd)
python="$here/../../../../.venv/torch/bin/python"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" XFW_PLANTED_STEP_SLEEP_S=0
exec "$python" "$@"
