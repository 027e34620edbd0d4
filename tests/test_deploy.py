"""deploy/: the launch files parse, their numbers match the program they launch, and the command each one builds
reaches the program with flags its argument parser accepts. The scripts run for real against fake `gcloud`,
`scontrol`, `srun` and `python3` that record what they were given: no network, no cluster."""

import math
import os
import re
import signal
import subprocess
import time
import tomllib
from functools import cache
from pathlib import Path

import pytest
from tests.conftest import ROOT

from axgen.interop import load_program
from axgen.runtime.program import Program
from axgen.runtime.run import parse_args

DEPLOY = ROOT / "deploy"
JOBSETS = {"jobset.yaml": "google.com/tpu", "jobset-gpu.yaml": "nvidia.com/gpu"}
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")

FAKES = {
    # Records its arguments (NUL-separated) and pid; with FAKE_WAIT it waits for SIGTERM, as a run does.
    "python3": """#!/bin/bash
printf '%s\\0' "$@" > "$ARGV_OUT"
echo $$ > "$ARGV_OUT.pid"
if [[ -n ${FAKE_WAIT:-} ]]; then
  trap 'echo TERM > "$FAKE_WAIT.term"; exit 0' TERM
  : > "$FAKE_WAIT"
  while :; do sleep 0.02; done
fi
exit "${FAKE_EXIT:-0}"
""",
    "gcloud": """#!/bin/bash
n=$(ls "$CALLS" | wc -l)
printf '%s\\0' "$@" > "$CALLS/$(printf %03d "$n")"
""",
    "scontrol": """#!/bin/bash
[[ "$1 $2 $3" == "show hostnames gpu-[001-008]" ]] || { echo "unexpected: scontrol $*" >&2; exit 1; }
printf 'gpu-%03d\\n' 1 2 3 4 5 6 7 8
""",
    # Keeps its own options for the test, then runs the task as task 3 of the step would.
    "srun": """#!/bin/bash
while [[ $1 == -* ]]; do echo "$1" >> "$SRUN_OPTIONS"; shift; done
SLURM_PROCID=3 exec "$@"
""",
}


@cache
def program(path: str):
    return load_program(ROOT / path)


def devices(module) -> int:
    return math.prod(module.MESH_SHAPE.values())


def parsed(module, argv: list[str], **env: str):
    """The program's parse of `argv` (with `env` as its environment), after checking that every flag in it is
    the program's own option, not a prefix argparse would stretch to another one, and keeps the value given.
    """
    assert set(env) <= set(JAX_ENV)
    saved = {name: os.environ.pop(name, None) for name in JAX_ENV}
    os.environ.update(env)
    try:
        args = parse_args(Program.from_module(module), argv)
    except SystemExit:
        pytest.fail(f"{module.__file__} refuses {argv} (its error is in the captured stderr)")
    finally:
        for name in JAX_ENV:
            os.environ.pop(name, None)
        os.environ.update({name: value for name, value in saved.items() if value is not None})
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--"), f"{argv}: {flag!r} is no flag"
        dest = flag[2:].replace("-", "_")
        assert hasattr(args, dest), f"{flag} is not an option of {module.__file__}"
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            assert str(getattr(args, dest)) == argv[i + 1], flag
            i += 2
        else:
            assert getattr(args, dest) is True, flag
            i += 1
    return args


@pytest.fixture
def fakes(tmp_path):
    """PATH with the fake commands first, and where they write; kills any fake program left running."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "ARGV_OUT": str(tmp_path / "argv"),
        "CALLS": str(calls),
        "SRUN_OPTIONS": str(tmp_path / "srun-options"),
    }
    yield env
    pid_file = tmp_path / "argv.pid"
    if pid_file.exists():  # a fake program still running after a failure: only ours, never a reused pid
        pid = int(pid_file.read_text())
        try:
            if str(bin_dir / "python3") in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def argv_of_fake_program(env, timeout=10.0) -> list[str]:
    path = Path(env["ARGV_OUT"])
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_bytes().endswith(b"\0")):
        assert time.monotonic() < deadline, "the program was never started"
        time.sleep(0.01)
    return path.read_bytes().decode().split("\0")[:-1]


def wait_for(path: Path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def bash_syntax_ok(script: str, name: str):
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, f"{name}: {result.stderr}"


def default(text: str, variable: str) -> str:
    """VAR's default in a script that sets it as VAR=${VAR:-default}."""
    return re.search(rf"^{variable}=\$\{{{variable}:-([^}}\s]+)\}}", text, re.M).group(1)


# --- shell scripts -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tpu-pod.sh", "slurm.sbatch"])
def test_shell_scripts_are_valid_bash(name):
    text = (DEPLOY / name).read_text()
    assert text.startswith("#!") and "set -euo pipefail" in text
    bash_syntax_ok(text, name)


