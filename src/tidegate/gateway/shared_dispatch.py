"""Active-active dispatch: gateways in front of the same replicas split their slots through Redis.

Each gateway's pool controllers keep every engine just full (late binding, `policy.pool`), but a
controller only knows its own gateway's requests: N gateways would each fill a replica's whole
batch, and the engine would queue the rest where nobody steers it. So every `heartbeat_s` each
gateway runs one Lua script (`HEARTBEAT_SCRIPT`) that stores, under its id and Redis's time, what it
holds and wants at each replica, drops the members not heard from for `member_ttl_s`, and returns
everyone's entries. Two steps make a grant:
- what a gateway wants is its part of the max-min fair split (`policy.slot_split.fair_shares`) of
  every live gateway's demand, as the last heartbeat showed them; every gateway computes the same;
- the script grants it, atomically, what it wants up to what the others do not claim (a gateway's
  claim is the larger of what it holds and what it was granted: `policy.slot_split.grant`, the
  same rule in Python), and the grant is this gateway's slot limit at the replica
  (`PoolController.on_slot_grant`, rule 8).
A gateway that wants less gives slots back at once; one that wants more takes them only once the
others have given them back and the requests they held past their grants have ended. So the
gateways together never hold more than a replica's `slot_limit`, and shares follow demand within
a heartbeat or two.

Load from outside the gateways (clients that reach an engine directly, requests of a gateway that
restarted) is read off the engine's own gauges: at each scrape of a replica (`observe_engine`,
called by the health checks) a gateway compares the engine's running + waiting sequences with the
requests the gateways hold there (its own now, the others' as their last heartbeat said), keeps
the estimate (`policy.slot_split.OutsideLoad`) and publishes it; the split and the grants are of
the slots the largest published estimate leaves.

The trade-off, chosen: the slots are partitioned, not taken one by one from a shared counter. A
counter in Redis would be exact, but every dispatch would wait for a round trip and the gateway's
CPU per request would grow; a partition costs one script per gateway per heartbeat, whatever the
traffic, and its only inexactness is the lag. Shares follow demand within a heartbeat or two.

Redis silent (unreachable, slow, failing): the last grants are kept for `member_ttl_s`, the time
after which the others, too, forget this gateway; then each replica gets `slot_limit //
gateway_count` (`fallback_slots`), an equal part that the configured gateways cannot overcommit. A
dead gateway's entry expires after `member_ttl_s` and its share returns to the others.
`tidegate_dispatch_gateways`, `tidegate_dispatch_slot_limit{pool,replica}` and
`tidegate_dispatch_heartbeat_errors_total` show what the split does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from tidegate.gateway.resp import RespConnection, RespError, encode_command, register_script
from tidegate.policy.slot_split import OutsideLoad, fair_shares, fallback_slots

__all__ = ["HEARTBEAT_SCRIPT", "SharedDispatchSettings", "SharedDispatch", "Member", "parse_members"]

log = logging.getLogger("tidegate.shared_dispatch")

# KEYS[1]: the hash of members (gateway id -> "<redis time s> <json>"). ARGV[1]: this gateway's id,
# ARGV[2]: member ttl in seconds, ARGV[3]: its entry, {pool: {replica: [held, demand, slot_limit,
# wanted, 0, outside]}}. The script forgets the members not heard from for the ttl, grants this
# gateway, at each replica, what it wants up to what outside load (the largest member's estimate)
# and the others' claims leave (a member claims the larger of what it holds and what it was
# granted), stores the entry with the grant as its fifth number, and returns every live member's
# field and value. Run atomically, so the claims never add up past a replica's slot_limit: a grant
# grows only into room the others have given back.
HEARTBEAT_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local ttl = tonumber(ARGV[2])
local mine = cjson.decode(ARGV[3])
local others = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local seen, body = string.match(all[i + 1], '^(%S+) (.*)$')
  seen = tonumber(seen)
  if seen == nil or now - seen > ttl then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] ~= ARGV[1] then
    others[#others + 1] = cjson.decode(body)
  end
end
for pool, replicas in pairs(mine) do
  for rid, v in pairs(replicas) do
    local claimed = 0
    local outside = v[6] or 0
    for _, other in ipairs(others) do
      local o = other[pool] and other[pool][rid]
      if o then
        claimed = claimed + math.max(o[1], o[5] or 0)
        outside = math.max(outside, o[6] or 0)
      end
    end
    v[5] = math.max(0, math.min(v[4], v[3] - outside - claimed))
  end
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.6f', now) .. ' ' .. cjson.encode(mine))
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 60000)
return redis.call('HGETALL', KEYS[1])
"""
_HEARTBEAT_SHA = register_script(HEARTBEAT_SCRIPT)


