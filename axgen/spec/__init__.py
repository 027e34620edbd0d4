"""The spec vocabulary: frozen dataclasses that a model spec file builds.

Every object remembers where it was constructed (`origin`, a spec file:line) and validates itself on
construction, so an error reads `specs/x.py:14: Attention.num_kv_heads=5 does not divide num_heads=32`.
Standard library only: spec files import this package and nothing else from axgen.

The package's modules, each importing only those before it: `validation` (what every spec object shares),
`architecture` (the decoder), `training`, `feature_configs` (one per feature pass), `targets` (mesh rules) and
`model` (the root). Everything is imported from here, `from axgen.spec import ...`, so a module may move
without a spec file changing.
"""

from axgen.spec.architecture import ACTIVATIONS, MLP, Attention, Decoder, LayerNorm, RMSNorm
from axgen.spec.feature_configs import (
    AttentionSinks,
    FP8_SCALINGS,
    QUANTIZE_DTYPES,
    REMAT_POLICIES,
    Feature,
    GemmaBlock,
    LinearRopeScaling,
    GptOssExperts,
    LoRA,
    DPO,
    SimPO,
    MLA,
    MoE,
    OutBias,
    QKNorm,
    QKVBias,
    Quantize,
    Remat,
    RematPolicy,
    RoPE,
    RopeScaling,
    SlidingWindow,
    SoftCap,
    YarnRopeScaling,
    features,
)
from axgen.spec.model import Model
from axgen.spec.targets import ATTENTION_KERNELS, COMPUTE_DTYPES, MESH_AXES, STACK_CASTS, MeshRule
from axgen.spec.training import AdamW, Train
from axgen.spec.validation import Origin, SpecError, SpecNode, display_path, suggest

# What `from axgen.spec import *` gives a spec file: the vocabulary. The constants and helpers above it are
# imported by name, by axgen and its tests.
__all__ = [
    "AdamW",
    "Attention",
    "AttentionSinks",
    "Decoder",
    "Feature",
    "GemmaBlock",
    "GptOssExperts",
    "LayerNorm",
    "LinearRopeScaling",
    "LoRA",
    "DPO",
    "SimPO",
    "MLA",
    "MLP",
    "MeshRule",
    "MoE",
    "Model",
    "OutBias",
    "Origin",
    "QKNorm",
    "QKVBias",
    "Quantize",
    "SlidingWindow",
    "SoftCap",
    "RMSNorm",
    "Remat",
    "RoPE",
    "RopeScaling",
    "SpecError",
    "Train",
    "YarnRopeScaling",
    "features",
]
