"""The Kanban task board: agent tasks as cards that queue, run, get checked and reviewed.

``model`` (cards, attempts, the one transitions table), ``store`` (SQLite beside the sessions
plus an append-only JSONL event log per card), ``workspace`` (a card's workspace: empty,
template or git worktree), ``runner`` (one attempt: agent session, checks, diff),
``dispatcher`` (WIP limits, priority, dependencies, retries, crash recovery) and ``actions``
(what a person does to a card, and the JSON export other tools read). See docs/board.md.
"""
