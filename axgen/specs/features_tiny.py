"""moe_tiny with every other feature too: every feature pass in one small model, for the tests and as a sample.

The MoE gains a gated shared expert; attention gains q/k/v biases, q/k norms, a 64-position window and soft-capped
scores; the layers are Gemma's; the logits are soft-capped. Quantization leaves the dtype to the target: int8 on
CPU and TPU, fp8 on H100.
"""

from axgen.spec import features as F
from axgen.specs.moe_tiny import spec as moe_tiny

rope, moe = moe_tiny.features

spec = moe_tiny.replace(
    name="features-tiny",
    features=[
        rope,
        moe.replace(shared_hidden_dim=128, shared_gate=True),
        F.remat(policy="save_dots"),
        F.quantize(),
        F.qkv_bias(),
        F.qk_norm(eps=1e-6),
        F.sliding_window(window=64),
        F.softcap(attention=50.0, final=30.0),
        F.gemma_block(),
    ],
    targets=["cpu-1", "tpu-v5e-8", "gpu-h100-8"],
)
