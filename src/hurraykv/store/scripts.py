"""The page store's keys and Lua scripts (floor 4).

Page bytes never go through Lua (it would copy them): pages are stored with plain
(M)SETs.  A page's references are the generations in its owner set, one per stored
manifest (8 bytes of milliseconds since the epoch, big-endian, then 8 random bytes), so
adding or dropping one is idempotent: a step repeated after a crash, or by two clients
at once, changes nothing the second time.  Every script touches keys of one hash slot
only (a page and its owners share ``{H}``, a manifest and its pending releases share
``{id}``), so each is atomic in a cluster too.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

# keys[1] page, keys[2] owners, keys[3] the page's counter of before generations;
# argv[1] generation.  The reference is added only if the page is still there (else 0: the
# caller stores it again, a concurrent release having removed it); returns the number of
# owners, 1 meaning the page is newly stored.  A page still counted the old way (a store
# fsck has not upgraded) is refused: HKVLEGACY, nothing changed.
_ADDREF = """
if redis.call('EXISTS', KEYS[3]) == 1 then return redis.error_reply('HKVLEGACY') end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
return redis.call('SCARD', KEYS[2])
"""
# The same for many pages in one call (a single server: no slot rule to respect).
_ADDREF_MANY = """
for i = 3, #KEYS, 3 do
  if redis.call('EXISTS', KEYS[i]) == 1 then return redis.error_reply('HKVLEGACY') end
end
local out = {}
for i = 1, #KEYS, 3 do
  if redis.call('EXISTS', KEYS[i]) == 0 then out[#out + 1] = 0
  else
    redis.call('SADD', KEYS[i + 1], ARGV[1])
    out[#out + 1] = redis.call('SCARD', KEYS[i + 1])
  end
end
return out
"""
# keys[1] page, keys[2] owners; argv[1] generation.  Drops the reference; the call that
# drops the last one deletes page and owners and returns -1 - the page's size; any other
# (the reference already gone included) returns the owners left.
_DROPREF = """
if redis.call('SREM', KEYS[2], ARGV[1]) == 1 and redis.call('SCARD', KEYS[2]) == 0 then
  local size = redis.call('STRLEN', KEYS[1])
  redis.call('DEL', KEYS[1], KEYS[2])
  return -1 - size
end
return redis.call('SCARD', KEYS[2])
"""
_DROPREF_MANY = """
local out = {}
for i = 1, #KEYS, 2 do
  local n
  if redis.call('SREM', KEYS[i + 1], ARGV[1]) == 1 and
      redis.call('SCARD', KEYS[i + 1]) == 0 then
    n = -1 - redis.call('STRLEN', KEYS[i])
    redis.call('DEL', KEYS[i], KEYS[i + 1])
  else n = redis.call('SCARD', KEYS[i + 1]) end
  out[#out + 1] = n
end
return out
"""
_EXISTS_MANY = """
local out = {}
for i = 1, #KEYS do out[i] = redis.call('EXISTS', KEYS[i]) end
return out
"""
MANY = 512  # pages per *_MANY call
# keys[1] manifest, keys[2] pending releases; argv[1] the new manifest.  The manifest it
# replaces moves to the pending releases (under its generation, 'r' + its bytes) in the
# same step, so exactly one caller ever owns its release; returns 1 when one was replaced.
# A version 1 manifest (no generation) is left alone: HKVLEGACY (fsck upgrades it).
_SWAP = """
local old = redis.call('GET', KEYS[1])
if old and string.sub(old, 5, 8) ~= '\2\0\0\0' then
  return redis.error_reply('HKVLEGACY')
end
redis.call('SET', KEYS[1], ARGV[1])
if old then
  redis.call('HSET', KEYS[2], string.sub(old, 9, 24), 'r' .. old)
  return 1
end
return 0
"""
# keys[1] manifest, keys[2] pending releases: the manifest moves to its releases ('d' +
# its bytes: deleted, prefix entries to remove); 1 if there was one.
_REMOVE = """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
if string.sub(old, 5, 8) ~= '\2\0\0\0' then return redis.error_reply('HKVLEGACY') end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], string.sub(old, 9, 24), 'd' .. old)
return 1
"""
# The same, only if the manifest is still the one of generation argv[1] (a damaged snapshot
# dropped: a put that replaced it meanwhile is left alone); 1 if it was removed.
_REMOVE_IF = """
local old = redis.call('GET', KEYS[1])
if not old or string.sub(old, 5, 8) ~= '\2\0\0\0' or string.sub(old, 9, 24) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], ARGV[1], 'd' .. old)
return 1
"""
# keys[1] page, keys[2] owners: the page goes if nobody owns it (fsck; a writer that stored
# it an instant ago finds it gone when it adds its reference, and stores it again).
_DEL_ORPHAN = """
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.call('DEL', KEYS[1]) end
return 0
"""
_DEL_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

STATS = "hkv:stats"
PAGE_SIZES = "hkv:page_sizes"


class Script:
    """A Lua script run by EVALSHA, also inside cluster pipelines (redis-py refuses its
    Script helpers there; a raw EVALSHA whose keys share one slot is routed normally).
    The script is loaded on every primary at once, and again whenever Redis answers
    NOSCRIPT: a server restarted, failed over or told ``SCRIPT FLUSH`` has an empty script
    cache, and an EVALSHA it refuses did not run, so it is sent again (in a pipeline,
    ``Pipe`` sends only the calls refused)."""

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
        command = ("EVALSHA", self.sha, len(keys), *keys, *(args or []))
        if client is not None:  # a pipeline: its execute() answers NOSCRIPT
            return client.execute_command(*command)
        for _attempt in range(RELOADS):
            try:
                return self.client.execute_command(*command)
            except Exception as e:
                if not is_noscript(e):
                    raise
                self.load()
        return self.client.execute_command(*command)


RELOADS = 3  # loads of a script a call tries before NOSCRIPT is raised (Redis restarting
# again and again)


def is_noscript(error: BaseException) -> bool:
    """Whether ``error`` is Redis's NOSCRIPT: the EVALSHA did not run."""
    from redis.exceptions import NoScriptError

    return isinstance(error, NoScriptError)