def test_tpu_pod_script_starts_the_same_command_on_every_worker_and_stops_it_with_sigterm(tmp_path, fakes):
    script = (DEPLOY / "tpu-pod.sh").read_text()
    path = default(script, "PROGRAM")
    module = program(path)
    assert module.PLATFORM == "tpu" and module.NUM_HOSTS > 1, "jax must find the slice's workers itself"

    env = {**fakes, "TPU_NAME": "my-tpu", "ZONE": "zone-a", "FAKE_WAIT": str(tmp_path / "running")}
    run = subprocess.run(["bash", DEPLOY / "tpu-pod.sh", "start"], env=env, cwd=ROOT, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()
    calls = [p.read_bytes().decode().split("\0")[:-1] for p in sorted(Path(fakes["CALLS"]).iterdir())]
    assert [call[:4] for call in calls] == [
        ["compute", "tpus", "tpu-vm", verb] for verb in ("ssh", "scp", "ssh")
    ]
    for call in calls:
        assert "--worker=all" in call and "--zone=zone-a" in call, call
    mkdir, copy, start = calls
    assert copy[4] == path and copy[5].startswith("my-tpu:"), copy

    home = tmp_path / "home"
    home.mkdir()
    for call in (mkdir, start):  # what each worker runs, here
        (command,) = [arg.removeprefix("--command=") for arg in call if arg.startswith("--command=")]
        bash_syntax_ok(command, "tpu-pod.sh's remote command")
        worker = subprocess.run(["bash", "-c", command], env=env, cwd=home, capture_output=True, timeout=10)
        assert worker.returncode == 0, worker.stderr.decode()
    argv = argv_of_fake_program(env)
    assert argv[0] == copy[5].removeprefix("my-tpu:")
    args = parsed(module, argv[1:])
    assert (args.coordinator, args.num_processes, args.process_id) == (None, None, None)
    assert args.data and args.run_dir and args.compilation_cache

    wait_for(tmp_path / "running")
    run = subprocess.run(["bash", DEPLOY / "tpu-pod.sh", "stop"], env=env, cwd=ROOT, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()
    stop = sorted(Path(fakes["CALLS"]).iterdir())[-1].read_bytes().decode().split("\0")[:-1]
    assert "--worker=all" in stop
    (command,) = [arg.removeprefix("--command=") for arg in stop if arg.startswith("--command=")]
    subprocess.run(["bash", "-c", command], env=env, cwd=home, check=True, timeout=10)
    wait_for(tmp_path / "running.term")


def sbatch_options(text: str) -> dict[str, str | None]:
    return dict(re.findall(r"^#SBATCH (--[\w-]+)(?:=(\S+))?", text, re.M))


def test_slurm_script_gives_every_task_the_first_node_as_coordinator_and_its_own_process_id(fakes):
    text = (DEPLOY / "slurm.sbatch").read_text()
    options = sbatch_options(text)
    path = default(text, "PROGRAM")
    module = program(path)
    nodes, gpus = int(options["--nodes"]), int(options["--gpus-per-node"])
    assert nodes == module.NUM_HOSTS and nodes * gpus == devices(module)
    assert options["--ntasks-per-node"] == "1" and "--requeue" in options
    assert re.fullmatch(r"TERM@\d+", options["--signal"]), "SIGTERM before the time limit"

    env = {
        **fakes,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-[001-008]",
        "SLURM_NNODES": "8",
        "SLURM_NTASKS": "8",
        "SLURM_CPUS_ON_NODE": "208",
    }
    run = subprocess.run(
        ["bash", DEPLOY / "slurm.sbatch"], env=env, cwd=ROOT, capture_output=True, timeout=10
    )
    assert run.returncode == 0, run.stderr.decode()
    srun = Path(fakes["SRUN_OPTIONS"]).read_text().split()
    assert {"--ntasks-per-node=1", f"--gpus-per-node={gpus}", "--kill-on-bad-exit=1"} <= set(srun)
    argv = argv_of_fake_program(env)
    assert argv[0] == path
    args = parsed(module, argv[1:])
    assert args.coordinator == f"gpu-001:{61440 + 4242 % 4096}"
    assert (args.num_processes, args.process_id) == (nodes, 3)


# --- JobSets -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", JOBSETS)
def test_jobset_text_names_the_api_and_the_completion_index(name):
    """What must be right even where PyYAML is missing."""
    text = (DEPLOY / name).read_text()
    assert re.search(r"^apiVersion: jobset\.x-k8s\.io/v1alpha2$", text, re.M)
    assert re.search(r"^kind: JobSet$", text, re.M)
    assert f"fieldPath: {COMPLETION_INDEX}" in text
    for variable in JAX_ENV:
        assert f"- name: {variable}" in text


def load_jobset(name: str):
    yaml = pytest.importorskip("yaml")
    jobset = yaml.safe_load((DEPLOY / name).read_text())
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item for item in container["env"]}
    return jobset, replicated, job, pod, container, env


@pytest.mark.parametrize("name", JOBSETS)
def test_jobset_runs_one_pod_per_host_with_pod_0_as_coordinator(name):
    jobset, replicated, job, pod, container, env = load_jobset(name)
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    module = program(env["PROGRAM"]["value"])
    hosts = module.NUM_HOSTS
    assert replicated["replicas"] == 1
    assert job["parallelism"] == job["completions"] == hosts > 1
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    assert devices(module) == hosts * container["resources"]["limits"][JOBSETS[name]]
    if JOBSETS[name] == "google.com/tpu":
        topology = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
        assert math.prod(map(int, topology.split("x"))) == devices(module)
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"

    assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
    assert env["JAX_NUM_PROCESSES"]["value"] == str(hosts)
    name_ = jobset["metadata"]["name"]
    subdomain = jobset["spec"].get("network", {}).get("subdomain", name_)
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "coordinator"]
    pod_0 = f"{name_}-{replicated['name']}-0-0.{subdomain}:{port}"
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == pod_0


