"""``visenc serve`` and ``visenc proxy``: every field of their settings (``Settings``, ``ProxySettings``)
is a flag and a variable (``VISENC_*``, ``VISENC_PROXY_*``); the flag wins."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import types
import typing
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from visenc.config import Settings
from visenc.errors import ModelUnavailable
from visenc.proxy.settings import ProxySettings

#: exit status when the device worker failed and could not be restarted
EXIT_DEVICE_FAILED = 3
#: exit status when the model cannot be served (``ModelUnavailable``: one line says why)
EXIT_MODEL_UNAVAILABLE = 4


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
    return str, None


def add_flags(parser: argparse.ArgumentParser, model: type[BaseSettings]) -> None:
    """One ``--flag-name`` per field of ``model``, named and described by the field, its variable in the
    help. A list field is a repeated flag (its variable holds a JSON list); a bool flag alone means true."""
    prefix = str(model.model_config.get("env_prefix", ""))
    for name, field in model.model_fields.items():
        env = f"{prefix}{name}".upper()
        flag: dict[str, Any]
        if typing.get_origin(field.annotation) is list:
            flag = {"action": "append"}
        elif field.annotation is bool:
            flag = {"nargs": "?", "const": "true", "choices": ["true", "false"]}
        else:
            kind, choices = _flag_type(field.annotation)
            flag = {"type": kind, "choices": choices}
        required = " (required)" if field.is_required() else ""
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description}{required} [env {env}]",
            **flag,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="visenc", description="Vision-encoder service for multimodal LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="Run the HTTP service.", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_flags(serve, Settings)
    proxy = sub.add_parser(
        "proxy",
        help="Run the OpenAI-compatible front for vLLM replicas that use visenc (images tagged with their hash).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(proxy, ProxySettings)
    return parser


def _stopped(signum: int, frame: types.FrameType | None) -> None:
    logging.getLogger("visenc").info("stopped by signal %d after a graceful shutdown", signum)


def _stop_loading(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds the load: a partial download is removed, nothing waits for it


def _cause(e: Exception) -> str:
    """One line: a ``ModelUnavailable``'s message; for anything else (a file of the checkpoint that
    does not parse, a device error) its type and the first line of its message."""
    if isinstance(e, ModelUnavailable):
        return str(e)
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    try:
        settings = (ProxySettings if command == "proxy" else Settings)(**args)
    except ValidationError as e:
        print(f"visenc: invalid settings:\n{e}", file=sys.stderr)
        return 2
    if isinstance(settings, ProxySettings):
        return run_proxy(settings)
    return serve(settings)


def serve(settings: Settings) -> int:
    """Run the service until it is stopped: 0 after a graceful stop, ``EXIT_MODEL_UNAVAILABLE`` (one
    line on stderr) when the model cannot be served, ``EXIT_DEVICE_FAILED`` when the device worker
    could not be restarted (so that a supervisor restarts the process)."""
    import uvicorn

    from visenc.bootstrap import create_app, load_tower

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "debug":  # huggingface_hub's client logs every request it makes at info
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _stop_loading)
    try:
        tower = load_tower(settings)  # before the server listens, as it always did; a download included
    except Exception as e:  # every cause ends start-up with one line; --log-level debug adds the traceback
        logging.getLogger("visenc").debug("cannot serve %s", settings.model, exc_info=True)
        pinned = f" (revision {settings.revision})" if settings.revision else ""
        print(f"visenc: cannot serve {settings.model}{pinned}: {_cause(e)}", file=sys.stderr)
        return EXIT_MODEL_UNAVAILABLE
    # uvicorn handles SIGTERM/SIGINT gracefully (stops accepting, lets in-flight requests
    # finish, runs the lifespan shutdown) and then re-raises the signal to the handler that
    # was installed before it; with this one, a graceful stop exits 0 instead of dying by it.
    signal.signal(signal.SIGTERM, _stopped)
    try:
        app = create_app(settings, tower=tower)
    except ValueError as e:  # the memory budget's parts, known once the tower is: one line, as for any setting
        print(f"visenc: invalid settings: {e}", file=sys.stderr)
        return 2
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


def run_proxy(settings: ProxySettings) -> int:
    import uvicorn

    from visenc.proxy import Proxy, create_proxy_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _stopped)
    app = create_proxy_app(Proxy(settings))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