class Pipe:
    """A redis-py pipeline (no transaction) whose script calls survive a Redis that lost
    its script cache: the EVALSHAs answered NOSCRIPT did not run, so once the scripts are
    loaded again those calls alone are sent again (running the others twice would count
    a freed page twice).  Every other command goes to the pipeline as it is."""

    def __init__(self, client: Any, scripts: dict[str, Script]) -> None:
        self._client = client
        self._pipe = client.pipeline(transaction=False)
        self._scripts = {s.sha: s for s in scripts.values()}
        self._calls: dict[int, tuple[Any, ...]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __len__(self) -> int:
        return len(self._pipe)

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if args and args[0] == "EVALSHA":
            self._calls[len(self._pipe)] = args
        return self._pipe.execute_command(*args, **options)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        calls, self._calls = self._calls, {}
        replies = self._pipe.execute(raise_on_error=False)
        for _attempt in range(RELOADS):
            lost = [i for i, r in enumerate(replies) if is_noscript(r)]
            if not lost:
                break
            for sha in dict.fromkeys(calls[i][1] for i in lost):
                self._scripts[sha].load()
            again = self._client.pipeline(transaction=False)
            for i in lost:
                again.execute_command(*calls[i])
            for i, reply in zip(lost, again.execute(raise_on_error=False), strict=True):
                replies[i] = reply
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies


SCRIPTS = {"addref": _ADDREF, "addref_many": _ADDREF_MANY, "dropref": _DROPREF,
           "dropref_many": _DROPREF_MANY, "exists_many": _EXISTS_MANY, "swap": _SWAP,
           "remove": _REMOVE, "remove_if": _REMOVE_IF, "del_if": _DEL_IF,
           "del_orphan": _DEL_ORPHAN}


def page_key(digest: bytes) -> str:
    return f"hkv:p:{{{digest.hex()}}}"


def owners_key(digest: bytes) -> str:
    return f"hkv:o:{{{digest.hex()}}}"


def legacy_ref_key(digest: bytes) -> str:
    """Where hurraykv before generations counted a page's references (fsck upgrades)."""
    return f"hkv:r:{{{digest.hex()}}}"


def manifest_key(snapshot_id: str) -> str:
    return f"hkv:m:{{{snapshot_id}}}"


def pending_key(snapshot_id: str) -> str:
    return f"hkv:d:{{{snapshot_id}}}"


def prefix_key(chain: bytes) -> str:
    return f"hkv:x:{{{chain.hex()}}}"


def id_of(key: bytes | str, kind: str) -> str:
    """The snapshot id (``kind`` m or d) or page digest hex (p, o, r) inside a key."""
    text = key.decode("utf-8") if isinstance(key, bytes) else key
    return text[len(f"hkv:{kind}:{{"):-1]


def new_generation() -> bytes:
    """A manifest's generation: when it was drawn (ms, big-endian) and 8 random bytes."""
    return int(time.time() * 1000).to_bytes(8, "big") + secrets.token_bytes(8)


def generation_age(generation: bytes, now: float | None = None) -> float:
    """Seconds since ``generation`` was drawn."""
    drawn = int.from_bytes(generation[:8], "big") / 1000
    return (time.time() if now is None else now) - drawn
