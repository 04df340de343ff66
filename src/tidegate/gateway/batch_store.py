"""The Batch API's durable state in Redis: files, batches, the request stream and the results.

Keys (under `key_prefix`): `file:{id}` (a hash) and `file:{id}:content`; `batch:{id}` (a hash) with
`:out` and `:err` (custom_id -> result line), `:attempts` (custom_id -> runs begun) and `:running`
(custom_id -> lease end, ms); `batches:{tenant}` (a sorted set, newest last) and `active` (batches not
final); `files:{tenant}` and `files:{tenant}:{purpose}` (sorted sets, newest last), `file:{id}:readers`
(the batches that read it); `expiry` (`file:{id}` | `batch:{id}` -> when it goes, s: the retention
sweep's); `queue`, a stream read by the consumer group `workers`, and `dead`, the dead-letter stream
(trimmed to `dead_letter_max_len`).

Exactly one result per custom_id: `RECORD` writes a line only when neither hash holds one, in one
Lua script, and counts it there, so a request run twice (a gateway killed after its answer, before
its XACK) is written once. A batch is closed by `SEAL` (no result is taken after it) and then by one
MULTI that stores its files and its final state, so a finalizer killed half-way leaves a batch that
the next sweep finalizes again, never half a file. Redis should run with `appendonly yes`: what is
acknowledged is then on disk within a second, and a restart loses no batch (docs/batch.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis

from tidegate.batch.files import BatchLine
from tidegate.batch.records import BatchStatus, error_line, new_id
from tidegate.gateway.batch_scripts import CREATE_BATCH, DELETE_FILE, EXPIRE_BATCH, PRUNE_CONSUMERS

__all__ = ["BatchStore", "GROUP"]

GROUP = "workers"

# KEYS: batch, out, err. ARGV: custom_id, 'out' | 'err', line, force ('1': also into a sealed batch,
# the expiry's own lines). -> {written (1, 0 already there, -1 batch closed), done, total}
_RECORD = """
local status = redis.call('HGET', KEYS[1], 'status')
if ARGV[4] ~= '1' and (redis.call('HGET', KEYS[1], 'sealed') == '1'
    or (status ~= 'in_progress' and status ~= 'cancelling')) then return {-1, 0, 0} end
local written = 0
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 and redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 then
  if ARGV[2] == 'out' then
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
    redis.call('HINCRBY', KEYS[1], 'completed', 1)
  else
    redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
    redis.call('HINCRBY', KEYS[1], 'failed', 1)
  end
  written = 1
end
local counts = redis.call('HMGET', KEYS[1], 'completed', 'failed', 'total')
return {written, tonumber(counts[1] or 0) + tonumber(counts[2] or 0), tonumber(counts[3] or 0)}
"""

# KEYS: batch. ARGV: target status, now (s). Stops the batch taking results; -> the status it had
# ('' when the batch is final already or cannot move to the target)
_SEAL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if ARGV[1] == 'cancelled' then
  if status ~= 'cancelling' then return '' end
elseif status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[2])
elseif status ~= 'finalizing' then
  return ''
end
redis.call('HSET', KEYS[1], 'sealed', '1', 'final', ARGV[1])
return status
"""

# KEYS: batch, batches-of-tenant. ARGV: now. in_progress or validating -> cancelling
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'in_progress' or status == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
end
return status
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decoded(mapping: dict) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in mapping.items()}


