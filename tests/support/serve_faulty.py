"""``python -m tests.support.serve_faulty [--forward-delay-s S] [--delay-first N] [--fail-always]
[--warm-up-delay-s S] -- SERVE ARGS``

The real ``visenc serve`` CLI, with the loaded tower wrapped in ``FaultyTower``:
for process-level tests (signals, exit status) of a slow, stalled or broken device.
"""

from __future__ import annotations

import argparse
import sys

from tests.support.faults import FaultyTower

import visenc.bootstrap
from visenc import cli


def launcher(*faults: str) -> tuple[str, ...]:
    """``serve_subprocess``'s launcher for this CLI with ``faults``, e.g. ``("--forward-delay-s", "2")``."""
    return ("-m", "tests.support.serve_faulty", *faults, "--")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--forward-delay-s", type=float, default=0.0)
    parser.add_argument("--delay-first", type=int, default=None)
    parser.add_argument("--fail-always", action="store_true")
    parser.add_argument("--warm-up-delay-s", type=float, default=0.0)
    args, rest = parser.parse_known_args()
    if rest and rest[0] == "--":
        rest = rest[1:]
    real_load = visenc.bootstrap.load_tower

    def load(settings):
        return FaultyTower(
            real_load(settings),
            delay_s=args.forward_delay_s,
            delay_first=args.delay_first,
            fail_rate=1.0 if args.fail_always else 0.0,
            warm_up_delay_s=args.warm_up_delay_s,
        )

    visenc.bootstrap.load_tower = load  # type: ignore[assignment]
    return cli.main(["serve", *rest])


if __name__ == "__main__":
    sys.exit(main())
