"""``create_app(settings)``: the one place where every part is built and wired."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from visenc import heap
from visenc.api.app import create_api
from visenc.config import Settings
from visenc.engine.budget import BatchBudget
from visenc.engine.core import Engine
from visenc.index.memory import MemoryCache
from visenc.index.redis_claims import RedisClaims
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc.models import resume
from visenc.models.base import VisionTower
from visenc.preflight import EXIT_NO_DEVICE, StartError
from visenc.process_memory import BudgetTooSmall, MemorySplit, largest_entry, plan, with_staged
from visenc.tasks import spawn, stop_task

log = logging.getLogger("visenc")
#: how often partial hub files of fetches that ended unfinished are looked for (at start, then while serving)
SWEEP_DOWNLOADS_S = 60.0


def staged(tower: VisionTower, settings: Settings, process_bytes: int) -> tuple[int, int]:
    """(the scheduler's prefetch bound in tokens, the most host bytes of tower inputs it stages: that
    bound plus the batch a bumped image may start beyond it). The bound is planned once, here, within
    the process's memory budget, and the engine is given it (``prefetch_tokens``)."""
    from visenc.engine.budget import device_memory_budget, plan_budget
    from visenc.engine.threads import default_preprocess_workers

    budget = plan_budget(
        tower,
        settings.memory_budget_bytes or device_memory_budget(tower.runtime, settings.memory_fraction),
        max_batch_tokens=settings.max_batch_tokens,
        prefetch_tokens=settings.prefetch_tokens,
        workers=settings.preprocess_workers or default_preprocess_workers(tower.device),
        process_memory_bytes=process_bytes,
    )
    return budget.prefetch_tokens, (budget.prefetch_tokens + budget.max_batch_tokens) * tower.input_bytes_per_token()


def split_for(tower: VisionTower, settings: Settings, budget: MemorySplit) -> tuple[int, MemorySplit]:
    """(the prefetch bound in tokens, the whole split of ``budget``); ``BudgetTooSmall`` where its L1
    cannot hold the rows of one image of ``tower`` at its largest, naming the smallest setting that can."""
    prefetch_tokens, staged_bytes = staged(tower, settings, budget.total)
    rows, need = largest_entry(tower, settings.max_image_pixels)
    try:
        split = with_staged(budget, settings, staged_bytes)
    except ValueError:
        if settings.cache_bytes is not None:
            raise
        l1 = 0  # the other parts alone exceed the budget
    else:
        if split.l1 >= need:
            return prefetch_tokens, split
        l1 = split.l1
    which = f"cache_bytes={l1}"
    smallest = f"--cache-bytes {need}"
    if settings.cache_bytes is None:
        which = f"{l1} bytes, what process_memory_bytes={budget.total} leaves after its other parts"
        smallest = f"--process-memory-bytes {smallest_budget(tower, settings, need)} (or --cache-bytes {need})"
    raise BudgetTooSmall(
        f"L1 ({which}) cannot hold one image of {tower.name} at its largest ({rows} rows, {need} bytes); "
        f"the smallest that works: {smallest}"
    )


def smallest_budget(tower: VisionTower, settings: Settings, need: int) -> int:
    """The smallest ``process_memory_bytes`` whose split leaves L1 ``need`` bytes (the other parts unchanged)."""

    def l1(total: int) -> int:
        s = settings.model_copy(update={"process_memory_bytes": total})
        try:
            return with_staged(plan(s), s, staged(tower, s, total)[1]).l1
        except ValueError:
            return -1

    lo, hi = need, 2 * need
    while l1(hi) < need and hi < 1 << 50:
        lo, hi = hi, 2 * hi
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if l1(mid) >= need else (mid + 1, hi)
    return lo


def sized(settings: Settings, split: MemorySplit) -> Settings:
    """``settings`` with the parts of the process budget filled in."""
    update = {
        "cache_bytes": split.l1,
        "pin_overflow_bytes": split.overflow,
        "shm_max_bytes": split.shm or None,
        "joined_rows_bytes": split.joined,
    }
    return settings.model_copy(update=update)


