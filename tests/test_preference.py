"""Preference tuning against TRL (tests/fixtures/make_dpo_fixture.py): `axgen data --pairs` tokenizes pairs as
TRL's DPOTrainer does; F.dpo (reference: the base under F.lora's adapters) gives its per-step loss and six
metrics on the same model, adapter, pairs and optimizer, and F.simpo those of TRL's SimPO; a full fine-tune's DPO
keeps a frozen copy as its reference; and bad pairs, specs and datasets are refused in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.conftest import ROOT, run_in_process

from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.hf import peft
from axgen.interop import hf_to_params, load_program
from axgen.loader import load_spec
from axgen.runtime import checkpoints, dataset
from axgen.runtime.params import joined
from axgen.runtime.program import Program
from axgen.spec import SpecError

FIXTURES = ROOT / "tests/fixtures"
PAIRS = FIXTURES / "preference"
EXPECTED = json.loads((PAIRS / "expected.json").read_text())
QWEN = FIXTURES / "hf_qwen2_chat"
METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def data(tmp_path, *argv) -> int:
    return axgen(["data", *map(str, argv), "--pairs", "--tokenizer", str(QWEN / "tokenizer.json")])


@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory):
    """Each fixture file as `axgen data --pairs` writes it, every pair in the train split, in order."""
    out = tmp_path_factory.mktemp("pairs")
    for name in ("pairs.jsonl", "pairs_text.jsonl"):
        assert data(out, PAIRS / name, "--out", out / name, "--eval-fraction", "0") == 0
    return out


def pairs_of(directory) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(chosen ids, chosen mask, rejected ids, rejected mask) of each pair of a dataset's train split."""
    manifest = dataset.read_manifest(directory)
    (shard,) = manifest["splits"]["train"]["shards"]
    tokens, ends, mask = dataset.open_shard(directory, shard, manifest["token_dtype"], masked=True)
    bounds = np.concatenate([[0], ends])
    documents = [(tokens[a:b], mask[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return [(*documents[i], *documents[i + 1]) for i in range(0, len(documents), 2)]


@pytest.mark.parametrize("name", ["pairs.jsonl", "pairs_text.jsonl"])
def test_pairs_tokenize_as_trls_dpo_trainer(pairs_data, name):
    expected = EXPECTED["tokens"][name]
    found = pairs_of(pairs_data / name)
    assert len(found) == len(expected)
    for (chosen, chosen_mask, rejected, rejected_mask), trl in zip(found, expected):
        prompt = trl["prompt_ids"]
        assert chosen.tolist() == prompt + trl["chosen_ids"]
        assert rejected.tolist() == prompt + trl["rejected_ids"]
        assert chosen_mask.tolist() == [0] * len(prompt) + [1] * len(trl["chosen_ids"])
        assert rejected_mask.tolist() == [0] * len(prompt) + [1] * len(trl["rejected_ids"])


def trained(spec_file, tmp_path_factory, pairs_data, steps: int):
    """The spec's program on hf_qwen2_chat with the fixture's PEFT adapter, `steps` steps on all of pairs.jsonl
    at once (TRL's batch of 8: every step sees every pair); the metrics of each step."""
    built = build(spec_file, "cpu-1")
    program_file = tmp_path_factory.mktemp("program") / "preference.py"
    write_atomically(program_file, built.source)
    module = load_program(program_file)
    program = Program.from_module(module)
    params = hf_to_params(QWEN / "model.safetensors", built.spec)
    if program.has_frozen and not program.reference_copy:  # F.lora: PEFT's adapter
        params = joined(params, peft.read_adapter(PAIRS / "adapter", built.spec))
    state = program.state_from_params(params)
    split = dataset.PackedSplit(pairs_data / "pairs.jsonl", "train", program.config["seq_len"])
    windows = [split.window(i) for i in range(len(split))]
    batch = [jnp.asarray(np.stack(part)) for part in zip(*windows)]
    batch.append(jnp.asarray(np.stack([split.mask_window(i) for i in range(len(split))])))
    step, history = jax.jit(module.train_step), []
    for _ in range(steps):
        state, metrics = step(state, *batch)
        history.append({name: float(value) for name, value in metrics.items()})
    return dict(module=module, program=program, state=state, history=history, source=built.source)


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, pairs_data):
    return trained(
        FIXTURES / "preference_spec.py", tmp_path_factory, pairs_data, len(EXPECTED["dpo"]["steps"])
    )


def test_dpo_steps_equal_trls_loss_and_six_metrics(dpo_run):
    for step, (found, trl) in enumerate(zip(dpo_run["history"], EXPECTED["dpo"]["steps"], strict=True)):
        for name in METRICS:  # measured: within 1.2e-5 of TRL's, relative
            assert found[name] == pytest.approx(trl[name], rel=5e-5, abs=2e-6), f"step {step}: {name}"
    first = dpo_run["history"][0]
    assert first["rewards/margins"] != 0, "the fixture's adapter starts away from the base: a real first step"


def test_dpo_reference_is_the_base_and_only_adapters_train(dpo_run):
    source, state = dpo_run["source"], dpo_run["state"]
    assert "base = runtime.adapters_off(params, PARAMS)" in source
    assert "jax.lax.stop_gradient(completion_logps(base" in source
    assert '"objective": "dpo"' in source and '"beta": 0.1' in source
    assert all(
        "lora" in jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(state["params"])
    )
    assert "reference" not in state["frozen"]


def test_a_full_dpo_run_on_8_devices_resumes_on_its_reference_and_still_equals_trl(tmp_path, pairs_data):
    """The command-line path: convert-hf, 3 steps sharded over 8 devices, a resume to 5 that reloads the reference
    from the recorded --init-from (checkpoints hold no reference) with an evaluation; TRL's losses throughout.
    """
    spec_file = tmp_path / "full.py"
    spec_file.write_text(
        "from axgen.spec import features as F\n"
        "from tests.fixtures.preference_spec import spec as base\n"
        "spec = base.replace(\n"
        "    features=[*base.features[:2], F.dpo(beta=0.1)],\n"
        "    train=base.train.replace(optimizer=base.train.optimizer.replace(lr=1e-3, weight_decay=0.0)),\n"
        '    targets=["cpu-8"],\n'
        ")\n"
    )
    assert axgen(["convert-hf", str(spec_file), "--hf", str(QWEN), "--out", str(tmp_path / "ckpt")]) == 0
    assert axgen(["build", str(spec_file), "--target", "cpu-8", "--out", str(tmp_path / "program.py")]) == 0
    run = ["--data", pairs_data / "pairs.jsonl", "--run-dir", tmp_path / "run", "--log-every", 1]
    first = run_in_process(tmp_path / "program.py", *run, "--steps", 3, "--init-from", tmp_path / "ckpt")
    assert data(tmp_path, PAIRS / "pairs.jsonl", "--out", tmp_path / "e", "--eval-fraction", "0.5") == 0
    evaluated = ["--eval-data", tmp_path / "e", "--eval-every", 5]
    resumed = run_in_process(tmp_path / "program.py", *run, "--steps", 5, *evaluated)
    assert first.returncode == 0 and resumed.returncode == 0, first.stderr + resumed.stderr
    assert "resumed from step 3" in resumed.stdout and "| pairs 8" in resumed.stdout
    export = [
        "export-hf",
        spec_file,
        "--ckpt",
        tmp_path / "run",
        "--out",
        tmp_path / "hf",
        "--tokenizer",
        QWEN,
    ]
    assert axgen([str(a) for a in export]) == 0, "a DPO spec exports as its family's model"
    source = (tmp_path / "program.py").read_text()
    assert 'base = params["reference"]' in source and '"reference": "copy"' in source
    state = checkpoints.read_on_host(tmp_path / "run/checkpoints/5/state")
    assert set(state) == {"step", "params", "opt_state"}, "the reference is not checkpointed"
    logged = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    found = {entry["step"]: entry for entry in logged if "loss" in entry}
    for step, trl in enumerate(EXPECTED["dpo_full"]["steps"][:5], 1):
        for name in METRICS:
            assert found[step][name] == pytest.approx(trl[name], rel=5e-5, abs=2e-6), f"step {step}: {name}"


def test_simpo_steps_equal_trls(tmp_path_factory, pairs_data):
    expected = EXPECTED["simpo"]["steps"]
    run = trained(FIXTURES / "preference_simpo_spec.py", tmp_path_factory, pairs_data, len(expected))
    for step, (found, trl) in enumerate(zip(run["history"], expected, strict=True)):
        for name in METRICS:  # measured: within 1.2e-5 of TRL's, relative
            assert found[name] == pytest.approx(trl[name], rel=5e-5, abs=2e-6), f"step {step}: {name}"


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "What is 1 plus 1?", "rejected": "3"}, 'no "chosen" (keys: prompt, rejected)'),
        ({"prompt": "What is 1 plus 1?", "chosen": "", "rejected": "3"}, '"chosen" is empty'),
        ({"prompt": "What is 1 plus 1?", "chosen": " ", "rejected": "3"}, '"chosen" is empty'),
        ({"prompt": [{"role": "user", "content": "1 plus 1?"}], "chosen": [], "rejected": []}, "is empty"),
        (
            {"prompt": "What is 1 plus 1?", "chosen": "2", "rejected": "2"},
            '"chosen" and "rejected" are the same',
        ),
        (
            {"prompt": [{"role": "user", "content": "1 plus 1?"}], "chosen": "2", "rejected": "3"},
            '"chosen" is not a list of messages, as "prompt" is',
        ),
        (
            {
                "prompt": [{"role": "user", "content": "1 plus 1?"}],
                "chosen": [{"role": "robot", "content": "2"}],
                "rejected": [{"role": "assistant", "content": "3"}],
            },
            'prompt + chosen: message 1 has role "robot"',
        ),
        ([1, 2], "not an object with prompt, chosen and rejected"),
    ],
)
def test_bad_pairs_are_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, record, message):
    (tmp_path / "pairs.jsonl").write_text(
        json.dumps({"prompt": "2 plus 2?", "chosen": "4", "rejected": "5"}) + "\n" + json.dumps(record) + "\n"
    )
    assert data(tmp_path, tmp_path / "pairs.jsonl", "--out", tmp_path / "d") == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"axgen: error: {tmp_path / 'pairs.jsonl'}:2: ") and message in error
    assert "\n" not in error and not (tmp_path / "d").exists()


