"""A shadow made wrong on purpose, for tests and benchmarks (the `emulation` section, never a
product setting): `MadeWrong(emulation, num_experts, vocab_size, rng)` replaces each predicted
expert with probability `inject_wrong` by a wrong one (`experts`), and the shadow's own next token
with probability `inject_wrong_token` by any other (`token`), drawing from the shadow's seeded
`rng`. Both off (0) leave everything as the model computed it. Main's tokens never change either way.
"""

from __future__ import annotations

import random

from odmoe.shadow.router_tap import wrong_experts


class MadeWrong:
    def __init__(self, emulation, num_experts: int, vocab_size: int, rng: random.Random):
        self.wrong, self.wrong_token = emulation.inject_wrong, emulation.inject_wrong_token
        self.num_experts, self.vocab_size, self.rng = num_experts, vocab_size, rng

    def experts(self, experts: list[int]) -> list[int]:
        if self.wrong <= 0:
            return experts
        return wrong_experts(experts, self.wrong, self.num_experts, self.rng)

    def token(self, token: int) -> int:
        if self.wrong_token > 0 and self.rng.random() < self.wrong_token:
            return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return token
