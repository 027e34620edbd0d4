"""Bad specs and bad commands: one line naming the field, the value and the spec file:line; exit 2; no output."""

import os
import re
import subprocess
import sys

import pytest

from axgen.cli import main as axgen
from axgen.loader import load_spec
from axgen.spec import SpecError
from tests.conftest import ROOT

GOOD = """\
from axgen.spec import MLP, AdamW, Attention, Decoder, Model, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="bad-model",
    vocab_size=256,
    d_model=64,
    decoder=Decoder(
        num_layers=2,
        attention=Attention(num_heads=4, num_kv_heads=2, head_dim=16),
        mlp=MLP(hidden_dim=128, activation="swiglu"),
        norm=RMSNorm(eps=1e-5),
    ),
    features=[F.rope(theta=10_000.0)],
    train=Train(seq_len=32, global_batch=8, steps=100, warmup_steps=10),
    targets=["cpu-8"],
)
"""

# (name, text to replace, replacement, line of the offending object, expected message after "file:line: ")
BAD_SPECS = [
    (
        "kv_heads",
        "num_kv_heads=2",
        "num_kv_heads=3",
        10,
        "Attention.num_kv_heads=3 does not divide num_heads=4",
    ),
    (
        "activation",
        '"swiglu"',
        '"swigle"',
        11,
        "MLP.activation='swigle' is not one of swiglu, gelu; did you mean 'swiglu'?",
    ),
    ("type", "num_layers=2", 'num_layers="2"', 8, "Decoder.num_layers='2' must be an int"),
    ("eps", "eps=1e-5", "eps=-1.0", 12, "RMSNorm.eps=-1.0 must be > 0"),
    ("nan", "eps=1e-5", 'eps=float("nan")', 12, "RMSNorm.eps=nan must be a finite number"),
    ("inf", "theta=10_000.0", 'theta=float("inf")', 14, "RoPE.theta=inf must be a finite number"),
    ("exit", "spec = Model(", "import sys\nsys.exit(3)\nspec = Model(", 5, "SystemExit: 3"),
    (
        "unknown_field",
        "num_heads=4,",
        "num_head=4,",
        10,
        "Attention has no field 'num_head'; did you mean 'num_heads'?",
    ),
    (
        "odd_head_dim",
        "head_dim=16",
        "head_dim=15",
        10,
        "Attention.head_dim=15 must be even for rope (it rotates pairs of channels)",
    ),
    ("warmup", "warmup_steps=10", "warmup_steps=100", 15, "Train.warmup_steps=100 must be in [0, steps=100)"),
    (
        "duplicate_feature",
        "features=[F.rope(theta=10_000.0)]",
        "features=[F.rope(theta=1.0), F.rope(theta=2.0)]",
        14,
        "Model.features has 'rope' twice (first at specs/bad_duplicate_feature.py:14)",
    ),
    (
        "name",
        'name="bad-model"',
        'name="Bad Model"',
        4,
        "Model.name='Bad Model' must be lower-case letters, digits, '.', '_' or '-'",
    ),
    (
        "unknown_feature_arg",
        "F.rope(theta=10_000.0)",
        "F.rope(thetta=1.0)",
        14,
        "RoPE has no field 'thetta'; did you mean 'theta'?",
    ),
    (
        "moe_top_k",
        "F.rope(theta=10_000.0)",
        "F.moe(num_experts=4, top_k=5, renormalize=True, aux_loss_weight=0.01, router_z_loss_weight=0.0)",
        14,
        "MoE.top_k=5 must be <= num_experts=4",
    ),
    (
        "moe_required",
        "F.rope(theta=10_000.0)",
        "F.moe(num_experts=4)",
        14,
        "MoE needs 'top_k', 'renormalize' (they have no default; Hugging Face configs give top_k: "
        "num_experts_per_tok, renormalize: norm_topk_prob (Mixtral: true))",
    ),
    (
        "moe_weights_to_train",
        "F.rope(theta=10_000.0)",
        "F.moe(num_experts=4, top_k=2, renormalize=True)",
        14,
        "MoE.aux_loss_weight=None is needed to train (the model has a Train block); 0.0 turns the loss off",
    ),
    (
        "rope_theta",
        "F.rope(theta=10_000.0)",
        "F.rope()",
        14,
        "RoPE needs 'theta' (they have no default; Hugging Face configs give theta: rope_theta "
        "(transformers 5: rope_parameters.rope_theta))",
    ),
    ("qk_norm_eps", "F.rope(theta=10_000.0)", "F.qk_norm()", 14, "QKNorm needs 'eps' (they have no default)"),
    (
        "window_global_every",
        "F.rope(theta=10_000.0)",
        "F.sliding_window(window=8, global_every=3)",
        14,
        "SlidingWindow.global_every=3 is more than Decoder.num_layers=2",
    ),
    (
        "softcap_nothing",
        "F.rope(theta=10_000.0)",
        "F.softcap()",
        14,
        "SoftCap.attention=None and SoftCap.final are both None: cap at least one of them",
    ),
    (
        "remat_policy",
        "F.rope(theta=10_000.0)",
        'F.remat(policy="ful")',
        14,
        "Remat.policy='ful' is not one of none, full, save_dots, save_dots_except_mlp, save_qkv_proj, "
        "save_out_proj, offload_dots; did you mean 'full'?",
    ),
    (
        "quantize_dtype",
        "F.rope(theta=10_000.0)",
        'F.quantize(dtype="int4")',
        14,
        "Quantize.dtype='int4' is not one of int8, fp8; did you mean 'int8'?",
    ),
    (
        "quantize_regex",
        "F.rope(theta=10_000.0)",
        'F.quantize(include="layers/(q")',
        14,
        "Quantize.include='layers/(q' is not a regular expression (missing ), unterminated subpattern at position 7)",
    ),
    ("seed", "warmup_steps=10", "warmup_steps=10, seed=-1", 15, "Train.seed=-1 must be in [0, 2**32)"),
    (
        "name_newline",
        'name="bad-model"',
        'name="bad-model\\n"',
        4,
        "Model.name='bad-model\\n' must be lower-case letters, digits, '.', '_' or '-'",
    ),
    (
        "targets_type",
        'targets=["cpu-8"]',
        'targets="cpu-8"',
        4,
        "Model.targets='cpu-8' must be a list of str",
    ),
    (
        "origin",
        "F.rope(theta=10_000.0)",
        "F.rope(theta=10_000.0, origin=3)",
        14,
        "RoPE.origin=3 is where axgen records the line that built the object; a spec does not set it",
    ),
    (
        "unknown_feature",
        "F.rope(theta=10_000.0)",
        "F.rpoe(theta=10_000.0)",
        14,
        "features has no 'rpoe'; did you mean 'rope'?",
    ),
    (
        "positional",
        "F.rope(theta=10_000.0)",
        "F.rope(10_000.0)",
        14,
        "RoPE was given too many positional arguments (1, it takes 0); name its fields: theta, scaling, local_theta, rotary_dim, interleaved",
    ),
]


