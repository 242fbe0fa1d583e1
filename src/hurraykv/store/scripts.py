"""The page store's keys and Lua scripts (floor 4).

Page bytes never go through Lua (it would copy them): pages are stored with plain
(M)SETs, and the scripts only count references, each over keys in one slot, so they
are atomic in a cluster too.
"""

from __future__ import annotations

import hashlib
from typing import Any

# Lua: keys[1] page, keys[2] refcount; in one slot (same hash tag), so atomic in a cluster.
# Page bytes never go through Lua (it would copy them): a plain (M)SET stores a page, then
# INCREF counts the reference only if the page is still there (else the caller stores it
# again: a concurrent delete may have removed it in between).
_INCREF = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('INCR', KEYS[2])
"""
# The same for many pages in one call (a single server: no slot rule to respect).
_INCREF_MANY = """
local out = {}
for i = 1, #KEYS, 2 do
  if redis.call('EXISTS', KEYS[i]) == 0 then out[#out + 1] = 0
  else out[#out + 1] = redis.call('INCR', KEYS[i + 1]) end
end
return out
"""
_EXISTS_MANY = """
local out = {}
for i = 1, #KEYS do out[i] = redis.call('EXISTS', KEYS[i]) end
return out
"""
MANY = 512  # pages per *_MANY call
_DECREF = """
local n = redis.call('DECR', KEYS[2])
if n <= 0 then
  local size = redis.call('STRLEN', KEYS[1])
  redis.call('DEL', KEYS[1], KEYS[2])
  return -1 - size
end
return n
"""
_DEL_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Script:
    """A Lua script run by EVALSHA, also inside cluster pipelines (redis-py refuses its
    Script helpers there; a raw EVALSHA whose keys share one slot is routed normally).
    The script is loaded on every primary first, so pipelines never meet NOSCRIPT."""

    def __init__(self, client: Any, lua: str) -> None:
        self.lua = lua
        self.client = client
        self.sha = hashlib.sha1(lua.encode()).hexdigest()
        self.load()

    def load(self) -> None:
        if hasattr(self.client, "get_primaries"):  # a cluster: every primary
            for node in self.client.get_primaries():
                self.client.get_redis_connection(node).script_load(self.lua)
        else:
            self.client.script_load(self.lua)

    def __call__(self, keys: list[str], args: list[Any] | None = None, client: Any = None
                 ) -> Any:
        target = client if client is not None else self.client
        return target.execute_command("EVALSHA", self.sha, len(keys), *keys, *(args or []))


def page_key(digest: bytes) -> str:
    return f"hkv:p:{{{digest.hex()}}}"


def ref_key(digest: bytes) -> str:
    return f"hkv:r:{{{digest.hex()}}}"


def manifest_key(snapshot_id: str) -> str:
    return f"hkv:m:{{{snapshot_id}}}"


def prefix_key(chain: bytes) -> str:
    return f"hkv:x:{{{chain.hex()}}}"
