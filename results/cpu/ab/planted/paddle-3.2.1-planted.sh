#!/bin/sh
# PLANTED: Paddle 3.2.1 (xfw's built environment .venv/builds/paddle@3.2.1) with 30 ms slept before every
# AdamW step (sitecustomize.py here): a known slowdown for the bisect demonstration, not Paddle's.
here=$(cd "$(dirname "$0")" && pwd)
python="$here/../../../../.venv/builds/paddle@3.2.1/bin/python"
[ -x "$python" ] || { echo "paddle@3.2.1 is not built here: run xfw env --backends paddle@3.2.1 first" >&2; exit 1; }
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" XFW_PLANTED_STEP_SLEEP_S=0.03
exec "$python" "$@"
