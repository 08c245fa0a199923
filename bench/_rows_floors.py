"""The floors ``bench_rows`` measures each path against (a raw socket, a raw ZMQ push) and the
thread and task pools its callers run on."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from visenc_client import image_hash


class RawSender:
    """A loopback server that answers each 8-byte request (a byte count) with that many bytes, from each of
    ``payloads`` in turn: a floor moves bytes from as many distinct buffers as the path it is set against
    serves images (one buffer sent again and again stays in the CPU's cache, which no served image does)."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = [memoryview(p) for p in payloads]
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        turn = 0
        with conn:
            while ask := conn.recv(8):
                conn.sendall(self.payloads[turn % len(self.payloads)][: struct.unpack("<Q", ask)[0]])
                turn += 1


class RawReceiver:
    """One caller's connection to a ``RawSender``: asks for n bytes and reads them into a buffer."""

    def __init__(self, port: int, nbytes: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = memoryview(bytearray(nbytes))

    def get(self, n: int) -> None:
        self.sock.sendall(struct.pack("<Q", n))
        got = 0
        while got < n:
            got += self.sock.recv_into(self.buffer[got:n])


#: the callers' threads, kept across passes as a caller's threads are (a fresh thread starts on a fresh
#: heap arena, and its first arrays fault their pages in)
_POOLS: dict[int, ThreadPoolExecutor] = {}


def threaded(concurrency: int, jobs: list[Callable[[], Any]]) -> float:
    """Seconds to run ``jobs`` on ``concurrency`` threads (each takes the next job). Each job's result is dropped
    as it ends, as a caller drops rows once used: kept, a round's fresh arrays would fault in hundreds of MB of
    pages that a floor writing into one buffer never touches."""
    pool = _POOLS.get(concurrency) or _POOLS.setdefault(concurrency, ThreadPoolExecutor(concurrency))

    def run(job: Callable[[], Any]) -> None:
        job()

    t0 = time.perf_counter()
    for _ in pool.map(run, jobs):
        pass
    return time.perf_counter() - t0


async def gathered_on(concurrency: int, jobs: list[Callable[[], Awaitable[Any]]]) -> float:
    queue = list(reversed(jobs))

    async def one() -> None:
        while queue:
            await queue.pop()()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(concurrency)))
    return time.perf_counter() - t0


class Zmq:
    """The SGLang rank's receive socket (the visenc path's destination) and a raw PUSH beside it."""

    def __init__(self, sglang_url: str) -> None:
        import zmq

        self.url = sglang_url
        self.context = zmq.Context()
        self.pull = self.context.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = self.context.socket(zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{self.port}")
        self.header = b"x" * 320  # frame 0 of a one-image part is about this size
        self.count = 0
        self.lock = threading.Lock()
        import httpx

        self.http = httpx.Client(base_url=sglang_url, timeout=60)

    def _receive(self, n: int) -> None:
        for _ in range(n):
            self.pull.recv_multipart(copy=False)

    def raw(self, concurrency: int, payloads: list[np.ndarray]) -> float:
        """Seconds to push ``payloads`` (one part each) and receive them, ``concurrency`` at a time."""
        n = len(payloads)
        t0 = time.perf_counter()
        for start in range(0, n, concurrency):
            k = min(concurrency, n - start)
            for rows in payloads[start : start + k]:
                self.push.send_multipart([self.header, rows], copy=False)
            self._receive(k)
        return time.perf_counter() - t0

    def visenc(self, concurrency: int, images: list[bytes]) -> float:
        def part(data: bytes) -> None:
            with self.lock:
                self.count += 1
                rid = f"rows-{self.count}"
            register = {"req_id": rid, "receive_count": 1, "receive_url": f"127.0.0.1:{self.port}", "modality": "IMAGE"}
            item = {"url": "http://images.invalid/x.png", "content_hash": "sha256:" + image_hash(data)}
            encode = {"req_id": rid, "num_parts": 1, "part_idx": 0, "mm_items": [item], "modality": "IMAGE"}
            self.http.post("/scheduler_receive_url", json=register).raise_for_status()
            self.http.post("/encode", json=encode).raise_for_status()

        t0 = time.perf_counter()
        for start in range(0, len(images), concurrency):
            batch = images[start : start + concurrency]
            threaded(len(batch), [lambda d=d: part(d) for d in batch])
            self._receive(len(batch))
        return time.perf_counter() - t0
