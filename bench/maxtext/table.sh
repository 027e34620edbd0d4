#!/usr/bin/env bash
# Re-measure the axgen-vs-MaxText table, peak HBM and collective bytes per chip per step: every row through
# run_axgen.sh and run_maxtext.sh, then one markdown table (also written to $WORK/table.md).
# One command, from the project root: bench/maxtext/table.sh
# Env: ROWS ['']: only rows whose "model target" contains one of these words (e.g. ROWS="v5e-256 mixtral")
#      SIDES [axgen maxtext]: which columns to compute;  WORK [${TMPDIR:-/tmp}/maxtext-aot]
#      setup: bench/maxtext/setup.sh first (MaxText venv); the axgen side needs the project .venv: run from the project root.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-${TMPDIR:-/tmp}/maxtext-aot}; export MAXTEXT_AOT=${MAXTEXT_AOT:-$WORK} WORK
ROWS=${ROWS:-}; SIDES=${SIDES:-axgen maxtext}
mkdir -p "$WORK/logs"
# model | axgen target | MaxText compile_topology | slices | per-device batch (microbatch) | grad accum | seq |
# remat (axgen policy; run_maxtext.sh maps it) | optimizer offload | earlier axgen | earlier MaxText   (GiB/chip)
# Every value but the topology name is axgen's own plan for the target (run_axgen.sh prints it; checked below).
TABLE='
llama2-7b    tpu-v5e-256   v5e-256 1 1 4 4096 offload_dots false 5.36  5.52
llama2-7b    tpu-v5e-256x2 v5e-256 2 1 2 4096 offload_dots false 5.35  10.24
llama3-8b    tpu-v5p-128   v5p-256 1 2 2 8192 save_dots    false 53.93 61.40
llama3-8b    tpu-v5e-256   v5e-256 1 1 2 8192 offload_dots false 9.03  12.18
mixtral-8x7b tpu-v5p-256   v5p-512 1 1 1 8192 save_dots    false 53.03 49.59
'
OUT=$WORK/table.md
{
  echo "| model | axgen target | MaxText topology x slices | per-device batch x accum | seq | remat (axgen / MaxText) | opt offload | axgen GiB/chip | MaxText GiB/chip | axgen collective GiB/chip/step | MaxText collective GiB/chip/step | earlier axgen / MaxText | note |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} > "$OUT.tmp"
while read -r model target topo slices pdb accum seq remat opt e_ax e_mt; do
  [[ -z $model ]] && continue
  if [[ -n $ROWS ]]; then
    hit=0; for w in $ROWS; do [[ "$model $target" == *"$w"* ]] && hit=1; done; [[ $hit == 1 ]] || continue
  fi
  tag=${model}_${target}
  ax="-"; mt="-"; note=""; mt_remat="-"; ax_c="-"; mt_c="-"
  if [[ " $SIDES " == *" axgen "* ]]; then
    echo "== axgen  $model $target" >&2
    "$HERE/run_axgen.sh" "$model" "$target" > "$WORK/logs/row_axgen_$tag.out" 2>&1
    ax=$(sed -n 's/^AXGEN_PEAK_GIB=//p' "$WORK/logs/row_axgen_$tag.out" | tail -1); ax=${ax:-ERROR}
    ax_c=$(sed -n 's/^AXGEN_COLLECTIVE_GIB=//p' "$WORK/logs/row_axgen_$tag.out" | tail -1); ax_c=${ax_c:-ERROR}
    plan=$(grep '^AXGEN_PLAN' "$WORK/logs/row_axgen_$tag.out" | tail -1)
    want="seq=$seq per_device_batch=$pdb grad_accum=$accum remat=$remat"
    for kv in $want; do [[ " $plan " == *" $kv "* ]] || note+="axgen plan differs from row ($kv not in: ${plan#AXGEN_PLAN }); "; done
    echo "   axgen: $ax GiB" >&2
  fi
  if [[ " $SIDES " == *" maxtext "* ]]; then
    echo "== maxtext $model $topo x$slices" >&2
    "$HERE/run_maxtext.sh" "$model" "$topo" "$slices" "$pdb" "$seq" "$remat" "$opt" "$accum" > "$WORK/logs/row_maxtext_$tag.out" 2>&1
    mt=$(sed -n 's/^MAXTEXT_PEAK_GIB=//p' "$WORK/logs/row_maxtext_$tag.out" | tail -1); mt=${mt:-ERROR}
    mt_c=$(sed -n 's/^MAXTEXT_COLLECTIVE_GIB=//p' "$WORK/logs/row_maxtext_$tag.out" | tail -1); mt_c=${mt_c:-ERROR}
    mt_remat=$(grep -o 'remat_policy=[a-z_]*' "$WORK/logs/row_maxtext_$tag.out" | head -1 | cut -d= -f2)
    echo "   maxtext: $mt GiB" >&2
  fi
  echo "| $model | $target | $topo x$slices | $pdb x $accum | $seq | $remat / ${mt_remat:--} | $opt | $ax | $mt | $ax_c | $mt_c | $e_ax / $e_mt | ${note%; } |" >> "$OUT.tmp"
done <<< "$TABLE"
mv "$OUT.tmp" "$OUT"
echo
echo "axgen: $(${AXGEN_ROOT:-$PWD}/.venv/bin/python -c 'import importlib.metadata as m; print("jax", m.version("jax"), "libtpu", m.version("libtpu"))' 2>/dev/null); MaxText venv: $("$WORK/venv/bin/python" -c 'import importlib.metadata as m; print("maxtext", m.version("maxtext"), "jax", m.version("jax"), "libtpu", m.version("libtpu"))' 2>/dev/null); $(date -u +%F)"
cat "$OUT"
