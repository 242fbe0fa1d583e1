"""``hurraykv store fsck URL``: a Redis page store made consistent with its manifests."""

from __future__ import annotations

import argparse
import json

from .. import units

ROWS = [("releases_completed", "pending releases completed (puts or deletes cut short)"),
        ("manifests", "manifests read"),
        ("manifests_upgraded", "manifests upgraded to version 2 (generations)"),
        ("references_dropped", "references no manifest holds, dropped"),
        ("references_added", "references a manifest lacked, added"),
        ("pages_freed", "pages freed with their last reference"),
        ("orphan_pages_freed", "pages nobody referenced, freed"),
        ("legacy_counters_removed", "reference counters of before generations, removed"),
        ("damaged_pages_removed", "pages whose bytes did not match their key (truncated, "
                                  "changed, another type), removed"),
        ("damaged_keys_removed", "manifests, releases and owner sets that were not "
                                 "one (another type, unreadable), removed"),
        ("damaged_removed", "snapshots that lost pages (Redis eviction, damage), removed "
                            "with their other pages (see the stats lines)"),
        ("dangling_owners_removed", "owner sets of pages that are gone, removed")]


def cmd_store_fsck(args: argparse.Namespace) -> int:
    from ..store import PageStore

    # a URL of another scheme is ConfigError, a store out of reach (at the start or
    # midway) TransportError: both exit 2 with one line naming the URL (cli/__init__.py)
    store = PageStore.from_url(args.url)
    try:
        report = store.fsck(grace=args.grace)
    finally:
        store.client.close()
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        for key, what in ROWS:
            print(f"{units.count(report[key]):>12}  {what}")
        before, after = report["stats_before"], report["stats_after"]
        for key in ("snapshots", "pages", "stored_bytes", "logical_bytes"):
            b, a = before.get(key, 0), after.get(key, 0)
            change = "unchanged" if a == b else f"was {b}"
            print(f"{'stats ' + key:>24}: {a} ({change})")
        if report["stats_damaged"]:
            print(f"damaged: statistics ({report['stats_damaged']}): rewritten")
        for key, problem in sorted(report["damaged_pages"].items()):
            print(f"damaged: page {key}: {problem} (removed)")
        for key, problem in sorted(report["damaged_keys"].items()):
            print(f"damaged: key {key}: {problem} (removed)")
        for sid, n in sorted(report["missing_pages"].items()):
            print(f"damaged: snapshot {sid!r} named {n} page(s) the store had lost or "
                  "that were damaged (removed; store it again)")
    # under allkeys-lru a scheduled fsck finds damage routinely: a failure only when some
    # damaged snapshot is still there
    return 1 if len(report["missing_pages"]) > report["damaged_removed"] else 0
