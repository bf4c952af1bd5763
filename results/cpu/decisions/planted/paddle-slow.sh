#!/bin/sh
# PLANTED (slow): xfw's default Paddle environment (.venv/paddle) with 30 ms slept before every AdamW
# step (results/cpu/ab/planted/sitecustomize.py): a known slowdown for the decision-power runs, not Paddle's
here=$(cd "$(dirname "$0")" && pwd)
python="$here/../../../../.venv/paddle/bin/python"
[ -x "$python" ] || { echo ".venv/paddle is not built here: run make setup first" >&2; exit 1; }
export PYTHONPATH="$here/../../ab/planted${PYTHONPATH:+:$PYTHONPATH}" XFW_PLANTED_STEP_SLEEP_S=0.03
exec "$python" "$@"
