"""A radix trie over token sequences: which stored checkpoints share the longest prefix with a prompt.

Edges carry runs of tokens (numpy int32 arrays) and split only where checkpoints diverge, so
memory grows with the number of checkpoints and branch points, not with total tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class _Node:
    label: np.ndarray  # tokens on the edge from the parent into this node
    children: dict[int, _Node] = field(default_factory=dict)  # first label token -> child
    ids: set[str] = field(default_factory=set)  # checkpoints whose tokens end exactly here


@dataclass
class Walk:
    """Where a prompt leaves the trie.

    ``exact``: (depth, ids) of every checkpoint whose tokens are a prefix of the prompt.
    ``diverge``: how many prompt tokens the trie matched; every checkpoint in ``below`` shares
    exactly that many tokens with the prompt and is longer than that.
    """

    exact: list[tuple[int, set[str]]]
    diverge: int
    below: list[_Node]


class TokenTrie:
    def __init__(self) -> None:
        self._root = _Node(np.zeros(0, np.int32))

    def insert(self, tokens: np.ndarray, cid: str) -> None:
        node, d = self._root, 0
        while d < len(tokens):
            child = node.children.get(int(tokens[d]))
            if child is None:
                leaf = _Node(tokens[d:].copy())
                node.children[int(tokens[d])] = leaf
                node = leaf
                d = len(tokens)
                break
            k = common_prefix(child.label, tokens[d:])
            if k < len(child.label):  # split the edge at k
                mid = _Node(child.label[:k].copy())
                child.label = child.label[k:].copy()
                mid.children[int(child.label[0])] = child
                node.children[int(mid.label[0])] = mid
                child = mid
            node, d = child, d + k
        node.ids.add(cid)

    def remove(self, tokens: np.ndarray, cid: str) -> None:
        path = [self._root]
        node, d = self._root, 0
        while d < len(tokens):
            child = node.children.get(int(tokens[d]))
            if child is None or common_prefix(child.label, tokens[d:]) < len(child.label):
                return
            node, d = child, d + len(child.label)
            path.append(node)
        node.ids.discard(cid)
        # Prune empty leaves and merge single-child chains left behind.
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
            if child.ids or len(child.children) > 1:
                break
            key = int(child.label[0])
            if not child.children:
                del parent.children[key]
                continue
            (only,) = child.children.values()
            only.label = np.concatenate([child.label, only.label])
            parent.children[key] = only
            break

    def walk(self, prompt: np.ndarray) -> Walk:
        exact: list[tuple[int, set[str]]] = []
        node, d = self._root, 0
        if node.ids:
            exact.append((0, set(node.ids)))
        while d < len(prompt):
            child = node.children.get(int(prompt[d]))
            if child is None:
                return Walk(exact, d, list(node.children.values()))
            k = common_prefix(child.label, prompt[d:])
            if k < len(child.label):
                return Walk(exact, d + k, [child])
            node, d = child, d + k
            if node.ids:
                exact.append((d, set(node.ids)))
        return Walk(exact, d, list(node.children.values()))

    @staticmethod
    def ids_below(nodes: list[_Node]) -> Iterator[str]:
        stack = list(nodes)
        while stack:
            n = stack.pop()
            yield from n.ids
            stack.extend(n.children.values())
