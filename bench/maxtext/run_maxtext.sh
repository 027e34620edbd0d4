#!/usr/bin/env bash
# One row through MaxText 0.2.5's deviceless compile (maxtext.trainers.pre_train.train_compile, via mt_compile.py
# which only adds a JSON line of the memory analysis), printing the peak per chip.
#
# Usage: run_maxtext.sh MODEL TOPOLOGY SLICES PER_DEVICE_BATCH SEQ REMAT OPT_OFFLOAD [GRAD_ACCUM]
#   MODEL             MaxText model_name: llama2-7b | llama3-8b | mixtral-8x7b
#   TOPOLOGY          MaxText compile_topology (v5e-256, v5p-256, ...; NB MaxText's v5p-N is N/2 chips, v5e-N is N
#                     chips), or an axgen target (tpu-v5e-256, tpu-v5p-128, tpu-v5e-256x2), translated to chips
#   SLICES            compile_topology_num_slices (an axgen target's xS wins)
#   PER_DEVICE_BATCH  sequences per chip per forward/backward pass (MaxText per_device_batch_size = axgen microbatch)
#   SEQ               max_target_length
#   REMAT             an axgen policy (full, save_dots, save_dots_except_mlp, save_qkv_proj, save_out_proj,
#                     offload_dots, none), mapped to MaxText's same-named-tensor policy, or a MaxText remat_policy
#   OPT_OFFLOAD       true|false -> optimizer_memory_host_offload
#   GRAD_ACCUM        gradient_accumulation_steps [1] (global batch = PER_DEVICE_BATCH x chips x GRAD_ACCUM)
# Env: MAXTEXT_AOT [${TMPDIR:-/tmp}/maxtext-aot] (VENV [$MAXTEXT_AOT/venv] from setup.sh; logs in $MAXTEXT_AOT/logs)
#      MATCH_FLAGS [1]: on v5e, put axgen's v5e LIBTPU_INIT_ARGS (async collective fusion, backends/tpu.py) in effect
#      EXTRA_ARGS ['']: more key=value overrides for MaxText;  TIMEOUT [1800] seconds
#      MOE_CUSTOM_REMAT [1]: 0 = use plain minimal/minimal_offloaded for MoE models too (misses moe_mlpwi_1)
# Output, last lines:
#   maxtext: ... arguments/outputs/aliased/temp/host GiB ...
#   MAXTEXT_PEAK_GIB=<arguments + outputs - aliased + temporaries, GiB: MaxText's "Total estimated memory size", and the figure
#                     axgen aot reports; host-offloaded bytes excluded>
#   MAXTEXT_COLLECTIVE_GIB=<collective bytes per chip per step, by kind: collectives.py on the compiled HLO, with
#                     AXGEN_ROOT's virtualenv (AXGEN_ROOT [the current directory: run from the project root])>
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [[ $# -lt 7 ]]; then sed -n 2,23p "$0"; exit 2; fi
MODEL=$1; TOPO=$2; SLICES=$3; PDB=$4; SEQ=$5; REMAT=$6; OPT_OFFLOAD=$7; GRAD_ACCUM=${8:-1}
MAXTEXT_AOT=${MAXTEXT_AOT:-${TMPDIR:-/tmp}/maxtext-aot}
VENV=${VENV:-$MAXTEXT_AOT/venv}
MATCH_FLAGS=${MATCH_FLAGS:-1}
EXTRA_ARGS=${EXTRA_ARGS:-}
TIMEOUT=${TIMEOUT:-1800}
PY=$VENV/bin/python
[[ -x $PY ]] || { echo "no $PY: run $HERE/setup.sh first" >&2; exit 2; }
mkdir -p "$MAXTEXT_AOT/logs" "$MAXTEXT_AOT/out"

# axgen target name -> MaxText compile_topology + slices
if [[ $TOPO =~ ^tpu-(v5e|v5p|v6e)-([0-9]+)(x([0-9]+))?$ ]]; then
  gen=${BASH_REMATCH[1]}; chips=${BASH_REMATCH[2]}; [[ -n ${BASH_REMATCH[4]} ]] && SLICES=${BASH_REMATCH[4]}
  case $gen in v5p) TOPO=v5p-$((chips * 2));; *) TOPO=$gen-$chips;; esac   # MaxText names v5p by TensorCores
fi

# axgen remat policy -> MaxText policy that saves/offloads the same projections (nnx_decoders.get_remat_policy)
# axgen's save_dots/offload_dots cover a MoE layer's expert products too (gate, up, down). MaxText 0.2.5's sparse
# (megablox) MoE names the expert up-projection only "moe_mlpwi_1" (layers/moe.py), which `minimal` and
# `minimal_offloaded` do not list; so MoE models get remat_policy=custom with the moe_* tensors as well.
REMAT_ARGS=()
MOE_TENSORS=(moe_mlpwi_0 moe_mlpwi_1 moe_mlpwo)
DOT_TENSORS=(query_proj key_proj value_proj out_proj mlpwi_0 mlpwi_1 mlpwo)
case $REMAT in
  full) MT_REMAT=full;;                       # keep layer inputs only
  none) MT_REMAT=minimal_with_context; echo "note: no exact MaxText 'none'; using minimal_with_context" >&2;;
  save_dots) MT_REMAT=minimal;;               # q,k,v,out_proj,mlpwi_0/1,mlpwo saved on device
  save_dots_except_mlp) MT_REMAT=save_dot_except_mlp;;  # q,k,v,out_proj
  save_qkv_proj) MT_REMAT=save_qkv_proj;;
  save_out_proj) MT_REMAT=save_out_proj;;
  offload_dots) MT_REMAT=minimal_offloaded;;  # the same projections offloaded to pinned_host
  *) MT_REMAT=$REMAT;;                        # already a MaxText policy name
