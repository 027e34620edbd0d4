"""How a model trains: sequence length, batch, steps, and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from axgen.spec.validation import SpecNode


@dataclass(frozen=True, kw_only=True)
class AdamW(SpecNode):
    """AdamW with linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""

    lr: float
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1

    def validate(self) -> None:
        self.require_positive("lr", "eps")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                self.fail(name, "must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            self.fail("min_lr_ratio", "must be in [0, 1]")
        if self.weight_decay < 0:
            self.fail("weight_decay", "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Train(SpecNode):
    seq_len: int
    global_batch: int
    steps: int = 1000
    optimizer: AdamW = field(default_factory=lambda: AdamW(lr=3e-4))
    warmup_steps: int = 100
    grad_clip: float | None = 1.0
    seed: int = 0
    checkpoint_every: int = 100

    def validate(self) -> None:
        self.require_positive("seq_len", "global_batch", "steps", "checkpoint_every")
        # The program seeds jax.random.key (32 bits without x64) and numpy's default_rng (no negatives) with it.
        if not 0 <= self.seed < 2**32:
            self.fail("seed", "must be in [0, 2**32)")
        if not 0 <= self.warmup_steps < self.steps:
            self.fail("warmup_steps", f"must be in [0, steps={self.steps})")
        if self.grad_clip is not None and self.grad_clip <= 0:
            self.fail("grad_clip", "must be > 0 (or None for no clipping)")
