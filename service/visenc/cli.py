"""``visenc serve`` and ``visenc proxy``: every field of their settings (``Settings``, ``ProxySettings``)
is a flag and a variable (``VISENC_*``, ``VISENC_PROXY_*``); the flag wins."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import types
import typing
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from visenc import preflight
from visenc.config import Settings
from visenc.errors import ModelUnavailable
from visenc.preflight import (
    EXIT_DEVICE_FAILED,
    EXIT_MODEL_UNAVAILABLE,
    EXIT_USAGE,
    StartError,
)
from visenc.proxy.settings import ProxySettings

__all__ = ["EXIT_DEVICE_FAILED", "EXIT_MODEL_UNAVAILABLE", "build_parser", "main"]

#: the ``visenc serve --help`` group of each setting
GROUPS: dict[str, tuple[str, ...]] = {
    "model": (
        "model", "served_model_name", "revision", "download_dir", "hf_token", "hub_wait_s", "trust_remote_code",
        "dtype", "device", "max_pixels", "image_backend", "image_loader", "compile", "torch_threads",
    ),
    "server": (
        "host", "port", "uds", "api_key", "api_keys", "api_keys_file", "shm_enabled", "shm_dir", "shm_lease_s",
        "shm_max_bytes", "joined_rows_bytes", "sglang_namespace", "sglang_url_prefixes", "sglang_register_timeout_s",
        "shutdown_timeout_s", "uds_mode",
    ),
    "engine": (
        "max_batch_tokens", "max_batch_images", "max_wait_ms", "preprocess_workers", "max_queue_images",
        "memory_budget_bytes", "memory_fraction", "prefetch_tokens", "heap_keep_bytes", "heap_idle_s",
        "stall_timeout_s", "warm_up_timeout_s", "worker_restart_attempts",
    ),
    "index": (
        "namespace", "process_memory_bytes", "cache_bytes", "pin_overflow_bytes", "ready_lease_s", "redis_url",
        "redis_mode", "redis_batch_bytes", "cache_ttl_s", "redis_timeout_s", "redis_retry_s", "claim_ttl_ms",
        "claim_poll_ms", "claim_wait_s",
    ),
    "limits": (
        "request_timeout_s", "fetch_timeout_s", "max_body_bytes", "max_items", "max_image_bytes", "max_image_pixels",
        "max_video_frames", "max_video_pixels",
    ),
    "observability": ("log_level",),
    "tenants": ("tenant", "tenant_max_images", "tenant_max_queued_tokens", "batch_floor", "busy_window_s"),
}  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose refusals are one line (``EXIT_USAGE``), not a usage dump."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (--help lists the options)\n")


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


def _shown(name: str, value: Any) -> str:
    if value is None or value == []:
        return "unset"
    if name.endswith("_bytes") and isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 30}GiB" if value % (1 << 30) == 0 else f"{value >> 20}MiB"
    if name.endswith("_mode") and isinstance(value, int):
        return f"0{value:o}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def add_flags(parser: argparse.ArgumentParser, model: type[BaseSettings], groups: dict[str, tuple[str, ...]]) -> None:
    """One ``--flag-name`` per field of ``model``, in its group, described by the field, with its default and
    its variable. A list field is a repeated flag (its variable holds a JSON list); a bool flag alone means
    true; a ``*_bytes`` field takes sizes such as 2GiB or 512MB."""
    prefix = str(model.model_config.get("env_prefix", ""))
    sections = {name: parser.add_argument_group(f"{name} options") for name in groups}
    group_of = {field: sections[name] for name, fields in groups.items() for field in fields}
    for name, field in model.model_fields.items():
        env = f"{prefix}{name}".upper()
        flag: dict[str, Any]
        if typing.get_origin(field.annotation) is list:
            flag = {"action": "append"}
        elif field.annotation is bool:
            flag = {"nargs": "?", "const": "true", "choices": ["true", "false"]}
        elif name.endswith("_bytes"):
            flag = {"metavar": "SIZE"}
        elif name.endswith("_mode"):
            flag = {"metavar": "OCTAL"}
        else:
            kind, choices = _flag_type(field.annotation)
            flag = {"type": kind, "choices": choices}
        shown = "required" if field.is_required() else _shown(name, field.get_default(call_default_factory=True))
        said = shown == "unset" and "default" in str(field.description).lower()  # the description says what
        default = "" if said else ("required; " if shown == "required" else f"default: {shown}; ")
        group_of.get(name, parser).add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description} ({default}env {env})".replace("%", "%%"),
            **flag,
        )


USAGE = "%(prog)s [options]  (each option is also a variable, named in its help)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="visenc", description="Vision-encoder service for multimodal LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Run the HTTP service.", description="Run the HTTP service.", usage=USAGE)
    add_flags(serve, Settings, GROUPS)
    about = "Run the OpenAI-compatible front for vLLM replicas that use visenc (images tagged with their hash)."
    proxy = sub.add_parser("proxy", help=about, description=about, usage=USAGE)
    add_flags(proxy, ProxySettings, {"proxy": tuple(ProxySettings.model_fields)})
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


def invalid(e: ValidationError, model: type[BaseSettings]) -> str:
    """One line for a settings validation error: the flag and variable, the value (not a secret's), why."""
    err = e.errors()[0]
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    why = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return f"invalid settings: {why}{more}"
    name = str(err["loc"][0])
    field = model.model_fields.get(name)
    secret = field is not None and "SecretStr" in str(field.annotation)
    value = "" if secret or err["type"] == "missing" else f"={err['input']}"
    env = f"{model.model_config.get('env_prefix', '')}{name}".upper()
    return f"invalid --{name.replace('_', '-')}{value} ({env}): {why}{more}"


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    model: type[BaseSettings] = ProxySettings if command == "proxy" else Settings
    known = {f"VISENC_{n}".upper() for n in Settings.model_fields} | {"VISENC_API_KEY"}
    known |= {f"VISENC_PROXY_{n}".upper() for n in ProxySettings.model_fields}
    for line in preflight.unknown_variables(os.environ, known, "VISENC_PROXY_" if model is Settings else "\0"):
        print(line, file=sys.stderr)
    try:
        settings = model(**args)
    except ValidationError as e:
        print(f"visenc {command}: {invalid(e, model)}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(settings, ProxySettings):
        return run_proxy(settings)
    assert isinstance(settings, Settings)
    return serve(settings)


def prepare(settings: Settings) -> socket.socket:
    """Every check that needs no model, then the hub settings into the environment huggingface_hub reads;
    the listening socket. Raises ``StartError``."""
    preflight.check_device(settings.device)
    preflight.check_paths(settings)
    preflight.check_model(settings.model)
    sock = preflight.listen(settings)
    if settings.download_dir is not None:
        from visenc.models import hub

        os.environ["HF_HUB_CACHE"] = str(settings.download_dir)
        hub.DOWNLOAD_DIR = settings.download_dir
    if settings.hf_token is not None:
        os.environ["HF_TOKEN"] = settings.hf_token.get_secret_value()
    return sock


def server_config(app: Any, settings: Settings) -> Any:
    """uvicorn's settings for ``app``: its httptools protocol sending large rows bodies from threads
    (``api/sender.py``); without httptools, uvicorn's own choice."""
    import uvicorn

    try:
        from visenc.api.sender import RowsProtocol

        protocol: Any = RowsProtocol
    except ImportError:  # uvicorn without its [standard] extras: h11, every body written by the loop
        protocol = "auto"
    grace = max(1, round(settings.shutdown_timeout_s))
    return uvicorn.Config(app, log_level=settings.log_level, timeout_graceful_shutdown=grace, http=protocol)


def freeze_heap() -> None:
    """Move every object alive now (modules, the tower, the app) out of the collector's sight: each later
    collection then walks only what requests made, not a heap of torch's millions (as vLLM does after start-up)."""
    gc.collect()
    gc.freeze()


def serve(settings: Settings) -> int:
    """Run the service until it is stopped: 0 after a graceful stop; a misuse found before the model loads,
    the model that cannot be served, the device worker that could not be restarted: one line on stderr
    and the exit status of its kind (``visenc.preflight``)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "debug":  # huggingface_hub's client logs every request it makes at info
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    try:
        sock = prepare(settings)
    except StartError as e:
        print(f"visenc: {e}", file=sys.stderr)
        return e.code
    if settings.trust_remote_code:
        logging.getLogger("visenc").info("--trust-remote-code changes nothing: visenc runs no repository code")
    import uvicorn

    from visenc.bootstrap import create_app, load_tower

    signal.signal(signal.SIGTERM, _stop_loading)
    try:
        tower = load_tower(settings)  # before the server listens, as it always did; a download included
    except StartError as e:
        print(f"visenc: {e}", file=sys.stderr)
        return e.code
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
    except ValueError as e:  # the memory budget's parts, known once the tower is
        print(f"visenc: invalid settings: {e}", file=sys.stderr)
        return EXIT_USAGE
    server = uvicorn.Server(server_config(app, settings))
    freeze_heap()

    def stop_server() -> None:
        server.should_exit = True

    app.state.stop_server = stop_server
    try:
        preflight.start_listening(sock, settings)
    except StartError as e:
        print(f"visenc: {e}", file=sys.stderr)
        return e.code
    where = f"unix:{settings.uds}" if settings.uds else "http://{}:{}".format(*sock.getsockname()[:2])
    logging.getLogger("visenc").info("listening on %s", where)
    server.run(sockets=[sock])
    if app.state.fatal:
        logging.getLogger("visenc").critical("exiting: %s", app.state.fatal)
        return EXIT_DEVICE_FAILED
    return 0


def run_proxy(settings: ProxySettings) -> int:
    import uvicorn

    from visenc.proxy import Proxy, create_proxy_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = preflight.listen(settings)
        preflight.start_listening(sock, settings)
    except StartError as e:
        print(f"visenc: {e}", file=sys.stderr)
        return e.code
    signal.signal(signal.SIGTERM, _stopped)
    app = create_proxy_app(Proxy(settings))
    uvicorn.Server(uvicorn.Config(app, log_level=settings.log_level)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
