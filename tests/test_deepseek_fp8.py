"""DeepSeek-V3's FP8 checkpoints: import-hf reads their quantization_config (e4m3 blocks, each with a float32
weight_scale_inv) and convert-hf dequantizes them, checked against transformers 5.23 (tests/fixtures/
make_hf_fixtures.py: hf_fp8_blocks.npz and the checkpoint folder hf_deepseek_v3_fp8/)."""

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from tests.conftest import ROOT

from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.hf.export import load_params
from axgen.hf.storage import dequantize_fp8_blocks
from axgen.hf.weights import HFCheckpoint
from axgen.interop import load_program

FIXTURES = ROOT / "tests/fixtures"
FOLDER = FIXTURES / "hf_deepseek_v3_fp8"
SAFETENSORS_DTYPES = {
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.float32): "F32",
    np.dtype(np.uint8): "U8",
}


def save_safetensors(tensors: dict, path: Path) -> None:
    """safetensors' format written by hand: its numpy writer knows no float8."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors.values():
            f.write(np.ascontiguousarray(tensor).tobytes())


def hub_tensors() -> dict[str, np.ndarray]:
    checkpoint = HFCheckpoint(FOLDER)
    return {name: checkpoint[name] for name in checkpoint}


def fused(tensors: dict) -> dict:
    """The checkpoint in transformers 5's fused expert layout: each layer's experts stacked, gate rows over up rows,
    their FP8 codes and their scales alike (the experts' 32 rows are whole blocks of 16, so the grids stack too).
    """
    out = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = tensor
    layers = sorted({name.split(".mlp.experts.")[0] for name in tensors if ".mlp.experts." in name})
    for layer in layers:
        experts = sorted({int(n.split(".")[5]) for n in tensors if n.startswith(f"{layer}.mlp.experts.")})
        for suffix in ("", "_scale_inv"):

            def part(e, projection):
                return tensors[f"{layer}.mlp.experts.{e}.{projection}.weight{suffix}"]

            out[f"{layer}.mlp.experts.gate_up_proj{suffix}"] = np.stack(
                [np.concatenate([part(e, "gate_proj"), part(e, "up_proj")]) for e in experts]
            )
            out[f"{layer}.mlp.experts.down_proj{suffix}"] = np.stack([part(e, "down_proj") for e in experts])
    return out


def folder(tmp_path, tensors: dict, config: dict | None = None) -> Path:
    path = tmp_path / "hub"
    path.mkdir()
    save_safetensors({k: v for k, v in tensors.items() if v is not None}, path / "model.safetensors")
    if config is None:
        shutil.copy(FOLDER / "config.json", path / "config.json")
    else:
        (path / "config.json").write_text(json.dumps(config))
    return path


def imported_spec(tmp_path, capsys) -> Path:
    spec = tmp_path / "spec.py"
    code = axgen(["import-hf", str(FOLDER), "--out", str(spec), "--target", "cpu-1"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    return spec


def convert(capsys, spec: Path, hf: Path, out: Path) -> tuple[int, str]:
    code = axgen(["convert-hf", str(spec), "--hf", str(hf), "--out", str(out)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_fp8_block_dequantization_equals_transformers():
    """hf_fp8_blocks.npz: every finite e4m3 code, scales across 2**-20 .. 2**4, blocks of 16 x 32 partial at both
    edges of a 40 x 72 matrix: transformers' _dequantize_fp8_weight in float32, bit for bit; and its loader's
    Fp8Dequantize on the whole blocks in float32 and bfloat16 (the float32 product rounded), bit for bit."""
    fixture = np.load(FIXTURES / "hf_fp8_blocks.npz")
    codes = fixture["codes"].view(ml_dtypes.float8_e4m3fn)
    block = tuple(int(b) for b in fixture["block"])
    assert block == (16, 32) and codes.shape == (40, 72) and fixture["scale_inv"].shape == (3, 3)
    fp32 = dequantize_fp8_blocks(codes, fixture["scale_inv"], block, np.float32, "w")
    np.testing.assert_array_equal(fp32, fixture["float32"])
    whole = codes[:32, :64], fixture["scale_inv"][:2, :2]
    np.testing.assert_array_equal(
        dequantize_fp8_blocks(*whole, block, np.float32, "w"), fixture["loader_whole_blocks_float32"]
    )
    bf16 = dequantize_fp8_blocks(*whole, block, ml_dtypes.bfloat16, "w")
    np.testing.assert_array_equal(bf16.view(np.int16), fixture["loader_whole_blocks_bfloat16_bits"])


def test_the_spec_says_the_checkpoint_is_fp8_blocks(tmp_path, capsys):
    text = imported_spec(tmp_path, capsys).read_text()
    assert "stores the projections as FP8 (e4m3) in 16 x 32 blocks" in text
    assert "Training does not keep FP8 blocks" in text and "ue8m0" not in text


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_an_fp8_checkpoint_converts_to_transformers_logits(layout, tmp_path, capsys):
    """import-hf, build and convert-hf of hf_deepseek_v3_fp8/ give the logits of transformers' DeepseekV3ForCausalLM
    holding the weights transformers' _dequantize_fp8_weight makes of the blocks (float32), from the Hub's layout
    and from the fused one."""
    spec = imported_spec(tmp_path, capsys)
    tensors = hub_tensors()
    assert sum(t.dtype == ml_dtypes.float8_e4m3fn for t in tensors.values()) == 72
    hf = FOLDER if layout == "hub" else folder(tmp_path, fused(tensors))
    code, output = convert(capsys, spec, hf, tmp_path / "ckpt")
    assert code == 0, output
    write_atomically(tmp_path / "program.py", build(spec, "cpu-1").source)
    program = load_program(tmp_path / "program.py")
    reference = np.load(FOLDER / "reference.npz")
    logits = program.forward(load_params(tmp_path / "ckpt"), reference["input_ids"])
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], atol=1e-4, rtol=1e-4)


Q_A = "model.layers.0.self_attn.q_a_proj.weight"
BAD_CHECKPOINTS = [
    (
        {Q_A + "_scale_inv": np.ones((2, 3), np.float32)},
        None,
        f"tensor {Q_A!r} float8_e4m3fn[24, 64] with {Q_A + '_scale_inv'!r} float32[2, 3] are not FP8 blocks of "
        "16 x 32",
    ),
    (
        {Q_A + "_scale_inv": np.ones((2, 2), np.uint8)},
        None,
        f"{Q_A + '_scale_inv'!r} uint8[2, 2] are not FP8 blocks",
    ),
    ({Q_A: None}, None, f"holds {Q_A + '_scale_inv'!r} without {Q_A!r}, the FP8 weight it scales"),
    ({Q_A + "_scale_inv": None}, None, f"tensor {Q_A!r} is float8_e4m3fn without {Q_A + '_scale_inv'!r}"),
    ({}, {"model_type": "deepseek_v3"}, "states no FP8 quantization_config with a weight_block_size"),
    (
        {Q_A + "_scale_inv": np.full((2, 2), 3e38, np.float32)},
        None,
        f"{Q_A}_scale_inv make",
    ),
]


@pytest.mark.parametrize(
    ("changes", "config", "message"),
    BAD_CHECKPOINTS,
    ids=["grid", "scale_dtype", "no_weight", "no_scale", "no_block_size", "overflow"],
)
def test_bad_fp8_blocks_stop_in_one_line(changes, config, message, tmp_path, capsys):
    spec = imported_spec(tmp_path, capsys)
    hf = folder(tmp_path, hub_tensors() | changes, config)
    code, output = convert(capsys, spec, hf, tmp_path / "ckpt")
    assert code == 2 and message in output and output.count("\n") == 1, output
    assert not (tmp_path / "ckpt").exists()


STORAGE = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
BAD_STORAGE = [
    (
        {"quant_method": "gptq"},
        'quantization_config.quant_method="gptq" is not a storage convert-hf reads (fp8)',
    ),
    ({"fmt": "e5m2"}, 'quantization_config.fmt="e5m2" is not a storage convert-hf reads (e4m3)'),
    ({"activation_scheme": "static"}, 'quantization_config.activation_scheme="static" is not a storage'),
    (
        {"scale_fmt": "float"},
        'quantization_config.scale_fmt="float" is not a storage convert-hf reads (ue8m0)',
    ),
    ({"weight_block_size": [128]}, "quantization_config.weight_block_size=[128] is not [rows, columns]"),
    (
        {"weight_block_size": [128, 0]},
        "quantization_config.weight_block_size=[128, 0] is not [rows, columns]",
    ),
    ({"weight_block_size": None}, "quantization_config.weight_block_size=null is not [rows, columns]"),
    (
        {"modules_to_not_convert": ["lm_head"]},
        'quantization_config.modules_to_not_convert=["lm_head"] is not a key axgen\'s fp8 reading knows',
    ),
]


@pytest.mark.parametrize(("changes", "message"), BAD_STORAGE, ids=[str(list(c)[0]) for c, _ in BAD_STORAGE])
def test_a_quantization_config_other_than_deepseeks_is_refused_in_one_line(
    changes, message, tmp_path, capsys
):
    config = json.loads((FOLDER / "config.json").read_text())
    config["quantization_config"] = STORAGE | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = axgen(["import-hf", str(tmp_path / "config.json"), "--out", str(tmp_path / "spec.py")])
    error = capsys.readouterr().err
    assert code == 2 and f"config.json: {message}" in error and error.count("\n") == 1, error
    assert not (tmp_path / "spec.py").exists()


def test_a_quantization_config_without_a_block_size_is_refused(tmp_path, capsys):
    config = json.loads((FOLDER / "config.json").read_text())
    config["quantization_config"] = {k: v for k, v in STORAGE.items() if k != "weight_block_size"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = axgen(["import-hf", str(tmp_path / "config.json"), "--out", str(tmp_path / "spec.py")])
    error = capsys.readouterr().err
    assert code == 2 and "quantization_config states no weight_block_size" in error and error.count("\n") == 1
    assert not (tmp_path / "spec.py").exists()
