"""RoPE on the last `rotary_dim` channels of each head and in the interleaved convention (adjacent pairs), as
transformers' deepseek_v2 rotates q_pe and k_pe: the program's rope against transformers' own values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from axgen.cli import main as axgen
from axgen.hf.export import hf_config
from axgen.interop import CheckpointError
from axgen.spec import SpecError
from axgen.loader import load_spec
from axgen.runtime.rotary import rope

FIXTURE = Path(__file__).parent / "fixtures" / "hf_deepseek_v2_rope.npz"
ROTARY = 8


@pytest.mark.parametrize("case", ["default", "yarn"])
def test_sliced_interleaved_rope_equals_transformers_deepseek_v2(case):
    fixture = np.load(FIXTURE)
    config = json.loads(str(fixture[f"{case}/config"]))
    scaling = None
    if config["rope_type"] == "yarn":
        mscale = lambda m: 0.1 * m * math.log(config["factor"]) + 1.0  # transformers' get_mscale, factor > 1
        scaling = {
            "rule": "yarn",
            "factor": config["factor"],
            "beta_fast": config["beta_fast"],
            "beta_slow": config["beta_slow"],
            "original_max_position": config["original_max_position_embeddings"],
            "attention_factor": mscale(config["mscale"]) / mscale(config["mscale_all_dim"]),
            "truncate": True,
        }
    x, positions = jnp.asarray(fixture["x"]), jnp.asarray(fixture["positions"])
    got = rope(x, positions, theta=10000.0, scaling=scaling, rotary_dim=ROTARY, interleaved=True)
    np.testing.assert_allclose(got, fixture[f"{case}/out"], atol=1e-5)
    # the rotate-half convention on the same channels is a different function: the layout is not a no-op
    halves = rope(x, positions, theta=10000.0, scaling=scaling, rotary_dim=ROTARY, interleaved=False)
    assert np.abs(np.asarray(halves) - fixture[f"{case}/out"]).max() > 1e-2


def test_the_rope_pass_states_the_layout_in_the_graph(tmp_path, capsys):
    spec = tmp_path / "sliced.py"
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        "features = [f for f in tiny.features if f.pass_name != 'rope']\n"
        "spec = tiny.replace(features=[*features, F.rope(theta=10_000.0, rotary_dim=8, interleaved=True)])\n"
    )
    assert axgen(["graph", str(spec), "--target", "cpu-1", "--after", "lowering"]) == 0
    out = capsys.readouterr().out
    assert out.count("theta=10000.0 rotary_dim=8 interleaved=True") == 2, out  # q's rope and k's


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            "F.rope(theta=1e4, rotary_dim=7)",
            "RoPE.rotary_dim=7 must be even (rope rotates pairs of channels)",
        ),
        ("F.rope(theta=1e4, rotary_dim=0)", "RoPE.rotary_dim=0 must be > 0"),
        ("F.rope(theta=1e4, rotary_dim=32)", "RoPE.rotary_dim=32 is more than the heads' head_dim=16"),
    ],
)
def test_a_rotary_dim_rope_cannot_honour_is_one_line(rope, message, tmp_path):
    spec = tmp_path / "specs" / "bad_rotary.py"
    spec.parent.mkdir()
    spec.write_text(
        "from axgen.spec import MLP, Attention, Decoder, Model, RMSNorm\nfrom axgen.spec import features as F\n"
        "spec = Model(\n    name='bad', vocab_size=256, d_model=64,\n    decoder=Decoder(num_layers=2, "
        "attention=Attention(num_heads=4, num_kv_heads=2, head_dim=16), mlp=MLP(hidden_dim=128, "
        f"activation='swiglu'), norm=RMSNorm(eps=1e-5)),\n    features=[{rope}], targets=['cpu-1'],\n)\n"
    )
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    assert str(err.value).endswith(message), str(err.value)


def test_export_refuses_a_rope_layout_no_exported_family_states(tmp_path):
    """No family axgen exports (Llama, Qwen, Mistral, Gemma) rotates part of a head or adjacent pairs: writing
    one of their configs for such a spec would load in transformers with other logits."""
    spec = tmp_path / "sliced.py"
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        "features = [f for f in tiny.features if f.pass_name != 'rope']\n"
        "spec = tiny.replace(features=[*features, F.rope(theta=10_000.0, interleaved=True)])\n"
    )
    with pytest.raises(
        CheckpointError, match=r"RoPE.rotary_dim=None, interleaved=True: no family axgen exports"
    ):
        hf_config(load_spec(spec), "float32")