class SharedDispatchSettings:
    """`shared_state` of the config, for the split."""

    __slots__ = ("redis_url", "gateway_id", "heartbeat_s", "member_ttl_s", "gateway_count", "redis_timeout_s",
                 "key")

    def __init__(self, redis_url: str, *, gateway_id: str | None = None, heartbeat_s: float = 0.25,
                 member_ttl_s: float = 3.0, gateway_count: int = 1, redis_timeout_s: float = 0.25,
                 key_prefix: str = "tidegate:") -> None:
        if heartbeat_s <= 0 or member_ttl_s <= heartbeat_s:
            raise ValueError("heartbeat_s > 0 and member_ttl_s > heartbeat_s needed")
        self.redis_url = redis_url
        # a fresh id per process: a restarted gateway is a new member, its old entry expires
        self.gateway_id = gateway_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.heartbeat_s = heartbeat_s
        self.member_ttl_s = member_ttl_s
        self.gateway_count = gateway_count
        self.redis_timeout_s = redis_timeout_s
        self.key = f"{key_prefix}dispatch:members".encode()


class Member:
    """One gateway's entry: per pool, per replica, (held, demand, slot_limit, wanted, granted,
    outside load); an entry of a gateway that publishes no outside load reads 0 there."""

    __slots__ = ("gateway_id", "replicas")

    def __init__(self, gateway_id: str, replicas: Mapping[str, Mapping[str, tuple[int, ...]]]) -> None:
        self.gateway_id = gateway_id
        self.replicas = replicas


def parse_members(reply: Any) -> list[Member]:
    """The script's reply (field, value, field, value, ...) -> members; a malformed entry is skipped."""
    members: list[Member] = []
    if not isinstance(reply, list):
        return members
    for index in range(0, len(reply) - 1, 2):
        field, value = reply[index], reply[index + 1]
        if not isinstance(field, bytes) or not isinstance(value, bytes):
            continue
        _, _, body = value.partition(b" ")
        try:
            data = orjson.loads(body)
            replicas = {pool: {rid: tuple(int(x) for x in (list(v[:6]) + [0])[:6]) for rid, v in reps.items()}
                        for pool, reps in data.items()}
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError, IndexError):
            continue
        members.append(Member(field.decode(errors="replace"), replicas))
    return members


class DispatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.gateways = Gauge("tidegate_dispatch_gateways", "Gateways splitting the replicas' slots, as the last "
                              "heartbeat saw them (this one included)", registry=registry)
        self.slot_limit = Gauge("tidegate_dispatch_slot_limit", "This gateway's share of a replica's slots "
                                "(its slot_limit when alone)", ["pool", "replica"], registry=registry)
        self.heartbeat_errors = Counter("tidegate_dispatch_heartbeat_errors", "Heartbeats Redis did not answer "
                                        "in time, or refused", registry=registry)


