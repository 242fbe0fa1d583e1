"""The workload generators of benchmarks/bench_anchors.py: the shapes of LMCache's
long-doc-qa and multi-round-qa and of vLLM's prefix_repetition that docs/benchmarks.md
reports figures for (no engine here: the generators alone)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_anchors as ba


def test_repeat_modes_order_prompts_as_lmcache_does():
    assert ba.repeat_prompts([1, 2, 3], 2, "tile") == [1, 2, 3, 1, 2, 3]
    assert ba.repeat_prompts([1, 2, 3], 2, "interleave") == [1, 1, 2, 2, 3, 3]
    shuffled = ba.repeat_prompts([1, 2, 3], 2, "random", seed=5)
    assert sorted(shuffled) == [1, 1, 2, 2, 3, 3]
    assert shuffled == ba.repeat_prompts([1, 2, 3], 2, "random", seed=5)
    with pytest.raises(ValueError, match=r"'cycle'.*tile, interleave, random"):
        ba.repeat_prompts([1], 2, "cycle")


def test_long_doc_qa_asks_every_stored_document_again_in_tile_order():
    wl = ba.LongDocQA(n_docs=3, doc_tokens=2000, repeat=2, question_tokens=16)
    assert [len(d) for d in wl.docs] == [2000] * 3
    assert len({tuple(d) for d in wl.docs}) == 3
    assert [i for i, _ in wl.queries] == [0, 1, 2, 0, 1, 2]
    for i, query in wl.queries:
        assert query[:2000] == wl.docs[i] and len(query) == 2016
    # a question of its own per query: the store serves the document only
    assert len({tuple(q[2000:]) for _, q in wl.queries}) == 6
    assert all(1 <= t < ba.VOCAB for d in wl.docs for t in d)


def test_long_doc_qa_queries_reuse_all_a_document_stored():
    """A stored document's whole chunks (of its 2,000 tokens: 1,984) are what a query
    can load, with hurraykv's lookup (whole chunks of the prompt less its last token)
    and with ExampleConnector's (its own alignment of prompt length - 1)."""
    wl = ba.LongDocQA(n_docs=2)

    def stored(n: int) -> int:
        return (n - 1) // ba.BLOCK * ba.BLOCK

    for i, query in wl.queries:
        assert stored(len(wl.docs[i])) == 1984
        assert stored(len(query)) == 1984  # hurraykv
        assert (len(query) - 2) // ba.BLOCK * ba.BLOCK == 1984  # ExampleConnector


def test_pre_warmup_prompts_never_hit():
    wl = ba.LongDocQA()
    first, fresh = wl.pre_warmup_prompts(0), wl.pre_warmup_prompts(1)
    assert len(first) == len(fresh) == wl.pre_warmup == 2
    prefixes = {tuple(p[:ba.BLOCK]) for p in first + fresh + wl.docs}
    assert len(prefixes) == 4 + len(wl.docs)


def test_multi_round_qa_histories_grow_from_a_shared_system_prompt():
    wl = ba.MultiRoundQA(users=4, rounds=4, qps=1.0, system_tokens=512, user_tokens=1024,
                         question_tokens=16, answer_tokens=32)
    assert wl.gap == 4.0 and wl.join_gap == 3.0
    firsts = [wl.first_prompt(u) for u in range(4)]
    assert all(p[:512] == wl.system and len(p) == 512 + 1024 + 16 for p in firsts)
    assert len({tuple(p[512:1536]) for p in firsts}) == 4  # a context per user
    prompt = firsts[0]
    for r in range(1, 4):
        answer = list(range(1, 33))
        grown = wl.next_prompt(prompt, answer, 0, r)
        assert grown[:len(prompt)] == prompt
        assert grown[len(prompt):] == answer + wl.questions[0][r]
        prompt = grown
    assert len(prompt) == 512 + 1024 + 4 * 16 + 3 * 32


def test_prefix_repetition_is_a_few_prefixes_with_many_suffixes_shuffled():
    wl = ba.PrefixRepetition(num_prefixes=4, per_prefix=6, prefix_tokens=1024,
                             suffix_tokens=128)
    assert len(wl.prompts) == 24
    assert all(len(p) == 1152 for _, p in wl.prompts)
    by_prefix = Counter(tuple(p[:1024]) for _, p in wl.prompts)
    assert sorted(by_prefix.values()) == [6] * 4
    assert len({tuple(p[1024:]) for _, p in wl.prompts}) == 24
    owners = [i for i, _ in wl.prompts]
    assert owners != sorted(owners)  # shuffled, not grouped by prefix
    assert wl.prompts == ba.PrefixRepetition(num_prefixes=4, per_prefix=6,
                                             prefix_tokens=1024, suffix_tokens=128).prompts


@pytest.mark.parametrize("quick", [False, True])
def test_every_request_fits_the_servers_model_length(quick):
    wl = ba.Workloads.make(quick)
    longest_chat = (wl.chat.system_tokens + wl.chat.user_tokens
                    + wl.chat.rounds * wl.chat.question_tokens
                    + wl.chat.rounds * wl.chat.answer_tokens)
    longest_doc = max(len(q) for _, q in wl.doc.queries) + wl.doc.output_tokens
    longest_prefix = max(len(p) for _, p in wl.prefix.prompts) + wl.prefix.output_tokens
    assert max(longest_chat, longest_doc, longest_prefix) <= ba.MAX_MODEL_LEN
    sizes = (wl.doc.n_docs, wl.chat.users, len(wl.prefix.prompts))
    assert sizes == ((2, 2, 4) if quick else (4, 3, 12))


def test_the_anchors_table_is_documented_as_the_script_prints_it():
    """docs/benchmarks.md carries the three tables under the script's own column heads,
    with when, where and at which commit they were measured; README and the Makefile name
    the target that runs it."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "benchmarks.md").read_text()
    section = doc.split("## vLLM: the anchors' own workloads (`benchmarks/bench_anchors.py`)",
                        1)[1].split("\n## ", 1)[0]
    head = " | ".join(ba.grid("doc", "t", [])[1])
    blocks = section.split("```\n")[1::2]
    for workload in ("long-doc-qa:", "multi-round-qa:", "prefix_repetition:"):
        tables = [b.splitlines() for b in blocks if b.startswith(workload)]
        assert len(tables) == 1, workload
        assert tables[0][1].split() == head.split(), workload
    assert "commit" in section and "make bench-anchors" in section
    assert "`make bench-anchors`" in (root / "README.md").read_text()
    makefile = (root / "Makefile").read_text()
    assert "bench-anchors: $(VLLM_STAMP)\n\t$(VLLM_PY) benchmarks/bench_anchors.py" in makefile
