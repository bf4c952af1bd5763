#!/usr/bin/env bash
# Create .venv/jax (JAX, Flax NNX, optax on CPU + the bare xfw core + xfw_jax), and skip it when up to date.
# Its own script, with its own stamp (scripts/setup.sh's hash is part of the two other environments' stamps);
# it builds the environment the way setup.sh's make_env does, and setup.sh runs it beside those two.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/python.sh  # $PYTHON: which interpreter the environments are built from

dir=.venv/jax
stamp="$dir/.xfw-setup-stamp"
requirements=adapters/jax/requirements.txt
want=$( { cat "$requirements" pyproject.toml adapters/jax/pyproject.toml scripts/setup_jax.sh scripts/python.sh; \
         printf %s "$PYTHON"; } | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$dir/bin/python" -c "import xfw_jax" 2>/dev/null; then
  echo "==> .venv/jax is up to date"
  exit 0
fi
echo "==> creating .venv/jax (about 2 minutes on a fresh machine)"
rm -rf "$dir"
"$PYTHON" -m venv "$dir"
"$dir/bin/python" -m pip install --progress-bar off --upgrade pip 2>&1 | sed -u '/^Requirement already satisfied/d'
quiet_pip() { "$@" 2>&1 | sed -u '/is ignored: it is neither a file nor a directory/d; /^Requirement already satisfied/d'; }
quiet_pip "$dir/bin/python" -m pip install --progress-bar off -r "$requirements"
mkdir -p .venv  # the editable installs take turns with setup.sh's (they write this tree's egg-info)
(flock 9 && quiet_pip "$dir/bin/python" -m pip install --progress-bar off -e . -e adapters/jax) 9>.venv/.editable.lock
"$dir/bin/python" -c "import xfw_jax"
echo "$want" > "$stamp"
echo "==> .venv/jax ready"