def test_a_prompt_longer_than_max_len_is_refused_and_a_long_pair_left_out(tmp_path, capsys):
    long = {"prompt": "What is 1 plus 1? " * 20, "chosen": "2", "rejected": "3"}
    (tmp_path / "long.jsonl").write_text(json.dumps(long) + "\n")
    assert data(tmp_path, tmp_path / "long.jsonl", "--out", tmp_path / "d", "--max-len", "64") == 2
    assert "its prompt of" in capsys.readouterr().err and not (tmp_path / "d").exists()
    # Fits alone, not twice: left out and counted, as --chat's --max-len leaves out a conversation.
    assert (
        data(
            tmp_path,
            PAIRS / "pairs.jsonl",
            "--out",
            tmp_path / "d",
            "--max-len",
            "120",
            "--eval-fraction",
            "0",
        )
        == 0
    )
    manifest = json.loads((tmp_path / "d/manifest.json").read_text())
    assert manifest["format"] == dataset.PAIRS_FORMAT
    assert manifest["pairs"]["pairs"] + manifest["pairs"]["dropped_too_long"] == 8
    assert manifest["pairs"]["dropped_too_long"] > 0
    assert all(len(c) + len(r) <= 120 for c, _, r, _ in pairs_of(tmp_path / "d"))


