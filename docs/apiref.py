"""Build ``docs/api.md``, the API reference, from the public API's docstrings.

    python docs/apiref.py            # rewrite docs/api.md
    python docs/apiref.py --check    # exit 1 when docs/api.md differs from the code

What is public: ``hurraykv.__all__`` and the ``__all__`` of the modules in ``MODULES``
(the wire floor, the Redis store, the engine adapters); a module without ``__all__`` gives
the classes and functions it defines whose names do not start with ``_``.  For each name:
its signature (``inspect.signature``, annotations as written) and its docstring, whole;
for each class, its public methods and properties, with the first paragraph of theirs
(the full text is a ``help()`` away); for each module, its docstring.  Names are listed
in ``__all__`` order, methods in the order the class defines them, so the output depends
only on the code:
``tests/docs/test_api_reference.py`` regenerates it and fails when ``docs/api.md`` differs.

The vLLM connector (``hurraykv.integrations.vllm``) imports vLLM, which the main
environment does not hold; its interface is its configuration, documented and tested
in ``docs/vllm.md``.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import re
import sys
import typing
import warnings
from pathlib import Path

OUT = Path(__file__).resolve().parent / "api.md"

# (module, why a user imports it); hurraykv itself comes first.
MODULES = [
    ("hurraykv", "snapshots, tensors, files, streams, the client, server and store, "
                 "descriptors and the errors"),
    ("hurraykv.wire", "element types, layouts, buffer handles, sub-byte packing"),
    ("hurraykv.wire.quant_registry", "quantization schemes: the `QuantScheme` base a "
                                     "scheme class subclasses, `register`, the registry"),
    ("hurraykv.store", "the Redis/Valkey page store (`pip install 'hurraykv[redis]'`)"),
    ("hurraykv.adapters.vllm", "vLLM V1 caches (`[adapters]`: PyTorch)"),
    ("hurraykv.adapters.flashinfer", "FlashInfer caches (`[adapters]`)"),
    ("hurraykv.adapters.sglang", "SGLang pools (`[adapters]`)"),
    ("hurraykv.adapters.transformers", "Transformers caches (`[adapters]`)"),
    ("hurraykv.chunks", "chunk stores: the `ChunkStore` base a store class subclasses, its "
                        "`Option`s, `open_store`, the registry (until issue 48 "
                        "`hurraykv.integrations.chunks`, which keeps working for one release)"),
    ("hurraykv.testing", "the contracts a chunk store, quantization scheme or server "
                         "operation from any package runs (pytest)"),
    ("hurraykv.net.extensions", "private server operations, by name (the EXTENSION "
                                "envelope, H95)"),
]


def public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, o in vars(module).items() if not n.startswith("_")
            and (inspect.isclass(o) or inspect.isfunction(o))
            and getattr(o, "__module__", None) == module.__name__]


def text(doc: str | None, whole: bool) -> str:
    """A docstring, cleaned; its first paragraph unless ``whole``."""
    doc = inspect.cleandoc(doc or "").strip()
    if not whole:
        doc = doc.split("\n\n", 1)[0]
    return doc


class _Written(str):
    """An annotation shown as written in the source (``from __future__ import annotations``
    keeps annotations as text, which ``inspect`` would show quoted)."""

    def __repr__(self) -> str:
        return str(self)


def _written(annotation):
    if isinstance(annotation, typing.ForwardRef):  # a NamedTuple's field annotations
        annotation = annotation.__forward_arg__
    return _Written(annotation) if isinstance(annotation, str) else annotation


def signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    sig = sig.replace(
        parameters=[p.replace(annotation=_written(p.annotation))
                    for p in sig.parameters.values()],
        return_annotation=_written(sig.return_annotation))
    sig = str(sig)
    if re.search(r" at 0x[0-9a-f]+", sig):  # a default shown by address: not deterministic
        raise ValueError(f"{obj!r}: a signature shown with an address: {sig}")
    return sig


def own_members(cls) -> list[tuple[str, object]]:
    """Public methods and properties, in definition order, from the class and the
    hurraykv classes it inherits from (the nearest definition wins)."""
    seen, out = set(), []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("hurraykv"):
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(raw, (staticmethod, classmethod, property)) or \
                    inspect.isfunction(raw):
                out.append((name, raw))
    return out


def member(cls, name: str, raw) -> list[str]:
    if isinstance(raw, property):
        head = f"- `{name}` (property)"
        doc = text(raw.fget.__doc__ if raw.fget else None, whole=False)
    else:
        fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        kind = {staticmethod: " (static)", classmethod: " (class method)"}.get(type(raw), "")
        sig = signature(getattr(cls, name))
        head = f"- `{name}{sig}`{kind}"
        doc = text(fn.__doc__, whole=False)
    if not doc:
        return [head]
    return [head + ":", *("  " + line if line else "" for line in doc.splitlines())]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, only letters, digits, - and _."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def entry(qualified: str, obj, seen: dict[int, str]) -> list[str]:
    lines = [f"### `{qualified}`", ""]
    if id(obj) in seen and (inspect.isclass(obj) or callable(obj)):
        first = seen[id(obj)]
        return lines + [f"The same object as [`{first}`](#{anchor(first)}).", ""]
    seen[id(obj)] = qualified
    short = qualified.rsplit(".", 1)[1]
    if getattr(obj, "__name__", short) != short and (inspect.isclass(obj) or callable(obj)):
        lines += [f"Another name of `{obj.__name__}`.", ""]
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            bases = ", ".join(b.__name__ for b in obj.__bases__)
            lines += [f"```python\nclass {obj.__name__}({bases})\n```", ""]
        elif issubclass(obj, enum.Enum):
            lines += [f"```python\nclass {obj.__name__}: {', '.join(m.name for m in obj)}\n```",
                      ""]
        else:
            sig = signature(obj).removesuffix(" -> None")
            lines += [f"```python\nclass {obj.__name__}{sig}\n```", ""]
        doc = text(obj.__doc__, whole=True)
        inherited = [b for b in obj.__mro__[1:] if b.__doc__ == obj.__doc__]
        if doc and not inherited:
            lines += [doc, ""]
        if not issubclass(obj, BaseException):
            members = [m for name, raw in own_members(obj) for m in member(obj, name, raw)]
            if members:
                lines += members + [""]
    elif callable(obj):
        lines += [f"```python\n{obj.__name__}{signature(obj)}\n```", ""]
        doc = text(obj.__doc__, whole=True)
        if doc:
            lines += [doc, ""]
    else:
        shown = repr(obj)
        if len(shown) > 200 or re.search(r" at 0x[0-9a-f]+", shown):
            shown = f"{type(obj).__name__} of {len(obj)} entries" if hasattr(obj, "__len__") \
                else type(obj).__name__
        lines += [f"A constant: `{shown}`.", ""]
    return lines


def build() -> str:
    out = ["# API reference", "",
           "Generated from the docstrings by `python docs/apiref.py`; do not edit by hand",
           "(`tests/docs/test_api_reference.py` fails when this file and the code differ). The",
           "vLLM connector is configured, not called: see `docs/vllm.md`.", ""]
    toc, body, seen = [], [], {}
    for name, why in MODULES:
        module = importlib.import_module(name)
        toc.append(f"* [`{name}`](#{anchor(name)}): {why}")
        body += [f"## `{name}`", ""]
        doc = text(module.__doc__, whole=True)
        if doc:
            body += [doc, ""]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for public in public_names(module):
                obj = getattr(module, public)
                body += entry(f"{name}.{public}", obj, seen)
    text_out = "\n".join(out + toc + [""] + body).rstrip() + "\n"
    return re.sub(r"[ \t]+\n", "\n", text_out)


def main(argv: list[str]) -> int:
    built = build()
    if "--check" in argv:
        if OUT.read_text() != built:
            print(f"{OUT} differs from the code: run python docs/apiref.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(built)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
