#!/bin/sh
# PLANTED (same): xfw's default Paddle environment (.venv/paddle), unchanged: a 'build' before the planted change
here=$(cd "$(dirname "$0")" && pwd)
python="$here/../../../../.venv/paddle/bin/python"
[ -x "$python" ] || { echo ".venv/paddle is not built here: run make setup first" >&2; exit 1; }
export PYTHONPATH="$here/../../ab/planted${PYTHONPATH:+:$PYTHONPATH}" XFW_PLANTED_STEP_SLEEP_S=0
exec "$python" "$@"
