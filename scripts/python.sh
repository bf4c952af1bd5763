# Sourced by scripts/setup.sh and scripts/setup_jax.sh: the interpreter the environments are built from, $PYTHON.
# XFW_PYTHON when set; else the distribution's own /usr/bin/python3.11 when it has one with venv; else python3.11
# on PATH; else python3. The distribution's first: Debian links its python3.11 executable with libpython
# statically, where pyenv's default build (the python3.11 on PATH of this project's machines) calls it through
# a shared library (--enable-shared). Importing torch and transformers took 14% less CPU with Debian's 3.11.2 than with pyenv's
# 3.11.7 on the same site-packages (5.19 s against 6.03 s user, five runs each alternated, 2026-11-29), and the
# frameworks' start is most of a tiny CPU run.
if [ -n "${XFW_PYTHON:-}" ]; then
  PYTHON=$XFW_PYTHON
elif [ -x /usr/bin/python3.11 ] && /usr/bin/python3.11 -c "import venv, ensurepip" 2>/dev/null; then
  PYTHON=/usr/bin/python3.11
elif command -v python3.11 >/dev/null 2>&1; then
  PYTHON=python3.11
else
  PYTHON=python3
fi
