"""``run_vllm.py`` runs forked from one process that imported vLLM once.

Importing vLLM takes about 8 s of CPU, half of a whole run on a tiny checkpoint. Each run still gets a
process of its own, as vLLM keeps process-wide state: the fork server imports vLLM, torch and the
connector but never builds an engine (vLLM reads its environment lazily until one is built, so each
run's settings, ``--in-process`` included, apply), and forks one child per run; the child runs
``run_vllm.main`` with its arguments, its output captured to files, and exits through the atexit
handlers vLLM registered (which end any engine process it started).

    SERVER.enabled = True                                    # for a session (tests/with_vllm/conftest.py)
    results = vllm_runs(model, "--in-process", "--control")  # {"RESULT": [...], "CONTROL": [...]}
    SERVER.stop()

The server starts with the first run. Where it is not enabled every run is a process of its own,
started from scratch.

Protocol on the server's stdin/stdout, one JSON object a line: ``{"argv": [...], "out": DIR}`` in;
``{"pid": N}`` once the child is forked, then ``{"rc": N}`` when it has exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


class ForkServer:
    """The pytest side: starts the server, hands it runs one at a time, kills a run past its time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        #: whether runs go through a server (started at the first run)
        self.enabled = False

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self._answer(600) == {"ready": True}, "the fork server did not start"

    def stop(self) -> None:
        self.enabled = False
        if self._proc is not None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _answer(self, timeout_s: float) -> dict | None:
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited ({self._proc.poll()})")
        return json.loads(line)

    def run(self, argv: list[str], out: Path, timeout_s: float) -> tuple[int, str, str]:
        """``run_vllm.py ARGV`` in a child of the server: (exit code, stdout, stderr); killed past ``timeout_s``."""
        if self._proc is None and self.enabled:
            self.start()
        if self._proc is None:  # no server: a process of its own
            done = subprocess.run(
                [sys.executable, str(HERE / "run_vllm.py"), *argv],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            return done.returncode, done.stdout, done.stderr
        out.mkdir(parents=True, exist_ok=True)
        self._proc.stdin.write((json.dumps({"argv": argv, "out": str(out)}) + "\n").encode())  # type: ignore[union-attr]
        self._proc.stdin.flush()  # type: ignore[union-attr]
        forked = self._answer(60)
        assert forked is not None and "pid" in forked, forked
        done = self._answer(timeout_s)
        if done is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(forked["pid"], signal.SIGKILL)
            done = self._answer(60)
            raise subprocess.TimeoutExpired(argv, timeout_s)
        return int(done["rc"]), (out / "stdout").read_text(), (out / "stderr").read_text()


def _child(argv: list[str], out: Path) -> None:
    """In the forked child: run ``run_vllm.main`` with ``argv``, output to ``out``; never returns."""
    import atexit
    import traceback

    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the protocol's pipe is the server's alone
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdout = sys.__stdout__
        sys.argv = [str(HERE / "run_vllm.py"), *argv]
        import run_vllm

        code = run_vllm.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()  # vLLM's: they end the engine processes it started
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The server: import what every run imports, then fork a child per request on stdin."""
    sys.path.insert(0, str(HERE))
    import run_vllm  # noqa: F401  (its environment defaults)
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import ECTransferConfig  # noqa: F401

    import visenc_client.vllm  # noqa: F401

    reply = sys.stdout
    sys.stdout = sys.stderr  # imports and vLLM say things: the protocol keeps the real stdout
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(job["argv"], Path(job["out"]))
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


#: the session's server (started by ``tests/with_vllm/conftest.py``)
SERVER = ForkServer()


def vllm_runs(model: Path, *args: str, timeout_s: float = 400) -> dict[str, list[dict]]:
    """Every result line of one ``run_vllm.py`` run, by its word (``RESULT``, and ``CONTROL`` with
    ``--control``); the run must succeed."""
    code, stdout, stderr = vllm_process(model, *args, timeout_s=timeout_s)
    found = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("RESULT", "CONTROL"):
            found[word] = json.loads(rest)
    assert code == 0 and "RESULT" in found, stderr[-4000:]
    return found


def vllm_run(model: Path, *args: str) -> list[dict]:
    """The results of one ``run_vllm.py`` run (its ``RESULT`` line)."""
    return vllm_runs(model, *args)["RESULT"]


def vllm_process(model: Path, *args: str, timeout_s: float = 400) -> tuple[int, str, str]:
    """One ``run_vllm.py MODEL ARGS`` run, whatever its end: (exit code, stdout, stderr)."""
    return SERVER.run([str(model), *args], Path(tempfile.mkdtemp(prefix="vllm-run-")), timeout_s)


if __name__ == "__main__":
    serve()
