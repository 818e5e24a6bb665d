"""Token sampling: greedy, temperature, top-k, top-p, banned tokens, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no limit
    top_p: float = 1.0
    seed: int | None = None
    banned_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


class Sampler:
    """Samples from one request's logits; its own generator makes a seeded request reproducible."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = logits.float().clone()
        if p.banned_token_ids:
            logits[list(p.banned_token_ids)] = float("-inf")
        if p.temperature == 0:
            return int(logits.argmax())
        logits /= p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            outside = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[outside] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
