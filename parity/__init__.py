"""The applications that hold `model/` against `goldens/`: the golden trace (`trace`), running the
JAX model on it (`run`, with `faults` for tests), OLMo-core's train module beside it (`lockstep`,
`lockstep_check`), comparing into typed records (`compare`, `records`), the replay's report and
CLI (`report`, `replay`), the diagnosis of the seed's gap (`diagnosis`), and the CLI
`olmo-parity` (`cli`). Imports `model/` and `goldens/`, never `tests/` or `bench/`."""