class SharedDispatch:
    """Drives the split for one gateway: `start` (first heartbeat, then one every `heartbeat_s`),
    `close`. `pools`: pool name -> its live controller body (`gateway.overload._PoolBody`)."""

    def __init__(self, settings: SharedDispatchSettings, bodies: Mapping[str, Any], registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._bodies = bodies
        self._clock = clock
        self.metrics = DispatchMetrics(registry)
        self._conn: RespConnection | None = None
        self._task: asyncio.Task | None = None
        self._last_heard_s: float | None = None  # when Redis last answered a heartbeat
        self._fallen_back = False
        self._mismatch_logged: set[str] = set()
        self.members = 1
        self.grants: dict[tuple[str, str], int] = {}  # (pool, replica) -> slots, as last applied
        self._wanted: dict[tuple[str, str], int] = {}  # (pool, replica) -> its share of the last split
        # (pool, replica) -> outside load, as this gateway estimates it from the engine's gauges
        self._outside: dict[tuple[str, str], OutsideLoad] = {}
        self._others_held: dict[tuple[str, str], int] = {}  # the other gateways' held, at the last heartbeat
        self._pool_of = {replica.replica_id: name for name, body in bodies.items() for replica in body.pool.replicas}

    async def start(self) -> None:
        await self.heartbeat()  # before serving: a gateway joining full pools takes its share, not all
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self.heartbeat()
            except Exception:  # noqa: BLE001 - a bad entry must not stop the heartbeat: logged, counted, next beat
                self.metrics.heartbeat_errors.inc()
                log.exception("shared dispatch: heartbeat failed")

    def observe_engine(self, replica: Any) -> None:
        """The health checks read the replica's engine gauges: what runs there past the gateways'
        requests is outside load (its own held now, the others' as their last heartbeat said)."""
        name = self._pool_of.get(replica.replica_id)
        if name is None:
            return
        key = (name, replica.replica_id)
        load = replica.load
        held = self._bodies[name].controller.held(replica.replica_id) + self._others_held.get(key, 0)
        self._outside.setdefault(key, OutsideLoad()).observe(load.running_sequences + load.waiting_sequences, held)

    def outside(self, name: str, replica_id: str) -> int:
        """This gateway's estimate of the load at the replica from outside the gateways."""
        estimate = self._outside.get((name, replica_id))
        return 0 if estimate is None else estimate.sequences

    def entry(self) -> dict[str, dict[str, tuple[int, int, int, int, int, int]]]:
        """What this gateway holds and wants at each replica: (held, held + queued, slot_limit,
        the slots it wants: its share of the last split, all of them before its first; 0, the
        script's place for the grant; its estimate of outside load)."""
        entry: dict[str, dict[str, tuple[int, int, int, int, int, int]]] = {}
        for name, body in self._bodies.items():
            controller = body.controller
            queued = controller.queued
            replicas = entry[name] = {}
            for replica in body.pool.replicas:
                rid = replica.replica_id
                held = controller.held(rid)
                replicas[rid] = (held, held + queued, replica.slot_limit,
                                 self._wanted.get((name, rid), replica.slot_limit), 0, self.outside(name, rid))
        return entry

    async def heartbeat(self) -> None:
        """One round: publish, be granted, read everyone, work out the next wants (or, Redis silent,
        hold and then fall back)."""
        settings = self.settings
        payload = orjson.dumps(self.entry())
        command = encode_command(b"EVALSHA", _HEARTBEAT_SHA, b"1", settings.key, settings.gateway_id.encode(),
                                 b"%g" % settings.member_ttl_s, payload)
        try:
            conn = self._conn
            if conn is None or conn.broken:
                conn = self._conn = await RespConnection.open(settings.redis_url, settings.redis_timeout_s,
                                                              max(1.0, settings.redis_timeout_s))
            reply = await asyncio.wait_for(conn.call(command), settings.redis_timeout_s * 2)
        except (OSError, TimeoutError, asyncio.TimeoutError, RespError, ConnectionError) as error:
            self._silent(self._clock(), error)
            return
        members = parse_members(reply)
        own = next((m for m in members if m.gateway_id == settings.gateway_id), None)
        if own is None:
            self._silent(self._clock(), RuntimeError("own entry missing from the heartbeat's reply"))
            return
        now_s = self._clock()
        if self._fallen_back:
            log.warning("shared dispatch: Redis answers again; slots split among %d gateways", len(members))
        self._last_heard_s, self._fallen_back = now_s, False
        self.members = len(members)
        self.metrics.gateways.set(len(members))
        self._apply(now_s, {(name, rid): values[4] for name, replicas in own.replicas.items()
                            for rid, values in replicas.items() if name in self._bodies})
        self._wanted = self._split(members)

    def _split(self, members: list[Member]) -> dict[tuple[str, str], int]:
        """This gateway's share of each replica in the max-min fair split of everyone's demand over
        the slots outside load leaves (the largest member's estimate); notes the others' held."""
        shares: dict[tuple[str, str], int] = {}
        own = self.settings.gateway_id
        for name, body in self._bodies.items():
            for replica in body.pool.replicas:
                rid = replica.replica_id
                demands: dict[str, int] = {}
                outside = others_held = 0
                for member in members:
                    values = member.replicas.get(name, {}).get(rid)
                    if values is None:
                        continue  # a gateway that does not front this replica takes none of its slots
                    held, demand, limit = values[:3]
                    if limit != replica.slot_limit and rid not in self._mismatch_logged:
                        self._mismatch_logged.add(rid)
                        log.warning("shared dispatch: gateway %s has slot_limit %d for %s, this one %d; "
                                    "this one splits its own", member.gateway_id, limit, rid, replica.slot_limit)
                    demands[member.gateway_id] = max(held, demand)
                    outside = max(outside, values[5])
                    if member.gateway_id != own:
                        others_held += held
                self._others_held[(name, rid)] = others_held
                slots = max(0, replica.slot_limit - outside)
                shares[(name, rid)] = fair_shares(slots, demands).get(own, slots)
        return shares

    def _silent(self, now_s: float, error: BaseException) -> None:
        """Redis did not answer: keep the last grants while the others still count this gateway in,
        then take an equal part of each replica."""
        self.metrics.heartbeat_errors.inc()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        heard = self._last_heard_s
        if heard is not None and now_s - heard <= self.settings.member_ttl_s:
            return
        if not self._fallen_back:
            self._fallen_back = True
            log.warning("shared dispatch: Redis unavailable (%r); each replica's slots / %d gateways until it "
                        "answers", error, self.settings.gateway_count)
        count = self.settings.gateway_count
        self.members = count
        self.metrics.gateways.set(count)
        self._apply(now_s, {(name, r.replica_id): fallback_slots(max(0, r.slot_limit - self.outside(name, r.replica_id)),
                                                                 count)
                            for name, body in self._bodies.items() for r in body.pool.replicas})

    def _apply(self, now_s: float, grants: Mapping[tuple[str, str], int]) -> None:
        grew: set[str] = set()
        for (name, rid), slots in grants.items():
            if self.grants.get((name, rid)) == slots:
                continue
            if slots > self.grants.get((name, rid), -1):
                grew.add(name)
            self.grants[(name, rid)] = slots
            self._bodies[name].controller.on_slot_grant(now_s, rid, slots)
            self.metrics.slot_limit.labels(name, rid).set(slots)
        for name in grew:  # more room: what waits may go now
            self._bodies[name].wake(now_s)
