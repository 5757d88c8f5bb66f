"""`olmo-parity`: the console script. `olmo-parity replay ...` is `python -m parity.replay ...`,
`olmo-parity diagnosis ...` is `python -m parity.diagnosis ...`, `olmo-parity train ...` is
`python -m parity.train ...`, `olmo-parity own-rerouting ...` is `python -m parity.own_rerouting
...`."""

from __future__ import annotations

import argparse
import sys

from parity import own_rerouting, replay, train
from parity.diagnosis import __main__ as diagnosis

COMMANDS = {
    "replay": (replay, "replay OLMo-core's golden trace step for step and compare every step"),
    "diagnosis": (diagnosis, "the replay with one MaxText behaviour at a time: docs/diagnosis.md"),
    "train": (train, "train the model for N steps: Orbax checkpoints, bit-exact resume"),
    "own-rerouting": (
        own_rerouting,
        "how often OLMo-core reroutes a token slot against its one-ulp twin, each step",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="olmo-parity", description="Hold the JAX OLMo 3.5 hybrid against OLMo-core's goldens."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, summary) in COMMANDS.items():
        sub = module.parser(f"olmo-parity {name}")
        commands.add_parser(
            name, parents=[sub], add_help=False, description=sub.description, help=summary
        )
    args = parser.parse_args(argv)
    return COMMANDS[args.command][0].run(args)


if __name__ == "__main__":
    sys.exit(main())
