"""The prefix-cache part's file: every document asked every question once, the lines shuffled
(no two neighbours in file order share a document as often as sorted lines would), each line a
document followed by its question."""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise

from batchllm.bench.parts.prefix_cache import PrefixCacheConfig, write_lines
from batchllm.settings import Settings


def test_the_file_asks_every_document_every_question_once_in_shuffled_order(tmp_path):
    config = PrefixCacheConfig(
        model="unused",
        documents=6,
        questions=5,
        document_words=40,
        max_tokens=8,
        kv_documents=2,
        settings=Settings(home=tmp_path / "home"),
        workdir=tmp_path,
        say=print,
    )

    path, lines = write_lines(config)

    stored = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["custom_id"] for s in stored] == [c for c, _, _ in lines]
    assert sorted(s["custom_id"] for s in stored) == sorted(
        f"d{d}-q{q}" for d in range(6) for q in range(5)
    )
    assert Counter(document for _, _, document in lines) == {d: 5 for d in range(6)}
    for custom_id, prompt, document in lines:
        assert prompt.startswith(f"Document {document}. ")
        assert f"Question {custom_id.split('-q')[1]}:" in prompt
    same_as_next = sum(a[2] == b[2] for a, b in pairwise(lines))
    assert same_as_next < 6 * 4  # sorted by document, 24 neighbours would share one
