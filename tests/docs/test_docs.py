"""The docs a user needs live in the repository: nothing points outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_reference_to_paths_outside_the_repository():
    for path in DOCS + sorted((ROOT / "src").rglob("*.py")):
        text = path.read_text()
        for bad in ("../shared", "shared/spec", "shared/design", "shared/engines",
                    "shared/conformance"):
            assert bad not in text, f"{path.relative_to(ROOT)} mentions {bad}"


def test_every_repository_path_the_docs_name_exists():
    named = set()
    for path in DOCS:
        named |= set(re.findall(r"`((?:docs|benchmarks|tests|engine_tests|src)/[\w./-]+)`",
                                path.read_text()))
    missing = [p for p in sorted(named) if not (ROOT / p.rstrip("/")).exists()
               and "*" not in p and "{" not in p]
    assert not missing, missing


# ---- links ------------------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no headings in code
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_link_between_the_docs_reaches_a_file_and_its_heading():
    for path in [*DOCS, ROOT / "CHANGELOG.md"]:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: outside the repository
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.relative_to(ROOT)}: {target}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors(dest), \
                    f"{path.relative_to(ROOT)}: {target}: no such heading in {dest.name}"


def test_the_readme_points_to_every_doc():
    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{path.name})" in readme, f"the README does not link docs/{path.name}"
    assert "(CHANGELOG.md)" in readme


# ---- CHANGELOG.md -----------------------------------------------------------------------
def test_the_changelog_keeps_a_changelog():
    import tomllib

    text = (ROOT / "CHANGELOG.md").read_text()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    releases = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert releases[0] == "Unreleased" and version in releases, releases
    kinds = set(re.findall(r"^### (.+)$", text, re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds
    unreleased = text.split("## [Unreleased]")[1].split("\n## [")[0]
    for change in ('"kv_connector": "HurrayConnector"', "kv_connector_module_path",
                   "checksums=True", "--json", "[tls]", "cryptography"):
        assert change in unreleased, change
    import hurraykv

    assert hurraykv.__version__ == version


# ---- docs/architecture.md's pictures ----------------------------------------------------
def pictures() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return re.findall(r"```text\n(.*?)```", text, re.S)


def test_the_floor_picture_names_modules_that_exist():
    floors = next(p for p in pictures() if "floor 0" in p)
    src = ROOT / "src" / "hurraykv"
    named = re.findall(r"floor \d\s+(\S+)|^\s{12}(\w+/|\w+\.py)\s", floors, re.M)
    paths = {a or b for a, b in named}
    assert {"wire/", "paged.py", "snapshot.py", "io/", "net/", "store/", "adapters/",
            "chunks/", "integrations/", "cli/", "testing/"} <= paths
    for p in paths:
        assert (src / p.rstrip("/")).exists(), p
    order = [int(n) for n in re.findall(r"floor (\d)", floors)]
    assert order == sorted(order, reverse=True) == list(range(9, -1, -1))


def test_the_request_picture_names_the_connector_s_own_calls_and_settings():
    """Every vLLM call the picture shows is a method HurrayConnector defines, every
    module it names exists, every setting is one the connector reads, and docs/vllm.md
    still has the steps it numbers (read from the source: vLLM is not installed here)."""
    import ast

    flow = next(p for p in pictures() if "get_num_new_matched_tokens" in p)
    vllm_dir = ROOT / "src" / "hurraykv" / "integrations" / "vllm"
    tree = ast.parse((vllm_dir / "connector.py").read_text())
    connector = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                     and n.name == "HurrayConnector")
    methods = {n.name for n in connector.body if isinstance(n, ast.FunctionDef)}
    calls = set(re.findall(r"\b((?:get|update|build|start|wait_for|save|request)_[a-z_]+)\b",
                           flow))
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "start_load_kv", "get_finished", "save_kv_layer", "wait_for_save",
            "request_finished", "get_block_ids_with_load_errors"} <= calls
    assert calls <= methods, calls - methods
    for module in re.findall(r"\b(\w+\.py)\b", flow):
        assert (vllm_dir / module).exists(), module
    from hurraykv.integrations.vllm.config import ConnectorConfig

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## One vLLM request through the connector")[1].split("\n## ")[0]
    settings = set(re.findall(r"\b([a-z]+_[a-z_]+)\b", section)) & {
        "lookup_timeout_ms", "load_timeout_ms", "sync_load_max_tokens", "store_threshold",
        "load_mode", "store_dtype"}
    fields = set(ConnectorConfig.__dataclass_fields__)
    assert settings and settings <= fields, settings - fields
    steps = (ROOT / "docs" / "vllm.md").read_text().split("## How a request flows")[1]
    for n in sorted(set(re.findall(r"^ \((\d)\) ", flow, re.M))):
        assert re.search(rf"^{n}\. ", steps, re.M), f"docs/vllm.md has no step {n}"
