"""The library: the OLMo 3.5 hybrid (KDA + gated attention, latent MoE with EMO pools) in JAX/Flax,
its trainer, data and OLMo-core checkpoint conversion, as OLMo-core 3.0.0 computes them. Imports
jax, flax, optax, numpy and the standard library only; `parity/` holds it against `goldens/`."""
