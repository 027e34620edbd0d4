#!/usr/bin/env bash
# One row through axgen: `axgen aot SPEC --target TARGET --json` (deviceless compile of the emitted train step for
# the target's chips via libtpu's topology description), printing axgen's own plan for the row and its peak per chip.
#
# Usage: run_axgen.sh MODEL TARGET          e.g.  run_axgen.sh llama2-7b tpu-v5e-256
#   MODEL: llama2-7b | llama3-8b | mixtral-8x7b (-> axgen/specs/<model with _>.py), or a spec file
#          (bench/maxtext/specs/llama3_1_8b_128k.py: the long-context rows); TARGET: tpu-v5e-256, tpu-v5e-256x2, ...
# Env: AXGEN_ROOT [the current directory: run from the project root] (checkout with .venv/bin/axgen; nothing is written there)
#      WORK [${TMPDIR:-/tmp}/maxtext-aot]  (logs go to $WORK/logs/axgen_<model>_<target>.{json,log})
#      TIMEOUT [1800] seconds for the compile
# Output, last lines:
#   AXGEN_PLAN seq=<L> per_device_batch=<b> grad_accum=<n> remat=<policy> mesh=<..> compute=bfloat16 params=float32
#   AXGEN_PEAK_GIB=<peak per chip: arguments + outputs - aliased + temporaries, GiB; host-offloaded bytes excluded>
#   AXGEN_COLLECTIVE_GIB=<collective bytes per chip per step, by kind: axgen aot's, counted by axgen.analysis.hlo_cost
#                     as collectives.py counts MaxText's>
set -euo pipefail
MODEL=${1:?model, e.g. llama2-7b}; TARGET=${2:?target, e.g. tpu-v5e-256}
AXGEN_ROOT=${AXGEN_ROOT:-$PWD}
WORK=${WORK:-${TMPDIR:-/tmp}/maxtext-aot}; mkdir -p "$WORK/logs"
TIMEOUT=${TIMEOUT:-1800}
if [[ $MODEL == *.py ]]; then SPEC=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL"); MODEL=$(basename "$MODEL" .py)
else SPEC=$AXGEN_ROOT/axgen/specs/${MODEL//-/_}.py; fi
PY=$AXGEN_ROOT/.venv/bin/python
[[ -f $SPEC ]] || { echo "no spec $SPEC" >&2; exit 2; }
[[ -x $AXGEN_ROOT/.venv/bin/axgen ]] || { echo "no $AXGEN_ROOT/.venv/bin/axgen (build the project venv first)" >&2; exit 2; }
TAG=${MODEL}_${TARGET}
# axgen's plan for the row: what the MaxText side has to match (the spec's remat feature wins over the rule's).
cd "$WORK"
"$PY" - "$SPEC" "$TARGET" <<'PY'
import sys
from axgen.backends import plan_for
from axgen.loader import load_spec
spec = load_spec(sys.argv[1]); plan = plan_for(spec, sys.argv[2])
remat = spec.feature("remat") or plan.remat
mesh = ",".join(f"{a}={n}" for a, n in plan.mesh if n > 1)
print(f"AXGEN_PLAN seq={spec.train.seq_len} per_device_batch={plan.microbatch} grad_accum={plan.grad_accum_steps} "
      f"remat={remat.policy if remat else 'none'} mesh={mesh} slices={plan.num_slices} compute={plan.compute_dtype} "
      f"params=float32 attention={plan.attention}/{plan.attention_block} global_batch={spec.train.global_batch}")
PY
set +e
timeout "$TIMEOUT" "$AXGEN_ROOT/.venv/bin/axgen" aot "$SPEC" --target "$TARGET" --json --timeout "$TIMEOUT" \
  > "$WORK/logs/axgen_$TAG.json" 2> "$WORK/logs/axgen_$TAG.log"
RC=$?
set -e
# exit 1 only says "does not fit"; a report line is still there
if ! grep -q '"peak_bytes"' "$WORK/logs/axgen_$TAG.json"; then
  echo "axgen aot failed (rc=$RC); tail of $WORK/logs/axgen_$TAG.log:" >&2; tail -20 "$WORK/logs/axgen_$TAG.log" >&2
  echo "AXGEN_PEAK_GIB=ERROR"; exit 1
fi
"$PY" - "$WORK/logs/axgen_$TAG.json" <<'PY'
import json, sys
r = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
G = 1024**3
f = lambda k: "n/a" if r.get(k) is None else f"{r[k] / G:.2f}"
print(f"axgen: {r['spec']} on {r['compiled_for']}; {r['grad_accum_steps']} x {r['microbatch']} sequences per device; "
      f"arguments {f('argument_bytes')} outputs {f('output_bytes')} aliased {f('alias_bytes')} temp {f('temp_bytes')} "
      f"host {f('host_bytes')} GiB; compile {r['compile_seconds']:.0f}s; fits={r['fits']}")
print("AXGEN_PEAK_GIB=" + ("OOM(" + str(r.get("out_of_memory")) + ")" if r["peak_bytes"] is None else f"{r['peak_bytes'] / G:.2f}"))
collective = r.get("collective_bytes") or {}
kinds = " ".join(f"{kind}={value / G:.2f}" for kind, value in collective.items())
print(f"AXGEN_COLLECTIVE_GIB={sum(collective.values()) / G:.2f} {kinds}")
PY
