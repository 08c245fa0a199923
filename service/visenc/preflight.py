"""What ``visenc serve`` checks before it imports torch or loads a model, so that a misuse ends start-up
at once with one line and an exit status of its own (the table: ``docs/operations.md``, "Exit status")."""

from __future__ import annotations

import difflib
import os
import socket
import stat
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from pathlib import Path

from visenc.config import Settings
from visenc.proxy.settings import ProxySettings

#: exit status of a flag or value the parser refuses, or a setting that does not validate
EXIT_USAGE = 2
#: exit status when the device worker failed and could not be restarted
EXIT_DEVICE_FAILED = 3
#: exit status when the model cannot be served (``ModelUnavailable``: one line says why)
EXIT_MODEL_UNAVAILABLE = 4
#: exit status when the device asked for is not on this host (``--device cuda`` without a CUDA GPU)
EXIT_NO_DEVICE = 5
#: exit status when the address cannot be listened on (in use, no permission, no such interface)
EXIT_CANNOT_LISTEN = 6
#: exit status when a file or folder a setting names cannot be read or written
EXIT_BAD_PATH = 7

#: the listening socket's backlog (uvicorn's default)
BACKLOG = 2048
#: this package's built-in towers (``visenc.models.registry.built_in_names`` imports torch; a test keeps them equal)
BUILT_IN = ("tiny-clip", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-siglip")
#: ``VISENC_*`` variables that are no setting of the service but are read elsewhere (the client, compose)
OTHER_VARIABLES = frozenset(
    {
        "VISENC_SHM_MAP_CACHE_BYTES",
        "VISENC_SHM_MAP_SWEEP_S",
        "VISENC_BASE",
        "VISENC_MEMORY_LIMIT",
        "VISENC_SHM_SIZE",
        "VISENC_REDIS_MAXMEMORY",
        "VISENC_REDIS_PASSWORD",
    }
)


class StartError(Exception):
    """Start-up cannot go on: ``str(e)`` is the line to print, ``code`` the exit status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def unknown_variables(environ: Mapping[str, str], known: Iterable[str], ignored_prefix: str) -> list[str]:
    """One warning line per ``VISENC_*`` variable that names no setting, with the nearest one that does."""
    known = set(known) | OTHER_VARIABLES
    out = []
    for name in sorted(environ):
        if name.startswith("VISENC_") and name not in known and not name.startswith(ignored_prefix):
            near = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            out.append(f"visenc: warning: {name} is not a setting and is ignored{hint}")
    return out


def check_device(device: str) -> None:
    """``cuda`` / ``cuda:N`` only where NVML finds that GPU (torch's own check follows at load)."""
    if not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    from visenc.process_memory import host_gpus

    count = host_gpus()
    if count <= index:
        found = "no CUDA GPU" if count == 0 else f"{count} CUDA GPU(s)"
        raise StartError(EXIT_NO_DEVICE, f"--device {device}: this host has {found} (NVML); serve with --device cpu")


def check_model(spec: str) -> None:
    """A local folder must have a ``config.json``; a spelling of a path (``looks_like_path``) names no hub
    id; anything that is neither a built-in name, a folder nor a hub id ``ORG/NAME[@REVISION]`` is refused
    here (a hub id is checked against the hub at load)."""
    from visenc.models.hub import REPO_ID, looks_like_path

    if spec.startswith("sim:"):  # the simulated device (``models/sim.py``): its keys are checked here
        _check_sim(spec)
        return
    path = Path(spec).expanduser()
    if spec in BUILT_IN or (path / "config.json").is_file():
        return
    if path.is_dir():
        raise StartError(EXIT_MODEL_UNAVAILABLE, f"cannot serve {spec}: the folder has no config.json")
    if looks_like_path(spec):
        what = "not a folder" if path.exists() else "no such folder"
        raise StartError(EXIT_MODEL_UNAVAILABLE, f"cannot serve {spec}: {what} (a path: not looked up on the hub)")
    if REPO_ID.match(spec.partition("@")[0]):
        return
    names = built_in_names()
    if spec in names:
        return
    raise StartError(
        EXIT_MODEL_UNAVAILABLE,
        f"cannot serve {spec}: no such folder, and neither a built-in name ({', '.join(names)}) "
        "nor a hub id ORG/NAME[@REVISION]",
    )


def _check_sim(spec: str) -> None:
    from visenc.models.sim import SimSpec

    try:
        SimSpec.parse(spec)
    except (ValueError, TypeError) as e:
        raise StartError(EXIT_MODEL_UNAVAILABLE, f"cannot serve {spec}: {e}") from e


def built_in_names() -> tuple[str, ...]:
    """``BUILT_IN``, and the built-in towers of families installed under a ``visenc.families`` entry point
    (only then is the registry, and torch with it, imported)."""
    if not entry_points(group="visenc.families"):
        return BUILT_IN
    from visenc.models.registry import built_in_names as registered

    return tuple(registered())


def check_paths(settings: Settings) -> None:
    """The API keys parse (their file is read), and the download folder can be written."""
    from visenc.api.auth import ApiKeyError, load_api_keys

    try:
        load_api_keys(settings)
    except ApiKeyError as e:
        raise StartError(EXIT_BAD_PATH if isinstance(e.__cause__, OSError) else EXIT_USAGE, str(e)) from e
    folder = settings.download_dir
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StartError(EXIT_BAD_PATH, f"--download-dir {folder}: {e.strerror}") from e
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StartError(EXIT_BAD_PATH, f"--download-dir {folder}: not writable")


def listen(settings: Settings | ProxySettings) -> socket.socket:
    """The socket, bound now, before the model loads: ``uds`` or ``host:port``. A unix socket listens at
    once (a second visenc would take its path for a stale one); a TCP one is refused meanwhile, so that
    callers fall back at once, and listens at ``start_listening``."""
    try:
        uds = getattr(settings, "uds", None)
        if uds is not None:
            return _unix_socket(uds, getattr(settings, "uds_mode", 0o600))
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((settings.host, settings.port))
        except OSError:
            sock.close()
            raise
    except OSError as e:
        where = getattr(settings, "uds", None) or f"{settings.host}:{settings.port}"
        raise StartError(EXIT_CANNOT_LISTEN, f"cannot listen on {where}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def start_listening(sock: socket.socket, settings: Settings | ProxySettings) -> None:
    """``sock`` listens. Two sockets with SO_REUSEADDR may both bind an address that no socket listens on
    yet: a second visenc started on it while this one loaded is refused here (``StartError``)."""
    try:
        sock.listen(BACKLOG)
    except OSError as e:
        why = f"{e.strerror or e} (taken while the model loaded)"
        raise StartError(EXIT_CANNOT_LISTEN, f"cannot listen on {settings.host}:{settings.port}: {why}") from e


def _unix_socket(path: Path, mode: int) -> socket.socket:
    """A socket bound at ``path`` with file mode ``mode`` (made owner-only, then widened where ``mode`` says);
    a socket file left by a process that is gone is replaced."""
    if path.exists():
        if not stat.S_ISSOCK(path.stat().st_mode):
            raise OSError(17, "a file that is not a socket is in the way")
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # stale: nothing listens there
        else:
            raise OSError(98, "another process listens there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # start-up is single-threaded here: no other file is made meanwhile
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(umask)
    try:
        os.chmod(path, mode)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
