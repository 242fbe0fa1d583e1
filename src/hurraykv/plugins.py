"""Entry points of other distributions (floor 0: imports nothing of the package).

hurraykv's registries (chunk stores, quantization schemes, server operations) take
classes and functions from installed distributions through entry point groups; this is
the loop they share: each entry point not seen before is handed to the registry's own
``register_one``, which returns why it registered nothing ("" when it did) or raises;
a skipped entry point is said once, as a warning of the registry's class naming the
group, the entry point, its distribution and version, and why.  A plugin's failure never
reaches the caller, not even a ``SystemExit`` raised on import: the package's own entries
stand.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib import metadata


def load(group: str, register_one: Callable[[metadata.EntryPoint], str],
         warning: type[Warning], seen: set[tuple[str, str, str]]) -> list[str]:
    """Hand every entry point of ``group`` not in ``seen`` to ``register_one``; returns
    what was skipped (each also a ``warning``)."""
    problems = []
    for ep in metadata.entry_points(group=group):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
        if (dist, ep.name, ep.value) in seen:
            continue
        seen.add((dist, ep.name, ep.value))
        try:
            why = register_one(ep)
        # a plugin's bug, a missing dependency, a clash; SystemExit too, the "requires X"
        # idiom of a module that cannot work here, which would end every command
        except (Exception, SystemExit) as e:
            why = f"{type(e).__name__}: {e}"
        if why:
            problems.append(f"the {group} entry point {ep.name!r} = {ep.value!r} "
                            f"(distribution {dist}) is skipped: {why}")
            warnings.warn(problems[-1], warning, stacklevel=3)
    return problems
