"""How the tables are printed: ``print_table`` (measurement, value, ratio, target; the
other benchmarks' format) and ``print_grid`` (a title, a header and rows of any width).
"""

from __future__ import annotations

from bench_paged import print_table

__all__ = ["print_grid", "print_table"]


def print_grid(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    print(title)
    w = [max(len(x[i]) for x in [*rows, head]) for i in range(len(head))]
    print(" | ".join(h.ljust(n) for h, n in zip(head, w, strict=True)).rstrip())
    print("-+-".join("-" * n for n in w))
    for row in rows:
        print(" | ".join(c.ljust(n) for c, n in zip(row, w, strict=True)).rstrip())

