"""``visenc serve --model sim:...`` through the CLI, with a loop hog beside it on the event loop.

python bench/_sim_serve.py [--hog-ms 20 --period-ms 40] -- --model sim:... --port N [visenc serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import time
from typing import Any


def hogged(busy_ms: float, period_ms: float) -> None:
    """The engine's start also starts a task that holds the event loop ``busy_ms`` of every ``period_ms``."""
    from visenc.engine.core import Engine

    start = Engine.start

    async def hog() -> None:
        while True:
            until = time.perf_counter() + busy_ms / 1000
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(max(0.0, period_ms - busy_ms) / 1000)

    async def start_hogged(self: Any, *args: Any, **kwargs: Any) -> None:
        await start(self, *args, **kwargs)
        self.loop_hog = asyncio.get_running_loop().create_task(hog())

    Engine.start = start_hogged  # type: ignore[method-assign]


def older_tree() -> None:
    """A tree from before the CLI served the stand-in, or before its CPU outputs waited for the stream."""
    from visenc import preflight

    check = preflight.check_model

    def check_model(spec: str) -> None:
        if not spec.startswith("sim:"):
            check(spec)

    preflight.check_model = check_model
    from visenc.engine.outputs import Outputs

    read = getattr(Outputs, "_to_host", None)
    if read is None or "event.synchronize" in inspect.getsource(read):
        return

    def to_host(self: Any, outputs: list[Any], event: Any) -> Any:
        for out in outputs:
            out.sim_event.synchronize()
        return read(self, outputs, event)

    Outputs._to_host = to_host  # type: ignore[attr-defined]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hog-ms", type=float, default=0.0)
    p.add_argument("--period-ms", type=float, default=40.0)
    args, serve = p.parse_known_args()
    serve = [a for a in serve if a != "--"]
    from visenc import cli

    try:
        from visenc import devices  # noqa: F401
    except ImportError:
        older_tree()
    if args.hog_ms > 0:
        hogged(args.hog_ms, args.period_ms)
    return cli.main(["serve", *serve])


if __name__ == "__main__":
    sys.exit(main())
