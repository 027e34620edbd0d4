#!/usr/bin/env bash
# Build the MaxText 0.2.5 virtualenv used for deviceless (AOT) TPU compiles: the CPU venv that MaxText's own
# setup_venv.sh made (../shared/maxtext/, outside this repository) plus libtpu matching jax 0.12.0.1 (jax[tpu] extra:
# libtpu==0.0.50.*).
# Usage: bench/maxtext/setup.sh            (idempotent; re-running only re-checks the imports)
# Env:   MAXTEXT_AOT [${TMPDIR:-/tmp}/maxtext-aot]  VENV [$MAXTEXT_AOT/venv]  PY312 [the project's scripts/find-python, else python3.12 on PATH]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MAXTEXT_AOT=${MAXTEXT_AOT:-${TMPDIR:-/tmp}/maxtext-aot}
VENV=${VENV:-$MAXTEXT_AOT/venv}
PY312=${PY312:-$(scripts/find-python 2>/dev/null || command -v python3.12)}  # run from the project root: its finder knows this machine
FREEZE=$HERE/requirements-cpu-freeze.txt
mkdir -p "$MAXTEXT_AOT"
if [[ ! -x $VENV/bin/python ]]; then
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
fi
if ! "$VENV/bin/python" -c 'import maxtext, libtpu' 2>/dev/null; then
  # 1) the exact CPU set that MaxText's setup_venv.sh produced (maxtext 0.2.5, jax/jaxlib 0.12.0.1, flax, ...)
  "$VENV/bin/pip" install -q -r "$FREEZE"
  # 2) libtpu for deviceless TPU topologies, as pinned by jax's own [tpu] extra (libtpu==0.0.50.*)
  "$VENV/bin/pip" install -q "jax[tpu]==0.12.0.1" "jaxlib==0.12.0.1"
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for p in ("maxtext", "jax", "jaxlib", "libtpu", "flax", "optax"):
    try: print(f"{p}=={md.version(p)}")
    except md.PackageNotFoundError: print(f"{p}: MISSING")
PY