def test_pairs_flags_that_do_not_apply_are_refused(tmp_path, capsys):
    for flag in ("--chat", "--doc-per-line"):
        assert data(tmp_path, PAIRS / "pairs.jsonl", "--out", tmp_path / "d", flag) == 2
        assert f"{flag} is not for --pairs" in capsys.readouterr().err


@pytest.mark.parametrize(
    "features, message",
    [
        ("[F.dpo(beta=0.0)]", "DPO.beta=0.0 must be > 0"),
        ("[F.dpo(beta=-1.0)]", "DPO.beta=-1.0 must be > 0"),
        ("[F.simpo(gamma=-0.5)]", "SimPO.gamma=-0.5 must be >= 0"),
        ("[F.dpo(), F.simpo()]", "F.dpo and F.simpo are two losses; keep one"),
        ("[F.lora(rank=4, alpha=8, dropout=1.0), F.dpo()]", "LoRA.dropout=1.0 must be >= 0 and < 1"),
        ("[F.lora(rank=4, alpha=8, dropout=-0.1), F.dpo()]", "LoRA.dropout=-0.1 must be >= 0 and < 1"),
    ],
)
def test_bad_preference_specs_are_refused(tmp_path, features, message):
    """Bad post-training settings, F.lora's included, are spec errors naming the field and value."""
    spec_file = tmp_path / "spec.py"
    spec_file.write_text(
        "from axgen.spec import features as F\n"
        "from tests.fixtures.preference_spec import spec as base\n"
        f"spec = base.replace(features=[*base.features[:2], *{features}])\n"
    )
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_spec(spec_file)


