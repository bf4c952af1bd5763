#!/bin/sh
# Build b3 of a planted series over .venv/torch (results/cpu/decisions/README.md): PLANTED: 10 ms slept before every AdamW step (sitecustomize.py here).
here=$(cd "$(dirname "$0")" && pwd)
python="$here/../../../../.venv/torch/bin/python"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" XFW_PLANTED_STEP_SLEEP_S=0.01
exec "$python" "$@"