@pytest.mark.parametrize("name", JOBSETS)
def test_jobset_restarts_on_failure_and_gives_sigterm_time_to_save(name):
    jobset, _, job, pod, container, _ = load_jobset(name)
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    assert {
        "action": "RestartJobSetAndIgnoreMaxRestarts",
        "onJobFailureReasons": ["PodFailurePolicy"],
    } in policy["rules"]
    disruption = {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert disruption in job["podFailurePolicy"]["rules"]
    assert pod["restartPolicy"] == "Never", "podFailurePolicy needs it"
    assert pod["terminationGracePeriodSeconds"] >= 300


def jobset_script(name):
    _, _, _, pod, container, env = load_jobset(name)
    assert container["command"] == ["bash", "-c"]
    (script,) = container["args"]
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    values = {k: v["value"] for k, v in env.items() if "value" in v}
    return script, values, mounts


@pytest.mark.parametrize("name", JOBSETS)
def test_jobset_command_passes_flags_the_program_accepts(name, fakes):
    script, values, mounts = jobset_script(name)
    bash_syntax_ok(script, name)
    env = {**fakes, **values, "JAX_PROCESS_ID": "5"}
    run = subprocess.run(["bash", "-c", script], env=env, cwd=ROOT, capture_output=True, timeout=10)
    assert run.returncode == 0, run.stderr.decode()
    argv = argv_of_fake_program(env)
    assert argv[0] == values["PROGRAM"]
    module = program(values["PROGRAM"])
    jax_env = {k: env[k] for k in JAX_ENV}
    args = parsed(module, argv[1:], **jax_env)
    assert args.coordinator == values["JAX_COORDINATOR_ADDRESS"]
    assert (args.num_processes, args.process_id) == (module.NUM_HOSTS, 5)
    for path in (args.data, args.run_dir, args.compilation_cache):
        assert any(path.startswith(mount + "/") for mount in mounts), f"{path} is on no shared volume"


@pytest.mark.parametrize("name", JOBSETS)
def test_jobset_wrapper_fails_the_pod_after_a_sigterm_stop_and_passes_other_exits_through(
    name, fakes, tmp_path
):
    """A pod that exits 0 completes its index for good, so a run stopped by SIGTERM (checkpoint saved, exit 0)
    must leave a failed pod for the JobSet to restart."""
    script, values, _ = jobset_script(name)
    env = {**fakes, **values, "JAX_PROCESS_ID": "0"}
    for code in ("0", "3"):
        run = subprocess.run(["bash", "-c", script], env={**env, "FAKE_EXIT": code}, cwd=ROOT, timeout=10)
        assert run.returncode == int(code)

    running = tmp_path / "running"
    wrapper = subprocess.Popen(["bash", "-c", script], env={**env, "FAKE_WAIT": str(running)}, cwd=ROOT)
    try:
        wait_for(running)
        wrapper.send_signal(signal.SIGTERM)
        assert wrapper.wait(timeout=10) == 143
        assert (tmp_path / "running.term").exists(), "the SIGTERM reached the program"
    finally:
        wrapper.kill()


# --- README ------------------------------------------------------------------------------------------------------


def test_readme_flag_table_names_options_of_the_programs():
    readme = (DEPLOY / "README.md").read_text()
    flags = re.findall(r"^\| `(--[a-z-]+)", readme, re.M)
    assert {"--coordinator", "--num-processes", "--process-id", "--data", "--run-dir"} <= set(flags)
    for path in ("generated/llama2_7b/tpu_v5e_256.py", "generated/llama3_8b/gpu_h100_64.py"):
        args = parsed(program(path), ["--data", "d", "--run-dir", "r"])
        for flag in flags:
            assert hasattr(args, flag[2:].replace("-", "_")), f"README: {flag} is not an option of {path}"


def test_readme_image_pins_the_versions_pyproject_pins():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {name: version for name, _, version in (dep.partition("==") for dep in dependencies)}
    image = re.search(r"^FROM .*?^COPY", (DEPLOY / "README.md").read_text(), re.M | re.S).group(0)
    named = re.findall(r"([A-Za-z][\w-]*)(?:\[\w+\])?==([\w.]+)", image)
    assert {name for name, _ in named} >= {"jax", "optax", "orbax-checkpoint", "numpy", "tensorboardX"}
    for name, version in named:
        assert (
            pins.get(name) == version
        ), f"deploy/README.md: {name}=={version}; pyproject.toml: {pins.get(name)}"
