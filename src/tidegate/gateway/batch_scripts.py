"""The Batch API's Lua scripts for files and retention: each check-and-change is one script, so that
Redis runs it whole, between any two commands of other gateways.

They build their keys from the prefix they are given (a single Redis, as the Batch API needs for
its MULTI transactions anyway; not Redis Cluster). Key names are `batch_store`'s.
"""

from __future__ import annotations

__all__ = ["CREATE_BATCH", "DELETE_FILE", "EXPIRE_BATCH", "PRUNE_CONSUMERS", "UNFINISHED"]

# a batch in these states may still read its input file (the finalizer reads its custom_ids)
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")

_UNFINISHED_LUA = "{" + ", ".join(f"['{status}'] = true" for status in UNFINISHED) + "}"

# ARGV: prefix, tenant, file id, batch id, then the batch's fields as name, value pairs.
# -> 0 when the file is gone or another tenant's; else the batch's seq. The batch is stored
# (`validating`), listed for its tenant and made a reader of its file in the same step that finds the
# file, so a DELETE of the file either comes first (the batch is not created: 404) or sees the batch.
CREATE_BATCH = """
local p, tenant, file_id, batch_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if redis.call('HGET', p .. 'file:' .. file_id, 'tenant') ~= tenant then return 0 end
local seq = redis.call('INCR', p .. 'seq')
local batch = p .. 'batch:' .. batch_id
for i = 5, #ARGV, 2 do redis.call('HSET', batch, ARGV[i], ARGV[i + 1]) end
redis.call('HSET', batch, 'tenant', tenant, 'seq', seq)
redis.call('ZADD', p .. 'batches:' .. tenant, seq, batch_id)
redis.call('SADD', p .. 'active', batch_id)
redis.call('SADD', p .. 'file:' .. file_id .. ':readers', batch_id)
return seq
"""

# ARGV: prefix, file id, tenant ('' for any: the retention sweep), mode ('delete' | 'expire'), now (s),
# retention (s). -> 'deleted', 'missing' (no such file of the tenant), or 'in_use:<batch id>' when a
# batch not yet final reads it (then, in 'expire' mode, its expiry moves a retention later: the
# batch's end sets it again). The check and the delete are one step: no batch can start reading the
# file in between (CREATE_BATCH is a script too).
DELETE_FILE = """
local unfinished = """ + _UNFINISHED_LUA + """
local p, file_id = ARGV[1], ARGV[2]
local file = p .. 'file:' .. file_id
local tenant = redis.call('HGET', file, 'tenant')
if not tenant or (ARGV[3] ~= '' and tenant ~= ARGV[3]) then
  if ARGV[4] == 'expire' then redis.call('ZREM', p .. 'expiry', 'file:' .. file_id) end
  return 'missing'
end
for _, batch_id in ipairs(redis.call('SMEMBERS', file .. ':readers')) do
  local status = redis.call('HGET', p .. 'batch:' .. batch_id, 'status')
  if status and unfinished[status] then
    if ARGV[4] == 'expire' then
      redis.call('ZADD', p .. 'expiry', tonumber(ARGV[5]) + tonumber(ARGV[6]), 'file:' .. file_id)
    end
    return 'in_use:' .. batch_id
  end
end
local purpose = redis.call('HGET', file, 'purpose') or ''
redis.call('DEL', file, file .. ':content', file .. ':readers')
redis.call('ZREM', p .. 'files:' .. tenant, file_id)
redis.call('ZREM', p .. 'files:' .. tenant .. ':' .. purpose, file_id)
redis.call('ZREM', p .. 'expiry', 'file:' .. file_id)
return 'deleted'
"""

# ARGV: prefix, batch id. A final batch past its retention: its record and what is left of its keys
# go, it leaves its tenant's list and its input file's readers. -> 1 removed, 0 not final (kept)
EXPIRE_BATCH = """
local unfinished = """ + _UNFINISHED_LUA + """
local p, batch_id = ARGV[1], ARGV[2]
local batch = p .. 'batch:' .. batch_id
local fields = redis.call('HMGET', batch, 'status', 'tenant', 'input_file_id')
if fields[1] and unfinished[fields[1]] then
  redis.call('ZREM', p .. 'expiry', 'batch:' .. batch_id)
  return 0
end
redis.call('DEL', batch, batch .. ':out', batch .. ':err', batch .. ':attempts', batch .. ':running',
           batch .. ':lasterror')
if fields[2] then redis.call('ZREM', p .. 'batches:' .. fields[2], batch_id) end
if fields[3] then redis.call('SREM', p .. 'file:' .. fields[3] .. ':readers', batch_id) end
redis.call('SREM', p .. 'active', batch_id)
redis.call('ZREM', p .. 'expiry', 'batch:' .. batch_id)
return 1
"""

# KEYS: the stream. ARGV: group, idle (ms). Consumers with no pending entry, idle that long, are
# removed; the check and the removal are one step, so no entry delivered meanwhile is dropped from
# the pending list (XGROUP DELCONSUMER forgets a consumer's pending entries). A live worker reads
# every second, so it is never idle that long; one that reads again is created again. -> removed
PRUNE_CONSUMERS = """
local removed = 0
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local name, pending, idle
  for i = 1, #consumer, 2 do
    if consumer[i] == 'name' then name = consumer[i + 1]
    elseif consumer[i] == 'pending' then pending = consumer[i + 1]
    elseif consumer[i] == 'idle' then idle = consumer[i + 1] end
  end
  if pending == 0 and idle >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
    removed = removed + 1
  end
end
return removed
"""
