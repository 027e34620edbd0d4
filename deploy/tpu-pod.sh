#!/usr/bin/env bash
# Runs an emitted program on every worker of a Cloud TPU VM slice. Every worker runs the same command with no
# coordinator flags: jax.distributed.initialize() finds the other workers through the TPU metadata.
#
#   deploy/tpu-pod.sh setup   # once per slice: the program's packages, at pyproject.toml's versions
#   deploy/tpu-pod.sh start   # copy the program to every worker and start it there, in the background
#   deploy/tpu-pod.sh logs    # follow worker 0's log
#   deploy/tpu-pod.sh stop    # SIGTERM on every worker: all stop at the same step, save a checkpoint, exit 0
#
# Run from the repository root. Each variable below can be given in the environment instead:
#   TPU_NAME=my-v5e ZONE=us-east5-a deploy/tpu-pod.sh start
# `start` again after a stop or a preemption resumes from the newest checkpoint in RUN_DIR.
set -euo pipefail

TPU_NAME=${TPU_NAME:-axgen-v5e-256}                     # a v5litepod-256: 64 workers of 4 chips
ZONE=${ZONE:-us-east5-a}
PROJECT=${PROJECT:-}                                    # empty: gcloud's configured project
PROGRAM=${PROGRAM:-generated/llama2_7b/tpu_v5e_256.py}  # emitted for this slice: NUM_HOSTS = its worker count
DATA=${DATA:-/mnt/shared/data/mine}                     # `axgen data` output, on storage every worker mounts
RUN_DIR=${RUN_DIR:-/mnt/shared/runs/llama2_7b}          # checkpoints, metrics: shared by every worker
CACHE=${CACHE:-/mnt/shared/jax-cache}                   # compiled steps, shared: a rerun does not compile again
STEPS=${STEPS:-500000}
EVAL_EVERY=${EVAL_EVERY:-1000}
PYTHON=${PYTHON:-python3}                               # on the workers; Python >= 3.12
REMOTE_DIR=${REMOTE_DIR:-axgen}                         # on each worker, relative to its home directory

PROGRAM_ARGS=(
  --data "$DATA"
  --run-dir "$RUN_DIR"
  --compilation-cache "$CACHE"
  --steps "$STEPS"
  --eval-every "$EVAL_EVERY"
)

tpu_vm() { # gcloud compute tpus tpu-vm VERB ARGS... in this zone (and project)
  local verb=$1
  shift
  gcloud compute tpus tpu-vm "$verb" "$@" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"}
}

on_all_workers() { # runs $1 with the login shell of every worker, at the same time
  tpu_vm ssh "$TPU_NAME" --worker=all --command="$1"
}

pinned_packages() { # jax (with libtpu), optax, orbax, numpy, tensorboardX as pyproject.toml pins them
  python3 - <<'EOF'
import tomllib

wanted = {"jax": "jax[tpu]", "optax": "optax", "orbax-checkpoint": "orbax-checkpoint", "numpy": "numpy",
          "tensorboardX": "tensorboardX"}
with open("pyproject.toml", "rb") as f:
    for dependency in tomllib.load(f)["project"]["dependencies"]:
        name, _, version = dependency.partition("==")
        if name in wanted:
            print(f"'{wanted[name]}=={version}'", end=" ")
EOF
}

setup() {
  # The programs import axgen.runtime: the wheel of this checkout, installed without the compiler's dependencies.
  python3 -m pip wheel --quiet --no-deps --wheel-dir build/wheel .
  local wheel
  wheel=$(ls -t build/wheel/axgen-*.whl | head -n 1)
  on_all_workers "mkdir -p $REMOTE_DIR"
  tpu_vm scp "$wheel" "$TPU_NAME:$REMOTE_DIR/" --worker=all
  on_all_workers "$PYTHON -m pip install --user --quiet $(pinned_packages) && $PYTHON -m pip install --user --quiet --no-deps --force-reinstall $REMOTE_DIR/$(basename "$wheel")"
}

start() {
  if [[ ! -f $PROGRAM ]]; then
    echo "error: $PROGRAM: no such file (run from the repository root, or set PROGRAM)" >&2
    exit 2
  fi
  local remote_program
  remote_program="$REMOTE_DIR/$(basename "$PROGRAM")"
  on_all_workers "mkdir -p $REMOTE_DIR"
  tpu_vm scp "$PROGRAM" "$TPU_NAME:$remote_program" --worker=all
  # setsid + nohup: the run outlives this ssh session, and only SIGTERM (stop, or the VM shutting down) stops it
  # with a checkpoint. A worker whose previous run is still alive refuses to start a second one.
  on_all_workers "
if [ -f $REMOTE_DIR/train.pid ] && kill -0 \$(cat $REMOTE_DIR/train.pid) 2>/dev/null; then
  echo \"\$(hostname): a run is still going (pid \$(cat $REMOTE_DIR/train.pid)); deploy/tpu-pod.sh stop first\" >&2
  exit 1
fi
setsid nohup $PYTHON $remote_program $(printf '%q ' "${PROGRAM_ARGS[@]}")>> $REMOTE_DIR/train.log 2>&1 < /dev/null &
echo \$! > $REMOTE_DIR/train.pid
echo \"\$(hostname): started pid \$!, log ~/$REMOTE_DIR/train.log\""
}

stop() {
  on_all_workers "if [ -f $REMOTE_DIR/train.pid ]; then kill -TERM \$(cat $REMOTE_DIR/train.pid) 2>/dev/null || true; fi"
}

logs() {
  tpu_vm ssh "$TPU_NAME" --worker=0 --command="tail -n 200 -F $REMOTE_DIR/train.log"
}

case "${1:-}" in
  setup | start | stop | logs) "$1" ;;
  *)
    echo "usage: $0 setup|start|stop|logs" >&2
    exit 2
    ;;
esac
