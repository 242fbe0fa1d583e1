"""Caches simulated over a request stream of whole prompts, the yardsticks of the Zipf
and retention tables: exact LRU (its hits, or which requests it serves, optionally
admitting a prompt only at its Nth computation) and ARC.
"""

from __future__ import annotations

from collections import OrderedDict


def lru_hits(stream: list[int], slots: int) -> int:
    """Requests an exact LRU cache of ``slots`` whole prompts would serve."""
    cache: dict[int, None] = {}
    hits = 0
    for i in stream:
        if i in cache:
            hits += 1
            del cache[i]
        elif len(cache) >= slots:
            del cache[next(iter(cache))]
        cache[i] = None
    return hits


def arc_hits(stream: list[int], slots: int) -> list[bool]:
    """Which requests an ARC cache (Megiddo and Modha, 2003) of ``slots`` whole prompts
    would serve: T1 (seen once) and T2 (again) with ghost lists B1 and B2 steering the
    target size ``p`` of T1."""
    t1: OrderedDict[int, None] = OrderedDict()
    t2: OrderedDict[int, None] = OrderedDict()
    b1: OrderedDict[int, None] = OrderedDict()
    b2: OrderedDict[int, None] = OrderedDict()
    p, out = 0.0, []

    def replace(x: int) -> None:
        if t1 and (len(t1) > p or (x in b2 and len(t1) == p)):
            b1[t1.popitem(last=False)[0]] = None
        elif t2:
            b2[t2.popitem(last=False)[0]] = None

    for x in stream:
        if x in t1 or x in t2:
            (t1 if x in t1 else t2).pop(x)
            t2[x] = None
            out.append(True)
            continue
        out.append(False)
        if x in b1:
            p = min(slots, p + max(len(b2) / max(len(b1), 1), 1))
            replace(x)
            b1.pop(x)
            t2[x] = None
        elif x in b2:
            p = max(0.0, p - max(len(b1) / max(len(b2), 1), 1))
            replace(x)
            b2.pop(x)
            t2[x] = None
        else:
            if len(t1) + len(b1) == slots:
                if len(t1) < slots:
                    b1.popitem(last=False)
                    replace(x)
                else:
                    t1.popitem(last=False)
            elif len(t1) + len(b1) < slots and len(t1) + len(t2) + len(b1) + len(b2) >= slots:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * slots:
                    b2.popitem(last=False)
                replace(x)
            t1[x] = None
    return out


def lru_served(stream: list[int], slots: int, threshold: int = 1) -> list[bool]:
    """Which requests an exact LRU of ``slots`` whole prompts serves, admitting a prompt
    the ``threshold``-th time it is computed."""
    cache: OrderedDict[int, None] = OrderedDict()
    seen: dict[int, int] = {}
    out = []
    for x in stream:
        if x in cache:
            cache.move_to_end(x)
            out.append(True)
            continue
        out.append(False)
        seen[x] = seen.get(x, 0) + 1
        if seen[x] >= threshold:
            if len(cache) >= slots:
                cache.popitem(last=False)
            cache[x] = None
    return out