esac
if [[ $MODEL == mixtral-* && ( $REMAT == save_dots || $REMAT == offload_dots ) && ${MOE_CUSTOM_REMAT:-1} == 1 ]]; then
  where=device; [[ $REMAT == offload_dots ]] && where=offload
  MT_REMAT=custom
  for t in "${DOT_TENSORS[@]}" "${MOE_TENSORS[@]}"; do REMAT_ARGS+=("$t=$where"); done
fi

# axgen's v5e flags (backends/tpu.py V5E_FLAGS), which axgen aot puts in LIBTPU_INIT_ARGS for the compile
if [[ $MATCH_FLAGS == 1 && $TOPO == v5e-* ]]; then
  export LIBTPU_INIT_ARGS="--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true ${LIBTPU_INIT_ARGS:-}"
fi
# as axgen aot: jax itself on CPU, libtpu only describes the target topology
export JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1
export DECOUPLE_GCLOUD=TRUE        # stub out GCS / goodput / vertex integrations (as ../maxtext/run_maxtext_tiny.sh)
# a non-empty XLA_FLAGS keeps MaxText from setting its own HLO-dump flags
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=1}"

MOE_ARGS=()
[[ $MODEL == mixtral-* ]] && MOE_ARGS=(load_balance_loss_weight=0.02)   # axgen's aux_loss_weight (dropless, megablox: MaxText defaults)
TAG=${MODEL}_${TOPO}x${SLICES}_b${PDB}x${GRAD_ACCUM}_s${SEQ}_${MT_REMAT}${REMAT_ARGS:+-$REMAT}_opt${OPT_OFFLOAD}
LOG=$MAXTEXT_AOT/logs/maxtext_$TAG.log
CFG=$("$PY" -c 'import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"))')
CMD=("$PY" "$HERE/mt_compile.py" "$CFG"
  model_name="$MODEL" compile_topology="$TOPO" compile_topology_num_slices="$SLICES"
  per_device_batch_size="$PDB" gradient_accumulation_steps="$GRAD_ACCUM" max_target_length="$SEQ"
  remat_policy="$MT_REMAT" "${REMAT_ARGS[@]}" optimizer_memory_host_offload="$OPT_OFFLOAD" parameter_memory_host_offload=false
  weight_dtype=float32 dtype=bfloat16 attention=flash scan_layers=true
  ici_fsdp_parallelism=-1 ici_data_parallelism=1 ici_tensor_parallelism=1 dcn_data_parallelism=-1 dcn_fsdp_parallelism=1
  opt_type=adamw dataset_type=synthetic enable_checkpointing=false skip_jax_distributed_system=true
  run_name="aot_$TAG" base_output_directory="$MAXTEXT_AOT/out" jax_cache_dir="" enable_tensorboard=false log_config=false
  "${MOE_ARGS[@]}" $EXTRA_ARGS)
echo "LIBTPU_INIT_ARGS=${LIBTPU_INIT_ARGS:-} JAX_PLATFORMS=$JAX_PLATFORMS"
echo "CMD: ${CMD[*]}"
echo "LOG: $LOG"
set +e
HLO=$MAXTEXT_AOT/out/maxtext_$TAG.hlo
( cd "$MAXTEXT_AOT" && HLO_OUT=$HLO timeout "$TIMEOUT" "${CMD[@]}" ) > "$LOG" 2>&1
RC=$?
set -e
grep -E "^Memory analysis|Total estimated memory size|number parameters|RESOURCE_EXHAUSTED" "$LOG" | cut -c1-400 || true
if ! grep -q "^MAXTEXT_MEMORY_JSON" "$LOG"; then
  echo "MaxText compile failed (rc=$RC); tail of $LOG:" >&2; tail -25 "$LOG" >&2
  oom=$(grep -m1 -o "RESOURCE_EXHAUSTED.*" "$LOG" | cut -c1-200 || true)
  if [[ -n $oom ]]; then echo "MAXTEXT_PEAK_GIB=OOM($oom)"; else echo "MAXTEXT_PEAK_GIB=ERROR"; fi
  exit 1
fi
"$PY" - "$LOG" <<'PY'
import json, sys
m = json.loads([l for l in open(sys.argv[1]) if l.startswith("MAXTEXT_MEMORY_JSON ")][-1].split(" ", 1)[1])
G = 1024**3
peak = m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"] + m["temp_size_in_bytes"]
host = m.get("host_argument_size_in_bytes", 0) + m.get("host_temp_size_in_bytes", 0)
xla_peak = m.get("peak_memory_in_bytes")
# axgen aot's rule: XLA's own peak_memory_in_bytes counts host-offloaded buffers too, so it is taken only without them
if not host and xla_peak:
    peak = max(peak, xla_peak)
g = lambda k: f"{m.get(k, 0) / G:.2f}"
print(f"maxtext: arguments {g('argument_size_in_bytes')} outputs {g('output_size_in_bytes')} aliased "
      f"{g('alias_size_in_bytes')} temp {g('temp_size_in_bytes')} host {host / G:.2f} GiB; "
      f"xla peak_memory {('n/a' if xla_peak is None else f'{xla_peak / G:.2f}')} GiB")
print(f"MAXTEXT_PEAK_GIB={peak / G:.2f}")
PY
echo "MAXTEXT_$("${AXGEN_ROOT:-$PWD}/.venv/bin/python" "$HERE/collectives.py" "$HLO")"
