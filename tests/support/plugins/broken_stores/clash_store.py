"""A store plugin naming a scheme a built-in opens: refused, the built-in keeps it."""

from hurraykv.chunks.registry import ChunkStore


class ClashChunks(ChunkStore):
    SCHEMES = ("file",)
    FORM = "file:///ELSEWHERE"

    @classmethod
    def open(cls, url, parsed, *, timeout, **options):
        raise AssertionError("never opened: file:// is the built-in's")
