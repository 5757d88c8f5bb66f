"""Goldens: tensors and traces exported by running OLMo-core 3.0.0 itself on a CPU, with a
manifest (producer, command, versions, the CPU, the input goldens by sha256, seeds, config, shapes,
sha256, tolerances, substitutions).
The exporter (`python -m goldens.export`) needs the `goldens` extra; reading goldens does not."""
