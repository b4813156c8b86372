"""``PlanView``: the plan of a long agent task as a checklist in the conversation.

A task that names two or more new files is planned first (``agents.planned``): one item per
file with its features. The view appears when the plan is made and is updated in place as
items are ticked (the file was written) or given up, so the user sees where the run is.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from agents.plan import Plan

MARKS = {"done": "✓", "given_up": "✗", "current": "▸", "todo": "○"}
MARK_STYLES = {"done": "green", "given_up": "red", "current": "bold yellow", "todo": "dim"}
FEATURES_WIDTH = 90  # characters of an item's features shown on its line


def item_state(plan: Plan, index: int) -> str:
    item = plan.items[index]
    if item.done:
        return "done"
    if item.given_up:
        return "given_up"
    nxt = next((n for n, i in enumerate(plan.items) if not i.done and not i.given_up), None)
    return "current" if nxt == index else "todo"


def plan_text(plan: Plan) -> Text:
    done = sum(1 for i in plan.items if i.done)
    out = Text(f"Plan · {done} of {len(plan.items)} done", style="bold")
    for n, item in enumerate(plan.items):
        state = item_state(plan, n)
        out.append(f"\n{MARKS[state]} {n + 1}. ", style=MARK_STYLES[state])
        out.append(item.path, style="bold" if state == "current" else "")
        if item.features:
            features = item.features if len(item.features) <= FEATURES_WIDTH else item.features[:FEATURES_WIDTH - 1] + "…"
            out.append(f" — {features}", style="dim")
        if state == "given_up":
            out.append("  (given up: nothing was written)", style="dim italic")
    return out


class PlanView(Static):
    """The run's plan, one line per item; ``show`` replaces it with the plan as it is now."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan_text(plan), classes="plan-view")
        self.plan = plan

    def show(self, plan: Plan) -> None:
        self.plan = plan
        self.update(plan_text(plan))

    @property
    def text(self) -> str:
        return plan_text(self.plan).plain
