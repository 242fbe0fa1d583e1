"""``hurraykv inspect --map OUT.svg``: a picture of a block table.

One row per sequence, one cell per logical page, each cell labelled with the physical
page it names: pages several entries name (shared prefixes) in one colour, private pages
in another, a partly filled last page lighter.  Below, the page pool: every physical page
(or, for large pools, ranges of pages) marked shared, referenced or unused - the share of
a pool that `compact` would drop is visible at a glance.  Plain SVG, no plotting library;
every cell carries ``class`` and ``data-*`` attributes, so the picture can be checked as
data."""

from __future__ import annotations

from xml.sax.saxutils import escape

import numpy as np

from ..paged import BlockPagedTensor

CELL_W, CELL_H, LABEL_W, TOP = 30, 18, 150, 62
COLORS = {"shared": "#f4a259", "private": "#8ecae6", "used": "#8ecae6", "unused": "#e0e0e0"}


def render(t: BlockPagedTensor, seq_lens: np.ndarray, title: str, *, max_seqs: int = 64,
           max_pages: int = 64, pool_cells: int = 256) -> str:
    table = t.block_table.astype(np.int64)
    ptr = t.seq_ptr.astype(np.int64)
    pages, counts = np.unique(table, return_counts=True)
    shared = set(pages[counts > 1].tolist())
    referenced = len(pages)
    shown_seqs = min(t.num_seqs, max_seqs)
    widest = min(max_pages, int(np.diff(ptr).max(initial=1)))
    _, _, cols, w = _pool_grid(t.num_pages, pool_cells)
    width = max(LABEL_W + CELL_W * widest + 90, LABEL_W + cols * w + 20, 760,
                10 + 7 * len(title))
    out: list[str] = []
    y = TOP
    stats = (f"{t.num_seqs:,} sequences, page_size {t.page_size}, {t.num_pages:,} pages in "
             f"the pool: {referenced:,} referenced, {len(shared):,} shared, "
             f"{t.num_pages - referenced:,} unused")
    out.append(_text(10, 18, title, 13, weight="bold"))
    out.append(_text(10, 34, stats, 11))
    out.append(_text(10, 50, "rows: sequences; cells: logical pages, labelled with the "
                             "physical page each names", 10, fill="#555"))
    for s in range(shown_seqs):
        row = table[ptr[s]:ptr[s + 1]]
        n = int(seq_lens[s]) if seq_lens is not None else len(row) * t.page_size
        out.append(_text(10, y + 13, f"seq {s} ({n:,} tokens)", 11))
        for k, page in enumerate(row[:max_pages].tolist()):
            kind = "shared" if page in shared else "private"
            partial = k == len(row) - 1 and n < len(row) * t.page_size
            x = LABEL_W + k * CELL_W
            extra = ' fill-opacity="0.5"' if partial else ""
            out.append(f'<rect class="page {kind}{" partial" if partial else ""}" '
                       f'data-seq="{s}" data-logical="{k}" data-page="{page}" x="{x}" y="{y}" '
                       f'width="{CELL_W - 2}" height="{CELL_H - 2}" fill="{COLORS[kind]}"'
                       f'{extra}/>')
            out.append(_text(x + 2, y + 12, str(page), 9 if page < 10000 else 7))
        if len(row) > max_pages:
            out.append(_text(LABEL_W + max_pages * CELL_W + 4, y + 13,
                             f"+{len(row) - max_pages:,} pages", 10, fill="#555"))
        y += CELL_H
    if t.num_seqs > shown_seqs:
        out.append(_text(10, y + 13, f"... {t.num_seqs - shown_seqs:,} more sequences", 11,
                         fill="#555"))
        y += CELL_H
    y += 16
    y = _pool(out, t.num_pages, set(pages.tolist()), shared, y, pool_cells)
    y = _legend(out, y + 10)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 10}" '
            f'font-family="monospace">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(out) + "\n</svg>\n")


def _pool_grid(num_pages: int, cells: int) -> tuple[int, int, int, int]:
    """(pages per cell, cells, cells per row, cell width) of the pool strip."""
    per = max(1, -(-num_pages // cells))
    n = -(-num_pages // per) if num_pages else 0
    cols = max(1, min(n, 64))
    return per, n, cols, (10 if per > 1 else 14)


def _pool(out: list[str], num_pages: int, used: set[int], shared: set[int], y: int,
          cells: int) -> int:
    per, n, cols, w = _pool_grid(num_pages, cells)
    what = "each cell one page" if per == 1 else f"each cell {per:,} pages"
    out.append(_text(10, y + 10, f"page pool ({what})", 11))
    y += 16
    used_arr = np.zeros(num_pages, bool)
    used_arr[list(used)] = True
    shared_arr = np.zeros(num_pages, bool)
    shared_arr[list(shared)] = True
    for i in range(n):
        first, last = i * per, min(num_pages, (i + 1) * per) - 1
        kind = ("shared" if shared_arr[first:last + 1].any() else
                "used" if used_arr[first:last + 1].any() else "unused")
        x = LABEL_W + (i % cols) * w
        yy = y + (i // cols) * 12
        out.append(f'<rect class="pool {kind}" data-first="{first}" data-last="{last}" '
                   f'x="{x}" y="{yy}" width="{w - 1}" height="10" fill="{COLORS[kind]}"/>')
    return y + max(1, -(-n // cols)) * 12 + 8


def _legend(out: list[str], y: int) -> int:
    items = [("shared", "shared page (named by several entries)"),
             ("private", "private page"), ("unused", "unused pool page")]
    x = 10
    for kind, label in items:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{COLORS[kind]}"/>')
        out.append(_text(x + 16, y + 10, label, 10))
        x += 16 + 7 * len(label) + 20
    return y + 16


def _text(x: int, y: int, text: str, size: int, *, fill: str = "#222",
          weight: str = "normal") -> str:
    return (f'<text x="{x}" y="{y}" font-size="{size}" fill="{fill}" '
            f'font-weight="{weight}">{escape(text)}</text>')
