"""The diagnosis of the seed's open gap: OLMo-core's golden trace replayed with one MaxText
behaviour at a time (`candidates`), the signed gaps of each run (`ablation`) and the report
(`report`); `python -m parity.diagnosis` writes docs/diagnosis.md."""
