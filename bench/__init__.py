"""Benchmarks: each module's `run()` measures its subject against a reference in the same process
and returns ratios; `python -m bench [name ...]` (or `tox -e bench`) prints them."""
