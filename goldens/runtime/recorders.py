"""What OLMo-core draws at random inside a forward, recorded so that a golden can hold it."""

from __future__ import annotations


class PoolRecorder:
    """Records what an `EmoRouterV2` draws in one forward: the RNG state a pre-hook saw (replayed
    into OLMo-core's per-document draw tensor) and the per-token pools `_pool_sizes` returned."""

    def __init__(self, router):
        import torch

        self.states, self.pools = [], []
        router.register_forward_pre_hook(lambda m, args: self.states.append(torch.get_rng_state()))
        original = router._pool_sizes

        def pool_sizes(segment_ids):
            pools = original(segment_ids)
            self.pools.append(pools)
            return pools

        router._pool_sizes = pool_sizes
        self.emo = router.emo

    def draws(self, call: int, shape) -> object:
        """OLMo-core's `torch.randint` draw of forward `call`, replayed from its saved state."""
        import torch

        generator = torch.Generator()
        generator.set_state(self.states[call])
        low, high = self.emo.min_document_expert_pool, self.emo.max_document_expert_pool
        return torch.randint(low, high + 1, shape, generator=generator)
