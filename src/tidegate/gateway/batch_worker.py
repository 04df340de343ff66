"""Runs queued batch requests: any gateway with `batch.worker` on reads the stream in the consumer
group, at most `max_in_flight` at a time, and sends each through its own request path as the batch's
tenant in the batch tier, so that the pool controller gives batch work only the capacity the
interactive tiers leave idle.

Durability, entry by entry: XREADGROUP hands an entry to this consumer (it stays pending until
XACK); the worker confirms the entries it runs every `claim_idle_s / 3` (XCLAIM to itself, which
resets their idle time); a gateway that died stops confirming, and after `claim_idle_s` any worker
takes its entries over with XAUTOCLAIM. A run that fails (5xx, timeout) is left pending the same way,
so the claim delay is also the retry delay. Each run begun is counted per custom_id; past
`max_attempts` the entry goes to the dead-letter stream and its error line to the error file. A
refusal for capacity (429, 503) is no failure: the request waits its Retry-After and goes again.

Preemption (`preemptible`, `policy.pool` rule 9): a request is sent as preemptible background work,
so an interactive request that finds no free slot may stop it. The request path then runs in a
task of its own, which the gateway cancels; the worker sees that task cancelled while it was not
itself, and sends the request again at once (it waits in the gateway's queue for a slot). Its
entry stays pending with this consumer meanwhile (confirmed as any running one), the run is not
counted as an attempt, and its result is written once, when a run ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from tidegate.batch.records import BatchStatus, error_line, new_id, output_line
from tidegate.gateway.batch_store import GROUP, BatchStore
from tidegate.gateway.http import HttpRequest
from tidegate.policy.background_share import DemandMemory, background_slots, remember_demand
from tidegate.policy.identity import Identity

__all__ = ["BatchWorker", "CapturedAnswer"]

log = logging.getLogger("tidegate.batch")

_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_CAPACITY_STATUSES = frozenset((429, 503))  # refused for capacity now: waits and goes again, not a failure
_MAX_CAPACITY_WAIT_S = 5.0  # a refused request goes again at least this often
# a batch still validating this long after its creation lost the gateway that was queueing it
VALIDATION_LOST_S = 60.0
_NO_RESULT = (408, 500, 502, 504)  # the replica or gateway failed it: another run may answer it
_SHARE_SAMPLE_S = 0.1  # how often the interactive demand is sampled for the background share


class CapturedAnswer:
    """Stands in for a client connection: keeps the answer the request path writes."""

    __slots__ = ("status", "headers", "body", "closed", "on_pause_writing", "on_resume_writing", "_parts")

    def __init__(self) -> None:
        self.status = 0
        self.headers = b""
        self.body = b""
        self.closed = False
        self.on_pause_writing = self.on_resume_writing = None
        self._parts: list[bytes] = []

    def respond(self, status: int, headers: bytes, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def start_stream(self, status: int, headers: bytes) -> None:
        self.status, self.headers = status, headers

    def stream_chunk(self, data: bytes) -> None:
        self._parts.append(data)

    def stream_chunks(self, pieces: list[bytes]) -> None:
        self._parts.extend(pieces)

    def end_stream(self) -> None:
        self.body = b"".join(self._parts)

    def abort(self) -> None:
        self.status = self.status if self.status >= 500 else 502

    def retry_after_s(self) -> float:
        for line in self.headers.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"retry-after":
                try:
                    return max(0.2, float(value.strip()))
                except ValueError:
                    break
        return 1.0


class BatchWorker:
    def __init__(self, store: BatchStore, handle: Any, tier: str, max_in_flight: int, max_attempts: int,
                 claim_idle_s: float, sweep_interval_s: float, request_timeout_s: float,
                 retention_sweep_interval_s: float = 60.0, consumer_idle_s: float = 300.0,
                 share_inputs: Callable[[], tuple[int, int]] | None = None, share_memory_s: float = 0.0,
                 preemptible: bool = False) -> None:
        self.store = store
        self._handle = handle  # Proxy.handle: (conn, request, identity=...) -> None
        self.tier = tier
        self.max_in_flight = max_in_flight
        self.max_attempts = max_attempts
        self.claim_idle_s = claim_idle_s
        self.sweep_interval_s = sweep_interval_s
        self.retention_sweep_interval_s = retention_sweep_interval_s
        self.consumer_idle_s = consumer_idle_s
        # (level slots, interactive demand) of the pools now; None: only max_in_flight bounds batch work
        self._share_inputs = share_inputs
        self.share_memory_s = share_memory_s
        self._demand = DemandMemory()
        self._level_slots: int | None = None
        self.lease_s = request_timeout_s + claim_idle_s  # a run that outlives this is dead
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(2).hex()}"
        self.running: dict[str, asyncio.Task[None]] = {}  # entry id -> its run
        self.running_ids: dict[str, tuple[str, str]] = {}  # entry id -> (batch id, custom_id), once begun
        self.taking = True  # False once draining: no new entry is read
        self.stopping = False
        self._slot_freed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._redis_down_logged = False
        self._claim_cursor = "0-0"
        self.preemptible = preemptible
        self.runs = 0  # requests sent through the gateway (a test and the bench read it)
        self.preempted = 0  # runs stopped by preemption and sent again

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._share_inputs is not None:
            self._sample_share()  # before the first read: no burst of reads up to max_in_flight
        self._tasks = [loop.create_task(self._read_loop()), loop.create_task(self._confirm_loop()),
                       loop.create_task(self._sweep_loop()), loop.create_task(self._retention_loop())]
        if self._share_inputs is not None:
            self._tasks.append(loop.create_task(self._share_loop()))

    def allowed_in_flight(self) -> int:
        """Batch requests this gateway may hold now: max_in_flight, and no more than the level slots the
        interactive demand leaves on average (`policy.background_share`)."""
        if self._level_slots is None:
            return self.max_in_flight
        return min(self.max_in_flight, background_slots(self._level_slots, self._demand))

    async def _share_loop(self) -> None:
        while not self.stopping:
            self._sample_share()
            await asyncio.sleep(_SHARE_SAMPLE_S)

    def _sample_share(self) -> None:
        assert self._share_inputs is not None
        level_slots, demand = self._share_inputs()
        self._demand = remember_demand(self._demand, time.monotonic(), demand, self.share_memory_s)
        self._level_slots = level_slots

    async def hand_back(self) -> None:
        """Draining: the runs still going are cancelled and their entries handed back, made idle for
        `claim_idle_s` at once so that another gateway takes them over now, with the run not
        counted as an attempt (a rolling restart must not dead-letter anything)."""
        self.taking = False
        held = dict(self.running_ids)
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not held:
            return
        store = self.store
        try:
            await store.redis.xclaim(store.queue, GROUP, self.consumer, 0, list(held),
                                     idle=int(self.claim_idle_s * 1000), justid=True)
            async with store.redis.pipeline(transaction=False) as pipe:
                for batch_id, custom_id in held.values():
                    pipe.hincrby(store.key("batch", batch_id, "attempts"), custom_id, -1)
                    pipe.hdel(store.key("batch", batch_id, "running"), custom_id)
                await pipe.execute()
        except _REDIS_ERRORS as error:
            self._redis_down(error)  # they are taken over after claim_idle_s all the same

    async def stop(self) -> None:
        """Runs still going are cancelled: their entries stay pending and are taken over."""
        self.stopping = True
        self.taking = False
        for task in [*self._tasks, *self.running.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self.running.values(), return_exceptions=True)

    # -- reading the stream
    async def _read_loop(self) -> None:
        next_claim_s = 0.0
        while not self.stopping:
            try:
                if not self.taking:
                    await asyncio.sleep(0.2)
                    continue
                free = self.allowed_in_flight() - len(self.running)
                if free <= 0:  # until a run ends, or the share grows
                    self._slot_freed.clear()
                    # with a share, also when it may have grown; without one, only a run's end frees a slot
                    timeout_s = None if self._share_inputs is None else _SHARE_SAMPLE_S * 2
                    try:
                        await asyncio.wait_for(self._slot_freed.wait(), timeout_s)
                    except asyncio.TimeoutError:
                        pass
                    continue
                if time.monotonic() >= next_claim_s:  # entries of a dead consumer, or of failed runs
                    # looked for often (cheap): entries a draining gateway handed back are idle at once
                    next_claim_s = time.monotonic() + min(1.0, self.claim_idle_s / 3)
                    # XAUTOCLAIM scans a bounded stretch of the pending list per call: the cursor
                    # goes on from there, so stalled entries behind live ones are reached too
                    cursor, claimed, *_ = await self.store.redis.xautoclaim(
                        self.store.queue, GROUP, self.consumer, int(self.claim_idle_s * 1000), self._claim_cursor,
                        count=free)
                    self._claim_cursor = cursor.decode() if isinstance(cursor, bytes) else cursor
                    if claimed:
                        self._start_runs(claimed)
                        continue
                read = await self.store.redis.xreadgroup(GROUP, self.consumer, {self.store.queue: ">"},
                                                         count=free, block=1000)
                for _, entries in read or ():
                    self._start_runs(entries)
                self._redis_back()
            except aioredis.ResponseError as error:
                if "NOGROUP" in str(error):  # a Redis that lost its data: the group is made again
                    await self.store.ensure_group()
                    continue
                log.exception("batch: reading the queue failed")
                await asyncio.sleep(1.0)
            except _REDIS_ERRORS as error:
                self._redis_down(error)
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive anything one read brings
                log.exception("batch: reading the queue failed")
                await asyncio.sleep(1.0)

    def _start_runs(self, entries: list) -> None:
        loop = asyncio.get_running_loop()
        for entry_id, fields in entries:
            if fields is None:  # deleted while pending
                continue
            entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if entry in self.running:
                continue
            decoded = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                       for k, v in fields.items()}
            self.running[entry] = loop.create_task(self._run(entry, decoded))

    def _redis_down(self, error: BaseException) -> None:
        if not self._redis_down_logged:
            log.warning("batch: redis unavailable", extra={"fields": {"error": str(error)}})
            self._redis_down_logged = True

    def _redis_back(self) -> None:
        if self._redis_down_logged:
            log.info("batch: redis available again")
            self._redis_down_logged = False

    async def _confirm_loop(self) -> None:
        """Resets the idle time of the entries being run, so that no live run is taken over."""
        while not self.stopping:
            await asyncio.sleep(self.claim_idle_s / 3)
            entries = list(self.running)
            if not entries:
                continue
            try:
                await self.store.redis.xclaim(self.store.queue, GROUP, self.consumer, 0, entries, justid=True)
            except _REDIS_ERRORS as error:
                self._redis_down(error)

    async def _sweep_loop(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep()
            except _REDIS_ERRORS as error:
                self._redis_down(error)
            except Exception:
                log.exception("batch: sweep failed")

    async def _retention_loop(self) -> None:
        """What is past `batch.retention_s` goes (BatchStore.sweep_retention), so Redis does not grow forever."""
        while not self.stopping:
            await asyncio.sleep(self.retention_sweep_interval_s)
            try:
                batches, files, consumers = await self.store.sweep_retention(time.time(), self.consumer_idle_s)
                if batches or files or consumers:
                    log.info("batch: retention sweep", extra={"fields": {
                        "batches": batches, "files": files, "consumers": consumers}})
            except _REDIS_ERRORS as error:
                self._redis_down(error)
            except Exception:
                log.exception("batch: retention sweep failed")

    async def sweep(self) -> None:
        """Closes batches that are done, expired or cancelled, and ones a killed finalizer left."""
        store = self.store
        now = time.time()
        for batch_id in await store.active_batches():
            record = await store.batch(batch_id)
            if record is None:
                continue
            status = record["status"]
            done = int(record.get("completed", 0)) + int(record.get("failed", 0))
            total = int(record.get("total", 0))
            if status == BatchStatus.VALIDATING.value and now - float(record["created_at"]) > VALIDATION_LOST_S:
                await store.fail_batch(batch_id, [{"code": "validation_interrupted", "param": None, "line": None,
                                                   "message": "the gateway validating this batch stopped; "
                                                              "create it again"}])
            elif status == BatchStatus.FINALIZING.value:
                await store.finalize(batch_id, BatchStatus(record.get("final") or BatchStatus.COMPLETED.value))
            elif status == BatchStatus.IN_PROGRESS.value and done >= total:
                await store.finalize(batch_id, BatchStatus.COMPLETED)
            elif status == BatchStatus.IN_PROGRESS.value and now >= float(record["expires_at"]):
                await store.finalize(batch_id, BatchStatus.EXPIRED)
            elif status == BatchStatus.CANCELLING.value and (done >= total or await store.live_runs(batch_id) == 0):
                await store.finalize(batch_id, BatchStatus.CANCELLED)

    # -- one request
    async def _run(self, entry_id: str, fields: dict[str, str]) -> None:
        try:
            await self._run_entry(entry_id, fields)
        except asyncio.CancelledError:
            raise
        except _REDIS_ERRORS as error:
            self._redis_down(error)  # left pending: taken over once Redis is back
        except Exception:
            log.exception("batch: run failed", extra={"fields": {"entry": entry_id}})
        finally:
            self.running.pop(entry_id, None)
            self.running_ids.pop(entry_id, None)
            self._slot_freed.set()

    async def _run_entry(self, entry_id: str, fields: dict[str, str]) -> None:
        store = self.store
        batch_id, custom_id = fields["b"], fields["c"]
        status, tenant, attempts, has_result = await store.begin(batch_id, custom_id, self.lease_s)
        self.running_ids[entry_id] = (batch_id, custom_id)
        if status != BatchStatus.IN_PROGRESS.value or has_result or tenant is None:
            # cancelled, expiring, gone, or answered by an earlier run: nothing to do
            await store.end_run(batch_id, custom_id)
            await store.ack(entry_id)
            return
        if attempts > self.max_attempts:
            last = await store.redis.hget(store.key("batch", batch_id, "lasterror"), custom_id)
            last = last.decode("utf-8", "replace") if last else ""
            reason = f"failed after {attempts - 1} attempts" + (f": {last}" if last else "")
            await store.dead_letter(entry_id, fields, attempts - 1, reason)
            await self._keep(entry_id, batch_id, custom_id, "err", error_line(custom_id, "max_attempts_exceeded",
                                                                                 reason))
            return
        request_id = new_id("batch_req_")
        answer = await self._send(batch_id, tenant, request_id, fields)
        if answer is None:  # the batch stopped taking work while this request waited for capacity
            await store.end_run(batch_id, custom_id)
            await store.ack(entry_id)
            return
        if answer.status in _NO_RESULT or answer.status == 0:
            log.info("batch: request failed; another run will take it",
                     extra={"fields": {"batch": batch_id, "custom_id": custom_id, "status": answer.status,
                                       "attempt": attempts}})
            await store.redis.hset(store.key("batch", batch_id, "lasterror"), custom_id,
                                   f"status {answer.status}: {answer.body[:200].decode('utf-8', 'replace')}")
            await store.end_run(batch_id, custom_id)
            return  # left pending: XAUTOCLAIM runs it again after claim_idle_s
        kind = "out" if 200 <= answer.status < 300 else "err"
        await self._keep(entry_id, batch_id, custom_id, kind,
                         output_line(custom_id, request_id, answer.status, answer.body))

    async def _send(self, batch_id: str, tenant: str, request_id: str, fields: dict[str, str]) -> CapturedAnswer | None:
        """Through the gateway's own path, as the tenant in the batch tier; again after each capacity
        refusal, while the batch is in progress."""
        identity = Identity(tenant, self.tier, self.preemptible)
        body = fields["j"].encode()
        path = fields["u"].encode()
        while True:
            request = HttpRequest()
            request.method, request.path, request.body = b"POST", path, body
            request.request_id = request_id.encode()
            answer = CapturedAnswer()
            self.runs += 1
            if self.preemptible:
                if not await self._preemptible_run(answer, request, identity):
                    self.preempted += 1
                    if await self.store.batch_status(batch_id) != BatchStatus.IN_PROGRESS.value:
                        return None
                    continue  # preempted: sent again, to wait for a slot in the gateway's queue
            else:
                await self._handle(answer, request, identity=identity)
            if answer.status not in _CAPACITY_STATUSES:
                return answer
            await asyncio.sleep(min(answer.retry_after_s(), _MAX_CAPACITY_WAIT_S))
            if await self.store.batch_status(batch_id) != BatchStatus.IN_PROGRESS.value:
                return None

    async def _preemptible_run(self, answer: CapturedAnswer, request: HttpRequest, identity: Identity) -> bool:
        """One run through the request path in a task of its own, which the gateway cancels to preempt
        it; False when it did (this task itself was not cancelled: a stop or a drain is raised)."""
        run = asyncio.ensure_future(self._handle(answer, request, identity=identity))
        try:
            await run  # a cancellation of this task cancels `run` too, and is raised here
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if run.cancelled() and current is not None and not current.cancelling():
                return False
            raise
        return True

    async def _keep(self, entry_id: str, batch_id: str, custom_id: str, kind: str, line: bytes) -> None:
        """The result, then the XACK (in that order: a crash between them runs the request again, and
        the second result is not written); retried while Redis is away."""
        store = self.store
        delay_s = 0.2
        while True:
            try:
                _, done, total = await store.record(batch_id, custom_id, kind, line)
                await store.end_run(batch_id, custom_id)
                await store.ack(entry_id)
                break
            except _REDIS_ERRORS as error:
                if self.stopping:
                    raise
                self._redis_down(error)
                await asyncio.sleep(delay_s)
                delay_s = min(2.0, delay_s * 2)
        if total and done >= total:
            await store.finalize(batch_id, BatchStatus.COMPLETED)


