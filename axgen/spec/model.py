"""The model: the root of a spec, which ties the decoder, training, features and target rules together and checks
each feature against the rest."""

from __future__ import annotations

import re
from dataclasses import dataclass

from axgen.spec.architecture import Decoder
from axgen.spec.feature_configs import Feature
from axgen.spec.targets import MeshRule
from axgen.spec.training import Train
from axgen.spec.validation import SpecError, SpecNode

CHECKPOINT_DTYPES = (None, "bfloat16", "float16", "float32")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True, kw_only=True)
class Model(SpecNode):
    name: str
    vocab_size: int
    d_model: int
    decoder: Decoder
    train: Train | None = None  # needed to build a training program, not to load or run weights
    features: tuple[Feature, ...] = ()
    targets: tuple[str, ...] = ()
    mesh_rules: tuple[MeshRule, ...] = ()  # tried before the backend's rules
    tie_embeddings: bool = False
    # The dtype of the published checkpoint the spec was imported from (its config's torch_dtype): `axgen
    # export-hf` writes the weights back in it unless told otherwise. None: bfloat16.
    checkpoint_dtype: str | None = None
    # The longest sequence the published model was made for (its config's max_position_embeddings), which `axgen
    # export-hf` writes back: training on shorter sequences does not shorten it. None: not stated.
    max_position: int | None = None

    def validate(self) -> None:
        if not _NAME.fullmatch(self.name):  # `$` of re.match would let a trailing newline through
            self.fail("name", "must be lower-case letters, digits, '.', '_' or '-'")
        self.require_positive("vocab_size", "d_model")
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            self.fail("checkpoint_dtype", f"is not one of {', '.join(map(repr, CHECKPOINT_DTYPES))}")
        if self.max_position is not None:
            self.require_positive("max_position")
        if not self.targets:
            self.fail("targets", "must name at least one target, e.g. ['cpu-8']")
        seen: dict[str, Feature] = {}
        for feature in self.features:
            if feature.pass_name in seen:
                raise SpecError(
                    f"{feature.origin}: Model.features has {feature.pass_name!r} twice "
                    f"(first at {seen[feature.pass_name].origin})"
                )
            seen[feature.pass_name] = feature
            feature.check_model(self)

    def feature(self, pass_name: str) -> Feature | None:
        return next((f for f in self.features if f.pass_name == pass_name), None)