def build_index(settings: Settings, metrics: Metrics) -> tuple[Index, RedisClaims | None]:
    """The in-process cache; with ``redis_url``, in front of the shared Redis store, whose
    connection also carries the cross-replica claims."""
    local = MemoryCache(
        settings.cache_bytes or 0,
        metrics,
        overflow_bytes=settings.pin_overflow_bytes,
        pin_lease_s=settings.ready_lease_s,
    )
    if settings.redis_url is None:
        return Index(local), None
    from visenc.index.redis_conn import RedisConnection
    from visenc.index.redis_store import RedisStore

    conn = RedisConnection.from_settings(settings, metrics)
    log.info("shared index: redis %s (%s)", conn.location, settings.redis_mode)
    store = RedisStore(conn, ttl_s=settings.cache_ttl_s)
    metrics.preset_tiers([store.tier])
    return Index(local, store), RedisClaims(store)


def load_tower(settings: Settings) -> VisionTower:
    import torch

    from visenc.engine.threads import default_torch_threads
    from visenc.models import compiled
    from visenc.models.loading import load_tower as load

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, which finds no GPU"
        raise StartError(EXIT_NO_DEVICE, f"--device {device}: this torch is {build}; serve with --device cpu")
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    torch.set_num_threads(settings.torch_threads or default_torch_threads(torch.device(device)))
    heap.hold_freed(settings.heap_keep_bytes)
    tower = load(
        settings.model,
        revision=settings.revision,
        dtype=dtype,
        device=device,
        max_pixels=settings.max_pixels,
        image_loader=settings.image_loader,
        image_backend=settings.image_backend,
        hub_wait_s=settings.hub_wait_s,
    )
    eager = compiled.why_eager(settings.compile, tower.device)
    if eager is None:
        tower.compile()  # the graphs themselves are compiled by the device worker's warm-up
    else:
        tower.run_eagerly(eager)  # said in the log, /readyz and visenc_compile_state by the device worker
    return tower


def capacity(tower: VisionTower, cache_bytes: int, size: tuple[int, int] = (1920, 1080)) -> str:
    """What the L1 budget holds, in screenshots of ``size`` for this tower."""
    rows = tower.layout(*size).num_tokens
    each = rows * tower.hidden_size * tower.dtype.itemsize
    return (
        f"in-process index (L1): {cache_bytes / 2**30:.1f} GiB, about {cache_bytes // max(1, each)} "
        f"{size[0]}x{size[1]} screenshots of this model ({rows} rows of {tower.hidden_size} "
        f"{str(tower.dtype).removeprefix('torch.')}: {each / 2**20:.1f} MiB each)"
    )


def forwards(tower: VisionTower, settings: Settings, budget: BatchBudget) -> str:
    """The batch limits as the scheduler applies them, and the working memory a full batch takes."""
    tokens, act = budget.max_batch_tokens, tower.activation_bytes_per_token()
    lowered = (
        "" if tokens == settings.max_batch_tokens else f", lowered from max_batch_tokens {settings.max_batch_tokens}"
    )
    full = min(budget.max_batch_bytes, tokens * act)
    return (
        f"forwards: at most {tokens} tokens and {settings.max_batch_images} images a batch{lowered}; a full batch's "
        f"activations about {full / 2**30:.2f} GiB, on the {tower.device.type} beside the process memory budget, "
        f"within a forward bound of {budget.max_batch_bytes / 2**30:.2f} GiB ("
        + ("memory_budget_bytes" if settings.memory_budget_bytes else f"memory_fraction {settings.memory_fraction:g}")
        + f": {budget.memory_bytes / 2**30:.2f} GiB, less a reserve)"
    )


