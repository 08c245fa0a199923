"""The do-it-yourself alternative: a FastAPI handler that preprocesses and runs the
tower per request. No cache, no batching, no queue; the work runs in starlette's
thread pool, so concurrent requests run concurrent batch-1 forwards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from visenc.imaging.decode import decode
from visenc.models.loading import load_tower


def build(model: str) -> FastAPI:
    tower = load_tower(model)
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/encode")
    async def encode(request: Request) -> Response:
        data = await request.body()

        def work() -> bytes:  # per request: decode, preprocess, batch-1 forward
            out = tower.forward([tower.preprocess(decode(data, max_pixels=1 << 30))])[0]
            return out.numpy().tobytes()

        return Response(await run_in_threadpool(work), media_type="application/octet-stream")

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-clip")
    p.add_argument("--port", type=int, default=8100)
    args = p.parse_args()
    uvicorn.run(build(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