def test_a_program_refuses_a_dataset_of_the_other_kind(tmp_path, dpo_run, pairs_data):
    """A DPO program given text, and a next-token program given pairs: refused before jax starts, exit 2."""
    from axgen.runtime.run import open_data, parse_args

    program = dpo_run["program"]
    text = tmp_path / "text.txt"
    text.write_text("2 plus 2 is 4.\n" * 50)
    assert (
        axgen(["data", str(text), "--tokenizer", str(QWEN / "tokenizer.json"), "--out", str(tmp_path / "t")])
        == 0
    )
    args = parse_args(program, ["--data", str(tmp_path / "t"), "--run-dir", str(tmp_path / "r")])
    with pytest.raises(
        dataset.DatasetError, match="holds no preference pairs, and preference-qwen trains dpo"
    ):
        open_data(program, args)
    args = parse_args(
        program, ["--data", str(pairs_data / "pairs.jsonl"), "--run-dir", "r", "--no-document-mask"]
    )
    with pytest.raises(dataset.DatasetError, match="--no-document-mask: .* holds preference pairs"):
        open_data(program, args)
    spec_file = tmp_path / "sft.py"
    spec_file.write_text(
        "from tests.fixtures.preference_spec import spec as base\n"
        "spec = base.replace(features=base.features[:3])\n"
    )
    plain = Program.from_module(load_program(_built(tmp_path, spec_file)))
    args = parse_args(plain, ["--data", str(pairs_data / "pairs.jsonl"), "--run-dir", "r"])
    with pytest.raises(
        dataset.DatasetError, match="holds preference pairs, which a program trains only with F.dpo"
    ):
        open_data(plain, args)


def test_a_pair_longer_than_the_window_is_refused_naming_the_max_len(pairs_data):
    with pytest.raises(
        dataset.DatasetError, match=r"longer than a window of seq_len \+ 1 = 65 tokens .*--max-len 65"
    ):
        dataset.PackedSplit(pairs_data / "pairs.jsonl", "train", 64)


def _built(tmp_path, spec_file):
    path = tmp_path / "program.py"
    write_atomically(path, build(spec_file, "cpu-1").source)
    return path


def test_dpo_counts_its_reference_forward_in_the_flops_per_token(tmp_path):
    """A training step is 6 FLOPs per multiply-add of the weights (2 forward, 4 backward) and attention likewise;
    DPO's reference adds a forward pass, 2 more: a full DPO step is 8/6 of the plain step. With LoRA the reference
    is the frozen base forward with the adapters (zero) still multiplied: a third of the plain step, and 2 per
    adapter weight."""
    import math

    def built(features: str):
        spec_file = tmp_path / "spec.py"
        spec_file.write_text(
            "from axgen.spec import features as F\n"
            "from tests.fixtures.preference_spec import spec as base\n"
            f"spec = base.replace(features=[*base.features[:2], {features}])\n"
        )
        return build(spec_file, "cpu-1")

    def flops(features: str) -> int:
        (line,) = [line for line in built(features).source.splitlines() if '"flops_per_token":' in line]
        return int(line.split(":")[1].split(",")[0])

    plain, full_dpo = flops(""), flops("F.dpo()")
    lora, lora_dpo = flops("F.lora(rank=4, alpha=8)"), flops("F.lora(rank=4, alpha=8), F.dpo()")
    graph = built("F.lora(rank=4, alpha=8)").graph
    adapter_weights = sum(
        graph.regions[node.region].repeat * math.prod(p.shape)
        for node in graph.nodes()
        for p in node.params.values()
        if p.adapter
    )
    assert abs(full_dpo - plain * 8 / 6) <= 1, (plain, full_dpo)
    assert lora < plain and abs(lora_dpo - lora - (plain / 3 + 2 * adapter_weights)) <= 2, (
        plain,
        lora,
        lora_dpo,
    )
