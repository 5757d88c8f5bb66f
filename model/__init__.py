"""olmo-parity: the OLMo 3.5 hybrid (KDA + gated attention, latent MoE with EMO pools) in JAX/Flax,
held step for step against OLMo-core 3.0.0 goldens."""