def write_spec(tmp_path, name, text):
    path = tmp_path / "specs" / f"bad_{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(("name", "old", "new", "line", "message"), BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_spec_gives_one_line_with_file_and_line(tmp_path, name, old, new, line, message):
    assert old in GOOD
    path = write_spec(tmp_path, name, GOOD.replace(old, new, 1))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value) == f"specs/bad_{name}.py:{line}: {message}"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "gpu-a100-8",
            "unknown target 'gpu-a100-8'; known targets: cpu-N, tpu-v5e-N[xS], tpu-v5p-N[xS], tpu-v6e-N[xS], gpu-h100-N, trn2-N",
        ),
        (
            "cpu-16",
            "Train.global_batch=8 is not divisible by the 16 batch shards (data x fsdp x expert) of target cpu-16",
        ),
    ],
)
def test_build_for_a_bad_target_exits_2_without_output(tmp_path, capsys, target, message):
    path = write_spec(tmp_path, "target", GOOD)
    out = tmp_path / "out.py"
    assert axgen(["build", str(path), "--target", target, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(message) and len(err.splitlines()) == 1
    assert not out.exists() and list(tmp_path.glob("**/*.tmp")) == []


def test_build_of_a_missing_file_exits_2(tmp_path, capsys):
    assert (
        axgen(["build", str(tmp_path / "nope.py"), "--target", "cpu-1", "--out", str(tmp_path / "o.py")]) == 2
    )
    assert capsys.readouterr().err.strip() == f"axgen: error: {tmp_path / 'nope.py'}: no such spec file"
    assert not (tmp_path / "o.py").exists()


def test_a_bundled_spec_is_named_without_its_path(tmp_path, capsys):
    out = tmp_path / "o.py"
    assert axgen(["build", "llama_tiny", "--target", "cpu-1", "--out", str(out)]) == 0
    assert "# Regenerate: axgen build llama_tiny --target cpu-1" in out.read_text()
    by_module = (
        tmp_path / "m.py"
    )  # or by its module's dotted path, as `from axgen.specs.llama_tiny import spec`
    assert axgen(["build", "axgen.specs.llama_tiny", "--target", "cpu-1", "--out", str(by_module)]) == 0
    assert by_module.read_text() == out.read_text()
    capsys.readouterr()
    assert axgen(["build", "lama_tiny", "--target", "cpu-1", "--out", str(tmp_path / "p.py")]) == 2
    assert capsys.readouterr().err == (
        "axgen: error: lama_tiny: no such spec file, nor a bundled spec's name; did you mean 'llama_tiny'?\n"
    )
    assert not (tmp_path / "p.py").exists()


def test_build_of_a_file_without_spec_exits_2(tmp_path, capsys):
    path = write_spec(tmp_path, "nospec", "model = 3\n")
    assert axgen(["build", str(path), "--target", "cpu-1", "--out", str(tmp_path / "o.py")]) == 2
    assert capsys.readouterr().err.strip() == (
        "axgen: error: specs/bad_nospec.py: must bind `spec` to an axgen.spec.Model, found nothing"
    )
    assert not (tmp_path / "o.py").exists()


def test_error_raised_by_user_code_names_its_line(tmp_path):
    path = write_spec(tmp_path, "raises", "x = 1\nspec = 1 / 0\n")
    with pytest.raises(SpecError, match=r"^specs/bad_raises.py:2: ZeroDivisionError: division by zero$"):
        load_spec(path)


def test_replace_with_unknown_field_names_the_calling_line(tmp_path):
    path = write_spec(tmp_path, "replace", GOOD + "spec = spec.replace(nmae='x')\n")
    with pytest.raises(
        SpecError, match=r"^specs/bad_replace.py:18: Model has no field 'nmae'; did you mean 'name'\?$"
    ):
        load_spec(path)


def test_a_spec_outside_the_repo_derives_from_one_beside_it(tmp_path):
    """Spec files anywhere import their neighbours, as specs/ do, and derive with replace."""
    folder = tmp_path / "my_models"
    folder.mkdir()
    (folder / "base.py").write_text(GOOD.replace('name="bad-model"', 'name="my-base"'))
    (folder / "wider.py").write_text(
        "from base import spec as base\n"
        "from axgen.spec import features as F\n"
        "spec = base.replace(name='my-wider', d_model=128, features=[*base.features, F.qk_norm(eps=1e-6)])\n"
    )
    spec = load_spec(folder / "wider.py")
    assert (spec.name, spec.d_model, spec.decoder.num_layers) == ("my-wider", 128, 2)
    assert [f.pass_name for f in spec.features] == ["rope", "qk_norm"]
    assert spec.origin.file.endswith("my_models/wider.py") and spec.origin.line == 3


def test_gemma_block_needs_a_gated_mlp(tmp_path):
    text = GOOD.replace('activation="swiglu"', 'activation="gelu"').replace(
        "features=[F.rope(theta=10_000.0)]", "features=[F.rope(theta=10_000.0), F.gemma_block()]"
    )
    path = tmp_path / "specs" / "bad_gemma.py"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(
        SpecError, match=r"^specs/bad_gemma.py:11: MLP.activation='gelu' must be swiglu for gemma"
    ):
        load_spec(path)


def test_a_spec_anywhere_derives_from_a_bundled_one_through_axgen_specs(tmp_path):
    """`axgen.specs` is installed with axgen: no PYTHONPATH, no checkout on sys.path, any working directory."""
    (tmp_path / "long_llama.py").write_text(
        "from axgen.specs.llama3_8b import spec as llama3\n"
        "spec = llama3.replace(name='long-llama', train=llama3.train.replace(seq_len=16_384))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-m", "axgen.cli", "graph", "long_llama.py", "--target", "cpu-8", "--after", "spec"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("graph long-llama\n")


def test_a_spec_file_must_be_python(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(GOOD)
    with pytest.raises(SpecError, match=r"model.yaml: a spec file is Python and ends in \.py$"):
        load_spec(path)


def test_build_out_names_one_program(tmp_path, capsys):
    spec = tmp_path / "two_targets.py"
    spec.write_text(GOOD.replace('targets=["cpu-8"]', 'targets=["cpu-8", "cpu-1"]'))
    assert axgen(["build", str(spec), "--out", str(tmp_path / "p.py")]) == 2
    assert "declares 2 targets: pick one with --target" in capsys.readouterr().err
    assert axgen(["build", "--all", "--out", str(tmp_path / "p.py")]) == 2
    assert "--all writes each into generated/" in capsys.readouterr().err
    assert not (tmp_path / "p.py").exists()
    assert axgen(["build", str(spec), "--target", "cpu-1", "--out", str(tmp_path / "p.py")]) == 0
    assert (tmp_path / "p.py").stat().st_mode & 0o777 == 0o644, "as readable as any source file"


def test_specs_lists_the_bundled_specs_and_targets_only_the_rules_of_each_family(capsys):
    assert axgen(["specs"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == sorted(p.stem for p in (ROOT / "axgen/specs").glob("*.py") if p.stem != "__init__")
    assert axgen(["targets"]) == 0
    families = re.split(r"^(?=\S)", capsys.readouterr().out, flags=re.MULTILINE)
    v6e = next(f for f in families if f.startswith("tpu-v6e-N"))
    v5p = next(f for f in families if f.startswith("tpu-v5p-N"))
    assert "tpu-v5p-" not in v6e and "tpu-v5e-256" not in v6e and "tpu-v.*" in v6e
    assert "tpu-v5p-(512|1024)" in v5p and "tpu-v5e-256" not in v5p
    assert all(len(f.splitlines()) > 1 for f in families if f), "every family shows its rules"


def test_version(capsys):
    from axgen import __version__

    with pytest.raises(SystemExit) as exited:
        axgen(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"axgen {__version__}\n"


def test_the_command_line_imports_no_heavy_library_until_a_command_needs_it():
    """`axgen --help`, `--version`, `targets` and `specs` answer without jax, the templates' printer or the data
    tools (each command imports what it uses)."""
    heavy = ["jax", "matplotlib", "tokenizers", "pyarrow", "orbax", "libcst", "black", "jinja2"]
    code = (
        "import sys, contextlib, io\n"
        "from axgen.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['targets']) == 0 and main(['specs']) == 0\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"
