"""Okapi BM25 over an in-memory corpus (lower-cased alphanumeric terms, no stemming)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

_TERM = re.compile(r"[a-z0-9]+")


def terms(text: str) -> list[str]:
    return _TERM.findall(text.lower())


@dataclass(frozen=True)
class Document:
    id: str
    contents: str  # Search-R1 convention: '"Title"\ntext'

    def as_json(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


class BM25Index:
    def __init__(self, documents: Sequence[Document], k1: float = 1.2, b: float = 0.75) -> None:
        if not documents:
            raise ValueError("the corpus is empty")
        self.documents = list(documents)
        self.k1, self.b = k1, b
        self._tf = [Counter(terms(d.contents)) for d in self.documents]
        self._length = [sum(tf.values()) for tf in self._tf]
        self._avg = sum(self._length) / len(self._length) or 1.0
        df: Counter[str] = Counter()
        for tf in self._tf:
            df.update(tf.keys())
        n = len(self.documents)
        self._idf = {t: math.log(1.0 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}
        self._postings: dict[str, list[int]] = {}
        for i, tf in enumerate(self._tf):
            for t in tf:
                self._postings.setdefault(t, []).append(i)

    def search(self, query: str, k: int) -> list[tuple[Document, float]]:
        scores: dict[int, float] = {}
        for t in set(terms(query)):
            idf = self._idf.get(t)
            if idf is None:
                continue
            for i in self._postings[t]:
                f = self._tf[i][t]
                norm = f + self.k1 * (1 - self.b + self.b * self._length[i] / self._avg)
                scores[i] = scores.get(i, 0.0) + idf * f * (self.k1 + 1) / norm
        ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [(self.documents[i], s) for i, s in ranked]
