"""`axgen convert-hf`: sharded HF safetensors become the program's params, checked tensor by tensor, restored
into a sharded mesh with `--init-from`, and fine-tuned from."""

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import save_file
from tests.conftest import PROGRAM_ENV, ROOT, run_python

from axgen.build import build
from axgen.files import write_atomically
from axgen.cli import main as axgen
from axgen.data.datasets import write_dataset
from axgen.hf.weights import HFCheckpoint
from axgen.interop import hf_to_params, load_program
from axgen.runtime.program import Program

FIXTURE = ROOT / "tests/fixtures/hf_qwen2.npz"
SPEC = ROOT / "tests/fixtures/hf_qwen2_spec.py"


def state_dict(dtype=np.float32) -> dict[str, np.ndarray]:
    fixture = np.load(FIXTURE)
    return {k: fixture[k].astype(dtype) for k in fixture.files if k.startswith(("model.", "lm_head."))}


def save_sharded(directory, tensors: dict, shards: int = 3) -> None:
    """As `save_pretrained` writes a big model: shards of safetensors and an index naming each tensor's shard."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        save_file(part, str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def convert(capsys, hf_dir, out, *extra) -> tuple[int, str]:
    code = axgen(["convert-hf", str(SPEC), "--hf", str(hf_dir), "--out", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("program") / "qwen2_cpu_1.py"
    write_atomically(path, build(SPEC, "cpu-1").source)
    return load_program(path)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_sharded_safetensors_restore_into_a_sharded_mesh_as_the_hf_params(dtype, program, tmp_path, capsys):
    tensors = state_dict(dtype)
    save_sharded(tmp_path / "hf", tensors)
    code, output = convert(capsys, tmp_path / "hf", tmp_path / "ckpt")
    assert code == 0, output
    assert "wrote" in output

    program.MESH_SHAPE = {"data": 1, "fsdp": 4, "expert": 1, "context": 1, "model": 2}
    try:
        mesh = Program.from_module(program).make_mesh()
        restored = Program.from_module(program).restore_params(tmp_path / "ckpt", mesh)
    finally:
        program.MESH_SHAPE = {axis: 1 for axis in program.MESH_SHAPE}
    assert not restored["layers"]["wq"].sharding.is_fully_replicated, "restored straight into the shards"
    expected = hf_to_params(tensors, load_program_spec())
    jax.tree.map(lambda got, want: np.testing.assert_array_equal(np.asarray(got), want), restored, expected)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(restored)), "cast to the program's dtype"


def load_program_spec():
    from axgen.loader import load_spec

    return load_spec(SPEC)


def damaged(tmp_path, change) -> object:
    tensors = state_dict()
    change(tensors)
    save_sharded(tmp_path / "hf", tensors)
    return tmp_path / "hf"


BAD = {
    "missing": (
        lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"),
        "has no tensor 'model.layers.1.self_attn",
    ),
    "unexpected": (
        lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((4, 4), np.float32)}),
        "holds 'model.layers.2.mlp.up_proj.weight', which hf-qwen2 has no param for",
    ),
    "misshaped": (
        lambda t: t.update({"model.norm.weight": np.zeros(7, np.float32)}),
        "tensor 'model.norm.weight' has shape [7]; param final_norm needs [64]",
    ),
    # As many elements as the param, the wrong way round: read as they are, they would be wrong weights.
    "transposed": (
        lambda t: t.update(
            {"model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.k_proj.weight"].T}
        ),
        "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [64, 32]; param wk needs [32, 64]",
    ),
    "not finite": (
        lambda t: t["model.layers.1.mlp.down_proj.weight"].__setitem__((0, 0), np.nan),
        "tensor 'model.layers.1.mlp.down_proj.weight' holds 1 NaN or infinite values",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_a_checkpoint_that_does_not_fit_the_spec_names_the_tensor(case, tmp_path, capsys):
    change, message = BAD[case]
    code, output = convert(capsys, damaged(tmp_path, change), tmp_path / "ckpt")
    assert code == 2 and message in output and output.count("\n") == 1, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "no partial output"


def test_overlapping_tensors_in_a_shard_are_refused(tmp_path, capsys):
    """The safetensors format forbids two tensors sharing bytes; a header that says they do is damaged."""
    (tmp_path / "hf").mkdir()
    save_file(state_dict(), str(tmp_path / "hf/model.safetensors"))
    data = (tmp_path / "hf/model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    first, second = sorted(
        (n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"]
    )[:2]
    assert header[first]["shape"] == header[second]["shape"]  # the embedding and the output head
    header[second]["data_offsets"] = header[first]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))
    (tmp_path / "hf/model.safetensors").write_bytes(data[:8] + text + data[8 + length :])
    code, output = convert(capsys, tmp_path / "hf", tmp_path / "ckpt")
    assert code == 2 and f"tensor {second!r}: its bytes overlap those of {first!r}" in output, output
    assert not (tmp_path / "ckpt").exists()


def test_ctrl_c_during_a_conversion_stops_it_with_nothing_written(tmp_path, capsys, monkeypatch):
    """An interrupt is held until the next tensor, then stops the conversion: exit 130, no checkpoint, no staging
    folder; the handler found before is put back (Python's own, or SIG_IGN in a job started in the background).
    """
    save_sharded(tmp_path / "hf", state_dict())
    handler = signal.getsignal(signal.SIGINT)
    reads = []
    original = HFCheckpoint.__getitem__

    def read_and_interrupt(self, name):
        reads.append(name)
        if len(reads) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, name)

    monkeypatch.setattr(HFCheckpoint, "__getitem__", read_and_interrupt)
    code, output = convert(capsys, tmp_path / "hf", tmp_path / "ckpt")
    assert (code, output) == (130, "axgen: interrupted\n")
    assert len(reads) == 3, "stopped at the next tensor"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_truncated_shard_is_named(tmp_path, capsys):
    save_sharded(tmp_path / "hf", state_dict())
    shard = tmp_path / "hf/model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    code, output = convert(capsys, tmp_path / "hf", tmp_path / "ckpt")
    assert code == 2 and str(shard) in output, output
    assert not (tmp_path / "ckpt").exists()


def test_fine_tuning_from_a_converted_checkpoint_lowers_its_loss(program, tmp_path, capsys):
    save_sharded(tmp_path / "hf", state_dict(ml_dtypes.bfloat16))
    assert convert(capsys, tmp_path / "hf", tmp_path / "ckpt")[0] == 0
    rng = np.random.default_rng(0)
    pattern = rng.integers(1, 127, 40)  # a document the model can learn: the same tokens again and again
    write_dataset(tmp_path / "data", [pattern] * 50, vocab_size=128, bos_id=None, eos_id=0, eval_fraction=0)
    log = run_python(
        str(program.__file__),
        *("--data", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), "--steps", "8"),
        *("--log-every", "1", "--init-from", str(tmp_path / "ckpt")),
    )
    assert f"params from {tmp_path / 'ckpt'}, a fresh optimizer state" in log
    losses = [float(line.split(" | ")[1].split()[1]) for line in log.splitlines() if line.startswith("step ")]
    assert losses[-1] < losses[0] - 0.5, losses
    # The HF folder had no tokenizer.json: nothing to compare, nothing said.
    assert "tokenizer.json (sha256" not in log


def test_a_run_from_params_of_another_tokenizer_than_its_datasets_warns(tmp_path, capsys):
    """convert-hf records the source folder's tokenizer.json; a run from those params on a dataset that another
    tokenizer made is warned, naming both, before anything starts."""
    from axgen.runtime import checkpoints
    from axgen.runtime.run import _check_tokenizer

    save_sharded(tmp_path / "hf", state_dict())
    (tmp_path / "hf/tokenizer.json").write_text('{"model": "the model\'s own"}')
    assert convert(capsys, tmp_path / "hf", tmp_path / "ckpt")[0] == 0
    recorded = checkpoints.tokenizer_of(tmp_path / "ckpt")
    assert recorded == hashlib.sha256(b'{"model": "the model\'s own"}').hexdigest()
    write_dataset(
        tmp_path / "data", [np.arange(1, 9)], vocab_size=128, bos_id=None, eos_id=0, eval_fraction=0
    )
    manifest = json.loads((tmp_path / "data/manifest.json").read_text())
    for dataset_sha, warned in ((recorded, False), ("0" * 64, True)):
        manifest["tokenizer"]["sha256"] = dataset_sha
        (tmp_path / "data/manifest.json").write_text(json.dumps(manifest))
        _check_tokenizer(tmp_path / "ckpt", tmp_path / "data")
        err = capsys.readouterr().err
        assert ("is not the one that made" in err) == warned, err


def test_force_replaces_a_checkpoint_and_nothing_else(tmp_path, capsys):
    save_sharded(tmp_path / "hf", state_dict())
    assert convert(capsys, tmp_path / "hf", tmp_path / "ckpt")[0] == 0
    code, output = convert(capsys, tmp_path / "hf", tmp_path / "ckpt")
    assert code == 2 and "already exists (pass --force to replace it)" in output
    assert convert(capsys, tmp_path / "hf", tmp_path / "ckpt", "--force")[0] == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("keep me")
    code, output = convert(capsys, tmp_path / "hf", tmp_path / "mine", "--force")
    assert code == 2 and "has no _CHECKPOINT_METADATA, so --force will not replace it" in output
    assert (tmp_path / "mine/notes.txt").read_text() == "keep me"


def test_a_non_finite_step_never_reaches_the_params_and_enough_in_a_row_stop_the_run(
    program, tmp_path, capsys
):
    state = Program.from_module(program).init_state(jax.random.key(0))
    state["params"]["final_norm"] = state["params"]["final_norm"].at[0].set(np.nan)
    tokens = np.random.default_rng(0).integers(1, 128, (2, 25))
    new_state, metrics = jax.jit(program.train_step)(state, tokens)
    assert bool(metrics["skipped"]) and int(new_state["step"]) == 1
    jax.tree.map(np.testing.assert_array_equal, new_state["params"], state["params"])
    jax.tree.map(np.testing.assert_array_equal, new_state["opt_state"], state["opt_state"])

    tensors = state_dict()
    tensors["model.norm.weight"][3] = np.inf
    save_sharded(tmp_path / "hf", tensors)
    code, output = convert(capsys, tmp_path / "hf", tmp_path / "ckpt")
    assert code == 2 and "tensor 'model.norm.weight' holds 1 NaN or infinite values" in output
    assert not (tmp_path / "ckpt").exists()
    # The program meets such params all the same where a checkpoint was written by other means.
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", hf_to_params(tensors, load_program_spec()))
    write_dataset(
        tmp_path / "data", [np.arange(1, 100)] * 20, vocab_size=128, bos_id=None, eos_id=0, eval_fraction=0
    )
    result = subprocess.run(
        [
            sys.executable,
            str(program.__file__),
            "--data",
            str(tmp_path / "data"),
            "--run-dir",
            str(tmp_path / "run"),
        ]
        + ["--steps", "10", "--max-bad-steps", "3", "--init-from", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        env=PROGRAM_ENV,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "step 2: loss or gradient norm not finite; skipped (2 in a row)" in result.stdout
    assert result.stderr.strip().endswith(
        "error: 3 steps in a row up to step 3 had a non-finite loss or gradient norm (--max-bad-steps); the params"
        " are the last good step's"
    )
    assert not (tmp_path / "run/checkpoints").exists() or not any((tmp_path / "run/checkpoints").iterdir())


def hub_mixtral() -> dict[str, np.ndarray]:
    """The tiny Mixtral as save_pretrained writes it, and as the Hub holds Mixtral: one tensor per expert."""
    fixture = np.load(ROOT / "tests/fixtures/hf_mixtral_hub.npz")
    return {name: fixture[name] for name in fixture.files}


EXPERT = "model.layers.1.block_sparse_moe.experts"
BAD_EXPERTS = {
    "both layouts": (
        lambda t: t.update({"model.layers.0.mlp.experts.down_proj": np.zeros((4, 64, 96), np.float32)}),
        "holds both expert layouts ('model.layers.0.mlp.experts.down_proj', fused, and "
        "'model.layers.0.block_sparse_moe.experts.0.w1.weight', one per expert)",
    ),
    "an expert missing": (
        lambda t: t.pop(f"{EXPERT}.3.w3.weight"),
        f"has no tensor '{EXPERT}.3.w3.weight', which the spec needs",
    ),
    "an expert too many": (
        lambda t: t.update({f"{EXPERT}.4.w1.weight": t[f"{EXPERT}.0.w1.weight"]}),
        f"holds '{EXPERT}.4.w1.weight', but the spec has 4 experts (0 to 3)",
    ),
    "an expert transposed": (
        lambda t: t.update({f"{EXPERT}.2.w2.weight": t[f"{EXPERT}.2.w2.weight"].T}),
        f"tensor '{EXPERT}.2.w2.weight' is [96, 64]; the spec needs [64, 96]",
    ),
}


@pytest.mark.parametrize("case", BAD_EXPERTS)
def test_a_hub_layout_checkpoint_that_does_not_fit_names_the_expert_tensor(case, tmp_path, capsys):
    change, message = BAD_EXPERTS[case]
    tensors = hub_mixtral()
    change(tensors)
    save_sharded(tmp_path / "hf", tensors)
    spec = ROOT / "tests/fixtures/hf_mixtral_spec.py"
    code = axgen(["convert-hf", str(spec), "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")])
    output = capsys.readouterr().err
    assert code == 2 and message in output and output.count("\n") == 1, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "no partial output"
