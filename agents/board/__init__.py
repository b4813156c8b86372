"""The Kanban task board: agent tasks as cards that queue, run, get checked and reviewed.

``model`` (cards, attempts, the one transitions table), ``store`` (SQLite beside the sessions
plus an append-only JSONL event log per card), ``runner`` (one attempt: workspace, agent
session, checks, diff), ``dispatcher`` (WIP limits, priority, dependencies, retries, crash
recovery) and ``export`` (the JSON other tools read). See docs/board.md.
"""
