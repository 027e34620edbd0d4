"""moe_tiny with remat and quantization too: every feature pass in one small model, for the tests and as a sample.

Quantization leaves the dtype to the target: int8 on CPU and TPU, fp8 on H100.
"""

from axgen.spec import features as F
from specs.moe_tiny import spec as moe_tiny

spec = moe_tiny.replace(
    name="features-tiny",
    features=[*moe_tiny.features, F.remat(policy="save_dots"), F.quantize()],
    targets=["cpu-1", "tpu-v5e-8", "gpu-h100-8"],
)