def resolved_revision(settings: Settings) -> str | None:
    """The hub revision served and the commit the hub cache records for it; ``None`` for a built-in tower
    or a local folder."""
    from visenc.models import hub
    from visenc.preflight import BUILT_IN

    if settings.model in BUILT_IN or (Path(settings.model).expanduser() / "config.json").is_file():
        return None
    repo = hub.parse_spec(settings.model, settings.revision)
    if repo is None:
        return None
    from huggingface_hub import constants

    revision = repo[1] or "main"
    ref = Path(constants.HF_HUB_CACHE) / f"models--{repo[0].replace('/', '--')}" / "refs" / revision
    return f"{revision} (commit {ref.read_text().strip()})" if ref.is_file() else revision


async def sweep_downloads(every_s: float = SWEEP_DOWNLOADS_S) -> None:
    while True:
        try:
            for path in await asyncio.to_thread(resume.sweep, resume.downloads()):
                log.info("removed %s, left by a fetch that did not end", path)
        except OSError as e:
            log.warning("partial downloads not swept: %s", e)
        await asyncio.sleep(every_s)


def create_app(
    settings: Settings | None = None,
    *,
    tower: VisionTower | None = None,
    index: Callable[[Settings, Metrics], tuple[Index, RedisClaims | None]] = build_index,
) -> FastAPI:
    """Build the service. ``tower`` may be passed in (tests share one loaded tower, or wrap it);
    ``index`` builds the index (tests wrap it). With ``tower`` given, a budget too small for one of its
    images raises ``BudgetTooSmall`` here, before anything starts.

    If the device worker cannot be restarted, ``app.state.fatal`` holds the reason and
    ``app.state.stop_server()`` (set by the CLI) is called so that the process exits non-zero."""
    settings = settings or Settings()
    budget = plan(settings)  # the shared-memory pool starts before the tower is loaded: its part is known now
    asked = settings  # as set: the smallest budget named on a refusal splits like it
    sizing = split_for(tower, asked, budget) if tower is not None else None
    settings = settings.model_copy(update={"shm_max_bytes": budget.shm or None})
    metrics = Metrics()

    @asynccontextmanager
    async def engine(app: FastAPI) -> AsyncIterator[Engine]:
        loaded = tower if tower is not None else await asyncio.to_thread(load_tower, settings)
        prefetch_tokens, split = sizing or split_for(loaded, asked, budget)
        log.info("%s", split.describe())
        parts = sized(settings, split)
        built_index, claims = index(parts, metrics)
        built_index.batch_by(largest_entry(loaded, settings.max_image_pixels)[1], settings.redis_batch_bytes)
        planned = parts.model_copy(update={"prefetch_tokens": prefetch_tokens})
        core = Engine(loaded, built_index, planned, metrics, claim_store=claims)
        log.info("%s", forwards(loaded, settings, core.budget))
        d = loaded.describe()
        metrics.model_info.labels(d["name"], d["fingerprint"], d["dtype"], d["device"], str(d["hidden_size"])).set(1)

        def fatal(reason: str) -> None:
            app.state.fatal = reason
            stop = app.state.stop_server
            if stop is not None:
                stop()

        await core.start(on_fatal=fatal)
        applied = {"process_memory_bytes": split.total, "revision": resolved_revision(settings)}
        applied |= {"max_batch_tokens": core.budget.max_batch_tokens, "prefetch_tokens": core.budget.prefetch_tokens}
        shown = {**sized(settings, split).redacted(), **applied}  # each figure as applied
        name = f"{d['name']} (served as {settings.served_model_name})" if settings.served_model_name else d["name"]
        log.info("visenc ready: model=%s fingerprint=%s settings=%s", name, d["fingerprint"], shown)
        log.info("%s", capacity(loaded, split.l1))
        swept = spawn(sweep_downloads(), "download-sweep", metrics)
        try:
            yield core
        finally:
            await stop_task(swept)
            await core.stop()
            await built_index.close()

    app = create_api(settings, metrics, engine)
    app.state.fatal = None
    app.state.stop_server = None  # the CLI sets it: how to stop the server from inside
    return app
