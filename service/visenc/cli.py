"""``visenc serve [--flag value ...]``: every Settings field is a flag and a VISENC_* variable."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import types
import typing
from typing import Any

from pydantic import SecretStr, ValidationError

from visenc.config import Settings

#: exit status when the device worker failed and could not be restarted
EXIT_DEVICE_FAILED = 3


def _flag_type(annotation: Any) -> tuple[Any, list[str] | None]:
    """argparse type and choices for a field annotation (``X | None`` unwraps to X)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _flag_type(args[0])
    if origin is typing.Literal:
        return str, [str(a) for a in typing.get_args(annotation)]
    if annotation in (int, float):
        return annotation, None
    if annotation is SecretStr:
        return str, None
    return str, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="visenc", description="Vision-encoder service for multimodal LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="Run the HTTP service.", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, field in Settings.model_fields.items():
        env = f"VISENC_{name.upper()}"
        if typing.get_origin(field.annotation) is list:  # repeat the flag; the variable holds a JSON list
            flag: dict[str, Any] = {"action": "append"}
        else:
            kind, choices = _flag_type(field.annotation)
            flag = {"type": kind, "choices": choices}
        serve.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description} [env {env}]",
            **flag,
        )
    proxy = sub.add_parser(
        "proxy",
        help="Run the OpenAI-compatible front for vLLM replicas that use visenc (images tagged with their hash).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    proxy.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    proxy.add_argument("--port", type=int, default=8080, help="Port to bind.")
    proxy.add_argument("--upstream", action="append", required=True, help="A vLLM OpenAI server (repeat for several).")
    proxy.add_argument("--visenc", default="http://127.0.0.1:8000", help="The visenc service.")
    proxy.add_argument("--visenc-api-key", default=None, help="Bearer key for visenc (prefer the env var).")
    proxy.add_argument(
        "--allow-url-prefix", action="append", default=[], help="Fetch http(s) image URLs under this prefix (repeat)."
    )
    proxy.add_argument("--max-image-bytes", type=int, default=32 << 20, help="Largest image, bytes.")
    proxy.add_argument("--fetch-timeout-s", type=float, default=10.0, help="Bound of one image URL fetch.")
    proxy.add_argument(
        "--video-num-frames",
        type=int,
        default=32,
        help="Frames vLLM takes of a data:video/jpeg URL (its video num_frames media option; -1: all).",
    )
    proxy.add_argument(
        "--absent-timeout-s",
        type=float,
        default=0.05,
        help="Longest wait, once a body is out, for visenc to say which new images it lacks (0: not asked).",
    )
    proxy.add_argument(
        "--encode-first",
        action="store_true",
        help="Forward a request only once visenc has its images (default: at once; visenc gets them after the answer).",
    )
    proxy.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _stopped(signum: int, frame: types.FrameType | None) -> None:
    logging.getLogger("visenc").info("stopped by signal %d after a graceful shutdown", signum)


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    if command == "proxy":
        return run_proxy(args)
    try:
        settings = Settings(**args)
    except ValidationError as e:
        print(f"visenc: invalid settings:\n{e}", file=sys.stderr)
        return 2
    if command == "serve":
        return serve(settings)
    return 0


def serve(settings: Settings) -> int:
    """Run the service until it is stopped: 0 after a graceful stop, ``EXIT_DEVICE_FAILED`` when
    the device worker could not be restarted (so that a supervisor restarts the process)."""
    import uvicorn

    from visenc.bootstrap import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn handles SIGTERM/SIGINT gracefully (stops accepting, lets in-flight requests
    # finish, runs the lifespan shutdown) and then re-raises the signal to the handler that
    # was installed before it; with this one, a graceful stop exits 0 instead of dying by it.
    signal.signal(signal.SIGTERM, _stopped)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s)),
        )
    )

    def stop_server() -> None:
        server.should_exit = True

    app.state.stop_server = stop_server
    server.run()
    if app.state.fatal:
        logging.getLogger("visenc").critical("exiting: %s", app.state.fatal)
        return EXIT_DEVICE_FAILED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def run_proxy(args: dict[str, Any]) -> int:
    import os

    import uvicorn

    from visenc.proxy import Proxy, ProxySettings, create_proxy_app

    logging.basicConfig(level=args["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ProxySettings(
        upstreams=[u.rstrip("/") for u in args["upstream"]],
        visenc_url=args["visenc"],
        visenc_api_key=args["visenc_api_key"] or os.environ.get("VISENC_API_KEY"),
        allow_url_prefixes=args["allow_url_prefix"],
        max_image_bytes=args["max_image_bytes"],
        fetch_timeout_s=args["fetch_timeout_s"],
        encode_first=args["encode_first"],
        video_num_frames=args["video_num_frames"],
        absent_timeout_s=args["absent_timeout_s"],
    )
    signal.signal(signal.SIGTERM, _stopped)
    uvicorn.run(create_proxy_app(Proxy(settings)), host=args["host"], port=args["port"], log_level=args["log_level"])
    return 0