class BatchStore:
    """Every Redis operation of the Batch API; the routes and the worker hold no state of their own."""

    def __init__(self, redis_url: str, key_prefix: str, retention_s: float = 30 * 86400,
                 dead_letter_max_len: int = 10_000) -> None:
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=2.0,
                                             health_check_interval=5)
        self.prefix = key_prefix
        self.retention_s = retention_s  # a file, or a final batch, is kept this long (since upload, since final)
        self.dead_letter_max_len = dead_letter_max_len
        self.queue = key_prefix + "queue"
        self.dead = key_prefix + "dead"
        self._record = self.redis.register_script(_RECORD)
        self._seal = self.redis.register_script(_SEAL)
        self._cancel = self.redis.register_script(_CANCEL)
        self._create_batch = self.redis.register_script(CREATE_BATCH)
        self._delete_file = self.redis.register_script(DELETE_FILE)
        self._expire_batch = self.redis.register_script(EXPIRE_BATCH)
        self._prune_consumers = self.redis.register_script(PRUNE_CONSUMERS)

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ensure_group(self) -> None:
        """The stream and its consumer group (after a Redis without AOF lost them, too)."""
        try:
            await self.redis.xgroup_create(self.queue, GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    # -- files
    async def put_file(self, tenant: str, filename: str, purpose: str, content: bytes,
                       file_id: str | None = None) -> dict[str, str]:
        file_id = file_id or new_id("file-")
        now = int(time.time())
        record = {"id": file_id, "tenant": tenant, "filename": filename, "purpose": purpose,
                  "bytes": str(len(content)), "created_at": str(now)}
        seq = await self.redis.incr(self.key("seq"))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.key("file", file_id, "content"), content)
            pipe.hset(self.key("file", file_id), mapping=record)
            self._index_file(pipe, tenant, purpose, file_id, seq, now)
            await pipe.execute()
        return record

    def _index_file(self, pipe: Any, tenant: str, purpose: str, file_id: str, seq: int, now: float) -> None:
        """Listed for its tenant; goes a retention after now (or after the last batch reading it ends)."""
        pipe.zadd(self.key("files", tenant), {file_id: seq})
        pipe.zadd(self.key("files", tenant, purpose), {file_id: seq})
        pipe.zadd(self.key("expiry"), {f"file:{file_id}": now + self.retention_s}, gt=True)  # GT still adds

    def _expire_later(self, pipe: Any, batch_id: str, input_file_id: str | None, now: float) -> None:
        """A batch turned final: it, and its input file (unless read again later), go a retention from now."""
        pipe.zadd(self.key("expiry"), {f"batch:{batch_id}": now + self.retention_s})
        if input_file_id:
            pipe.zadd(self.key("expiry"), {f"file:{input_file_id}": now + self.retention_s}, gt=True)

    async def list_files(self, tenant: str, purpose: str | None, limit: int, after: str | None,
                         ascending: bool) -> tuple[list[dict[str, str]], bool]:
        """The tenant's files (of `purpose`, if given), newest first unless `ascending`, from after the
        file `after`; and whether more follow."""
        index = self.key("files", tenant, purpose) if purpose else self.key("files", tenant)
        low, high = "-inf", "+inf"
        if after is not None:
            score = await self.redis.zscore(index, after)
            if score is None:
                return [], False
            low, high = (f"({int(score)}", "+inf") if ascending else ("-inf", f"({int(score)}")
        if ascending:
            ids = await self.redis.zrangebyscore(index, low, high, start=0, num=limit + 1)
        else:
            ids = await self.redis.zrevrangebyscore(index, high, low, start=0, num=limit + 1)
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids[:limit]:
                pipe.hgetall(self.key("file", _text(file_id)))
            records = [_decoded(found) for found in await pipe.execute()]
        return [record for record in records if record], len(ids) > limit

    async def delete_file(self, file_id: str, tenant: str) -> str:
        """'deleted', 'missing', or 'in_use:<batch id>' (a batch not yet final reads it): one script."""
        return _text(await self._delete_file(args=[self.prefix, file_id, tenant, "delete", int(time.time()),
                                                   int(self.retention_s)]))

    async def file(self, file_id: str, tenant: str) -> dict[str, str] | None:
        """The file's record, if it exists and is the tenant's (another tenant's file is not found)."""
        record = _decoded(await self.redis.hgetall(self.key("file", file_id)))
        return record if record and record.get("tenant") == tenant else None

    async def file_content(self, file_id: str) -> bytes:
        return await self.redis.get(self.key("file", file_id, "content")) or b""

    # -- batches
    async def create_batch(self, tenant: str, record: dict[str, str]) -> bool:
        """Stored as `validating`, listed for its tenant, a reader of its input file (a sweep fails it
        if its creator dies validating); False, and nothing stored, when the file is gone."""
        fields = [item for pair in record.items() for item in pair]
        return bool(await self._create_batch(args=[self.prefix, tenant, record["input_file_id"], record["id"],
                                                   *fields]))

    async def start_batch(self, batch_id: str, lines: Sequence[BatchLine]) -> None:
        """validating -> in_progress with every request queued, in one transaction: a batch is either
        not started or all of it is on the stream."""
        batch_key = self.key("batch", batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            for line in lines:
                pipe.xadd(self.queue, {"b": batch_id, "c": line.custom_id, "u": line.url,
                                       "j": orjson.dumps(line.body)})
            pipe.hset(batch_key, mapping={"status": BatchStatus.IN_PROGRESS.value, "in_progress_at": str(int(time.time())),
                                          "total": str(len(lines)), "completed": "0", "failed": "0"})
            pipe.sadd(self.key("active"), batch_id)
            await pipe.execute()

    async def fail_batch(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        now = int(time.time())
        input_file_id = await self.redis.hget(self.key("batch", batch_id), "input_file_id")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key("batch", batch_id), mapping={
                "status": BatchStatus.FAILED.value, "failed_at": str(now),
                "errors": orjson.dumps({"object": "list", "data": errors})})
            pipe.srem(self.key("active"), batch_id)
            self._expire_later(pipe, batch_id, _text(input_file_id) if input_file_id else None, now)
            await pipe.execute()

    async def batch(self, batch_id: str, tenant: str | None = None) -> dict[str, str] | None:
        record = _decoded(await self.redis.hgetall(self.key("batch", batch_id)))
        if not record or (tenant is not None and record.get("tenant") != tenant):
            return None
        return record

    async def batch_status(self, batch_id: str) -> str | None:
        status = await self.redis.hget(self.key("batch", batch_id), "status")
        return _text(status) if status is not None else None

    async def list_batches(self, tenant: str, limit: int, after: str | None) -> tuple[list[dict[str, str]], bool]:
        """The tenant's batches, newest first, from after the batch `after`; and whether more follow."""
        index = self.key("batches", tenant)
        top = "+inf"
        if after is not None:
            score = await self.redis.zscore(index, after)
            if score is None:
                return [], False
            top = f"({int(score)}"
        ids = await self.redis.zrevrangebyscore(index, top, "-inf", start=0, num=limit + 1)
        records = []
        for batch_id in ids[:limit]:
            record = await self.batch(_text(batch_id))
            if record is not None:
                records.append(record)
        return records, len(ids) > limit

    async def cancel(self, batch_id: str) -> str | None:
        status = await self._cancel(keys=[self.key("batch", batch_id)], args=[str(int(time.time()))])
        return _text(status) if status is not None else None

    async def active_batches(self) -> list[str]:
        return [_text(member) for member in await self.redis.smembers(self.key("active"))]

    # -- requests of a batch
    async def begin(self, batch_id: str, custom_id: str, lease_s: float) -> tuple[str | None, str | None, int, bool]:
        """A worker is about to run a request: (batch status, tenant, runs begun counting this one,
        whether it has a result already). The run holds a lease until `lease_s` from now."""
        batch_key = self.key("batch", batch_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(batch_key, "status", "tenant")
            pipe.hincrby(batch_key + ":attempts", custom_id, 1)
            pipe.hexists(batch_key + ":out", custom_id)
            pipe.hexists(batch_key + ":err", custom_id)
            pipe.hset(batch_key + ":running", custom_id, str(int((time.time() + lease_s) * 1000)))
            (status, tenant), attempts, in_out, in_err, _ = await pipe.execute()
        return (_text(status) if status is not None else None, _text(tenant) if tenant is not None else None,
                int(attempts), bool(in_out or in_err))

    async def end_run(self, batch_id: str, custom_id: str) -> None:
        await self.redis.hdel(self.key("batch", batch_id, "running"), custom_id)

    async def record(self, batch_id: str, custom_id: str, kind: str, line: bytes, force: bool = False) -> tuple[int, int, int]:
        """Writes the request's result line unless it has one: (written, done, total)."""
        batch_key = self.key("batch", batch_id)
        written, done, total = await self._record(keys=[batch_key, batch_key + ":out", batch_key + ":err"],
                                                  args=[custom_id, kind, line, "1" if force else "0"])
        return int(written), int(done), int(total)

    async def ack(self, entry_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.queue, GROUP, entry_id)
            pipe.xdel(self.queue, entry_id)
            await pipe.execute()

    async def dead_letter(self, entry_id: str, fields: dict[str, str], attempts: int, reason: str) -> None:
        # trimmed: a dead letter is kept for inspection, not forever (its error line is in the error file)
        await self.redis.xadd(self.dead, {**fields, "entry": entry_id, "attempts": str(attempts), "reason": reason},
                              maxlen=self.dead_letter_max_len, approximate=False)

    async def live_runs(self, batch_id: str) -> int:
        """Requests of the batch some worker is running now (leases not yet ended)."""
        now_ms = int(time.time() * 1000)
        leases = await self.redis.hvals(self.key("batch", batch_id, "running"))
        return sum(1 for lease in leases if int(lease) > now_ms)

    # -- retention
    async def sweep_retention(self, now_s: float, consumer_idle_s: float, max_items: int = 1000) -> tuple[int, int, int]:
        """Removes what is past its retention (final batches, files no unfinished batch reads) and the
        stream's consumers idle `consumer_idle_s` with nothing pending: (batches, files, consumers)
        removed. Every script checks again, so any number of gateways may sweep at once."""
        due = await self.redis.zrangebyscore(self.key("expiry"), "-inf", now_s, start=0, num=max_items)
        batches = files = 0
        for member in map(_text, due):
            kind, _, item_id = member.partition(":")
            if kind == "batch":
                batches += int(await self._expire_batch(args=[self.prefix, item_id]))
            else:
                outcome = await self._delete_file(args=[self.prefix, item_id, "", "expire", int(now_s),
                                                        int(self.retention_s)])
                files += _text(outcome) == "deleted"
        try:
            consumers = int(await self._prune_consumers(keys=[self.queue], args=[GROUP, int(consumer_idle_s * 1000)]))
        except aioredis.ResponseError as error:
            if "no such key" not in str(error).lower() and "NOGROUP" not in str(error):
                raise
            consumers = 0
        return batches, files, consumers

    # -- closing a batch
    async def finalize(self, batch_id: str, target: BatchStatus) -> bool:
        """Closes the batch as `target` (completed, expired, cancelled): its output and error files in
        the input's order, its counts, its final state. One finalizer at a time (a lock); False when
        another holds it or the batch cannot move there."""
        lock = self.key("lock", batch_id)
        if not await self.redis.set(lock, "1", nx=True, px=60_000):
            return False
        try:
            batch_key = self.key("batch", batch_id)
            now = str(int(time.time()))
            if not await self._seal(keys=[batch_key], args=[target.value, now]):
                return False
            record = _decoded(await self.redis.hgetall(batch_key))
            custom_ids = _custom_ids(await self.file_content(record["input_file_id"]))
            out = _decoded(await self.redis.hgetall(batch_key + ":out"))
            err = _decoded(await self.redis.hgetall(batch_key + ":err"))
            if target is BatchStatus.EXPIRED:
                for custom_id in custom_ids:
                    if custom_id not in out and custom_id not in err:
                        line = error_line(custom_id, "batch_expired",
                                          "This request could not be executed before the completion window expired.")
                        await self.record(batch_id, custom_id, "err", line, force=True)
                err = _decoded(await self.redis.hgetall(batch_key + ":err"))
            record = _decoded(await self.redis.hgetall(batch_key))
            fields = {"status": target.value, f"{target.value}_at": now}
            suffix = batch_id.removeprefix("batch_")
            files = (("output_file_id", f"file-{suffix}out", out), ("error_file_id", f"file-{suffix}err", err))
            seqs = [await self.redis.incr(self.key("seq")) if lines else 0 for _, _, lines in files]
            async with self.redis.pipeline(transaction=True) as pipe:
                for (field, file_id, lines), seq in zip(files, seqs):
                    if not lines:
                        continue
                    content = b"".join(lines[c].encode() + b"\n" for c in custom_ids if c in lines)
                    pipe.set(self.key("file", file_id, "content"), content)
                    pipe.hset(self.key("file", file_id), mapping={
                        "id": file_id, "tenant": record["tenant"], "filename": f"{batch_id}_{field[:-8]}.jsonl",
                        "purpose": "batch_output", "bytes": str(len(content)), "created_at": now})
                    self._index_file(pipe, record["tenant"], "batch_output", file_id, seq, int(now))
                    fields[field] = file_id
                pipe.hset(batch_key, mapping=fields)
                self._expire_later(pipe, batch_id, record["input_file_id"], int(now))
                pipe.srem(self.key("active"), batch_id)
                pipe.delete(batch_key + ":out", batch_key + ":err", batch_key + ":attempts", batch_key + ":running",
                            batch_key + ":lasterror")
                await pipe.execute()
            return True
        finally:
            await self.redis.delete(lock)


def _custom_ids(content: bytes) -> list[str]:
    """The custom_ids of an input file (checked at upload), in its order."""
    ids = []
    for raw in content.splitlines():
        if raw.strip():
            ids.append(orjson.loads(raw)["custom_id"])
    return ids
