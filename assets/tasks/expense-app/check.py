"""Browser acceptance checks for the expense-app task: 13 categories -> ``quality.json``.

A second web-app task beside the Kanban board, so gains on long agent tasks are not fitted to
one spec: a validated form, money shown with two decimals, a dialog, a filter the total
follows, sorting and per-category sums. Every category starts from a fresh app (localStorage
cleared, page reloaded), builds what it needs through the UI and reports ``pass``, ``fail``
(the failing assertion) or ``blocked`` (a prerequisite is missing), with a screenshot.

    check.py --score [--workspace DIR] [--out FILE]   # run the browser once, write quality.json
    check.py CATEGORY [--out FILE]                    # exit 0 iff CATEGORY passed in quality.json

``--out`` defaults to ``$MLXTERM_RUN_DIR/quality.json``, else ``./quality.json``. The browser,
server, scoring loop and command line are shared with the other web-app tasks
(``../webcheck.py``, which says what they need); this file holds the app's categories.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tasks folder: webcheck.py
import webcheck  # noqa: E402
from webcheck import Blocked, Fail, expect, expect_soon  # noqa: E402

browser_missing = webcheck.browser_missing
launch_browser = webcheck.launch_browser

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("add_expense", "add an expense"),
    ("validation", "invalid input adds nothing and shows an error"),
    ("total", "total with two decimals"),
    ("delete_expense", "delete an expense"),
    ("edit_expense", "edit an expense in the dialog"),
    ("filter_category", "filter by category"),
    ("filtered_total", "the total follows the filter"),
    ("sort_date", "newest first by default"),
    ("sort_amount", "sort by amount"),
    ("category_totals", "per-category totals"),
    ("persistence", "persistence across reload"),
    ("console_errors", "no console errors"),
    ("accessible_names", "accessible names on controls"),
)
CENT = 0.005  # amounts compared as numbers are equal within half a cent
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

_ROWS_JS = """
const text = (el) => (el ? el.textContent : '').trim();
return Array.from(document.querySelectorAll('[data-testid=expense]')).map((r) => ({
  description: text(r.querySelector('[data-testid=expense-description]')),
  amount: text(r.querySelector('[data-testid=expense-amount]')),
  category: text(r.querySelector('[data-testid=expense-category]')),
  date: text(r.querySelector('[data-testid=expense-date]')),
  visible: r.getClientRects().length > 0 && getComputedStyle(r).visibility !== 'hidden',
}));
"""


def number(text: str | None) -> str | None:
    """The last number written in ``text`` ("Total: $12.80" -> "12.80"), as written; None if none."""
    found = _NUMBER.findall((text or "").replace(",", ""))
    return found[-1] if found else None


def same_amount(text: str | None, want: float) -> bool:
    got = number(text)
    return got is not None and abs(float(got) - want) < CENT


class Page(webcheck.Page):
    """One browser tab on the served expense tracker."""

    ready_css = "#expense-list"
    not_ready = "the app did not render: no #expense-list element after loading index.html"

    def rows(self) -> list[dict[str, Any]]:
        return self.d.execute_script(_ROWS_JS)

    def descriptions(self, visible_only: bool = False) -> list[str]:
        return [r["description"] for r in self.rows() if r["visible"] or not visible_only]

    def row(self, description: str):
        for r in self.d.find_elements("css selector", "[data-testid=expense]"):
            d = r.find_elements("css selector", "[data-testid=expense-description]")
            if d and d[0].get_attribute("textContent").strip() == description:
                return r
        raise Fail(f"no expense {description!r} in the list")

    def row_data(self, description: str) -> dict[str, Any]:
        found = [r for r in self.rows() if r["description"] == description]
        if not found:
            raise Fail(f"no expense {description!r} in the list: {self.descriptions()}")
        return found[0]

    def total_text(self) -> str:
        return self.one("#total", "total").get_attribute("textContent").strip()

    def error_shown(self) -> bool:
        found = self.d.find_elements("css selector", "#form-error")
        return bool(found) and found[0].is_displayed() and bool(found[0].get_attribute("textContent").strip())

    def field(self, css: str, what: str, blocked: bool = False):
        """The input or textarea ``css`` names; a readable reason when the first element with
        that id is something else (a duplicated id on a form or a wrapper)."""
        el = self.one(css, what, blocked=blocked)
        tag = el.tag_name.lower()
        if tag not in ("input", "textarea"):
            msg = f"{css} ({what}) is a <{tag}>, not an input: ids must be unique and name the input itself"
            raise Blocked(msg) if blocked else Fail(msg)
        return el

    def fill(self, description: str, amount: str, category: str = "", date: str = "",
             blocked: bool = False) -> None:
        """Fill the add-expense form (without submitting it)."""
        self.type_into(self.field("#expense-description", "description input", blocked=blocked), description)
        self.type_into(self.field("#expense-amount", "amount input", blocked=blocked), amount)
        if category:
            self.select("#expense-category", category, "category select", blocked=blocked)
        if date:
            self.set_value(self.field("#expense-date", "date input", blocked=blocked), date)

    def add_expense(self, description: str, amount: float | str, category: str = "food",
                    date: str = "2026-03-01", blocked: bool = True) -> None:
        """Add an expense through the form (a prerequisite unless ``blocked=False``)."""
        before = len(self.rows())
        self.fill(description, str(amount), category, date, blocked=blocked)
        self.one("#add-expense", "add expense button", blocked=blocked).click()

        def added() -> bool:
            return len(self.rows()) > before and description in self.descriptions()

        if not self.until(added):
            msg = f"adding expense {description!r} through the form did not put it in the list"
            raise Blocked(msg + " (add an expense is broken)") if blocked else Fail(msg)

    def dialog_open(self) -> bool:
        return self.shown("#expense-dialog")


def _total_is(p: Page, want: float, what: str) -> None:
    expect_soon(p, lambda: same_amount(p.total_text(), want),
                lambda: f"{what}: #total shows {p.total_text()!r}, want {want:.2f}")


# -- the categories ----------------------------------------------------------------------------
def check_add_expense(p: Page) -> str:
    p.add_expense("Groceries", "23.4", "food", "2026-02-14", blocked=False)
    p.add_expense("Bus pass", "45", "transport", "2026-02-15", blocked=False)
    for desc, amount, category, date in (("Groceries", 23.4, "food", "2026-02-14"),
                                         ("Bus pass", 45, "transport", "2026-02-15")):
        got = p.row_data(desc)
        expect(same_amount(got["amount"], amount), f"{desc}: amount shows {got['amount']!r}, want {amount:.2f}")
        expect(category in got["category"].lower(), f"{desc}: category shows {got['category']!r}, want {category!r}")
        expect(date in got["date"], f"{desc}: date shows {got['date']!r}, want {date!r}")
    for css in ("#expense-description", "#expense-amount"):
        value = p.one(css, "form input").get_attribute("value")
        expect(value == "", f"{css} is not cleared after adding an expense (it holds {value!r})")
    return "two expenses listed with description, amount, category and date; the form is cleared"


def check_validation(p: Page) -> str:
    def rejected(description: str, amount: str, why: str, error: bool) -> None:
        n = len(p.rows())
        p.fill(description, amount)
        p.one("#add-expense", "add expense button").click()
        time.sleep(0.2)
        expect(len(p.rows()) == n, f"{why} added an expense: {p.descriptions()}")
        if error:
            expect_soon(p, p.error_shown, f"{why}: #form-error is not shown (or empty)")

    rejected("", "5", "an empty description", error=True)
    p.add_expense("Coffee", "3.5", blocked=True)
    expect_soon(p, lambda: not p.error_shown(), "#form-error still shown after a valid expense was added")
    rejected("Free sample", "0", "amount 0", error=True)
    rejected("Refund", "-4", "amount -4", error=False)
    rejected("Nothing", "", "an empty amount", error=False)
    return "empty description, amount 0, -4 and empty add nothing and show #form-error; a valid add hides it"


def check_total(p: Page) -> str:
    empty = number(p.total_text())
    expect(empty == "0.00", f"with no expenses #total shows {p.total_text()!r}, want 0.00")
    for desc, amount in (("Lunch", "12.5"), ("Gum", "0.1"), ("Stamp", "0.2")):
        p.add_expense(desc, amount)
    expect_soon(p, lambda: number(p.total_text()) == "12.80",
                lambda: f"12.50 + 0.10 + 0.20: #total shows {p.total_text()!r}, want 12.80")
    shown = {r["description"]: number(r["amount"]) for r in p.rows()}
    expect(shown == {"Lunch": "12.50", "Gum": "0.10", "Stamp": "0.20"},
           f"amounts are not written with two decimals: {shown}")
    return "#total is 0.00, then 12.80 for 12.50 + 0.10 + 0.20; amounts show two decimals"


def check_delete_expense(p: Page) -> str:
    p.add_expense("Keep", "10")
    p.add_expense("Remove", "5", "fun")
    p.one("[data-testid=delete-expense]", "delete button", root=p.row("Remove")).click()
    expect_soon(p, lambda: p.descriptions() == ["Keep"], lambda: f"after deleting Remove the list has {p.descriptions()}")
    _total_is(p, 10, "after deleting Remove")
    return "the deleted expense is gone, the other stays, the total follows"


def _open_editor(p: Page, description: str) -> None:
    p.one("[data-testid=edit-expense]", "edit button", root=p.row(description)).click()
    expect_soon(p, p.dialog_open, "clicking edit-expense did not show #expense-dialog")


def check_edit_expense(p: Page) -> str:
    p.add_expense("Taxi", "18", "transport", "2026-03-03")
    _open_editor(p, "Taxi")
    desc = p.field("#edit-description", "edit description input")
    amount = p.field("#edit-amount", "edit amount input")
    category = p.one("#edit-category", "edit category select")
    expect(desc.get_attribute("value") == "Taxi", f"#edit-description shows {desc.get_attribute('value')!r}, not 'Taxi'")
    expect(same_amount(amount.get_attribute("value"), 18), f"#edit-amount shows {amount.get_attribute('value')!r}, not 18")
    expect(category.get_attribute("value") == "transport",
           f"#edit-category shows {category.get_attribute('value')!r}, not 'transport'")
    p.type_into(desc, "Taxi home")
    p.type_into(amount, "21.5")
    p.select("#edit-category", "fun", "edit category select")
    p.one("#save-expense", "save button").click()
    expect_soon(p, lambda: not p.dialog_open(), "#expense-dialog still shown after #save-expense")
    expect_soon(p, lambda: p.descriptions() == ["Taxi home"], lambda: f"description not updated: {p.descriptions()}")
    got = p.row_data("Taxi home")
    expect(same_amount(got["amount"], 21.5), f"amount not updated: {got['amount']!r}, want 21.50")
    expect("fun" in got["category"].lower(), f"category not updated: {got['category']!r}, want 'fun'")
    _total_is(p, 21.5, "after editing the amount to 21.50")
    _open_editor(p, "Taxi home")
    p.type_into(p.field("#edit-description", "edit description input"), "Not saved")
    p.one("#cancel-edit", "cancel button").click()
    expect_soon(p, lambda: not p.dialog_open(), "#expense-dialog still shown after #cancel-edit")
    expect(p.descriptions() == ["Taxi home"], f"#cancel-edit changed the expense: {p.descriptions()}")
    return "description, amount and category edited through #expense-dialog; cancel keeps them"


FILTER_SET = (("Bread", "3.2", "food", "2026-01-05"), ("Train", "12", "transport", "2026-01-06"),
              ("Power", "60", "bills", "2026-01-07"), ("Cinema", "9.5", "fun", "2026-01-08"),
              ("Pizza", "14", "food", "2026-01-09"))


def _filter_set(p: Page) -> None:
    for row in FILTER_SET:
        p.add_expense(*row)


def _visible(p: Page, want: set[str], what: str) -> None:
    expect_soon(p, lambda: set(p.descriptions(visible_only=True)) == want,
                lambda: f"{what}: visible expenses {sorted(p.descriptions(visible_only=True))}, want {sorted(want)}")


def check_filter_category(p: Page) -> str:
    _filter_set(p)
    p.select("#filter-category", "food", "category filter")
    _visible(p, {"Bread", "Pizza"}, "filter 'food'")
    p.select("#filter-category", "bills", "category filter")
    _visible(p, {"Power"}, "filter 'bills'")
    p.select("#filter-category", "", "category filter ('All categories')")
    _visible(p, {r[0] for r in FILTER_SET}, "filter back to 'All categories'")
    return "the filter shows only that category's expenses; 'All categories' shows every one"


def check_filtered_total(p: Page) -> str:
    _filter_set(p)
    _total_is(p, 98.7, "all five expenses")
    p.select("#filter-category", "food", "category filter", blocked=True)
    if not p.until(lambda: set(p.descriptions(visible_only=True)) == {"Bread", "Pizza"}):
        raise Blocked("the category filter 'food' does not filter, so the total cannot follow it")
    _total_is(p, 17.2, "filter 'food' (Bread 3.20 + Pizza 14.00)")
    p.select("#filter-category", "transport", "category filter")
    _total_is(p, 12, "filter 'transport' (Train 12.00)")
    return "#total is the sum of the visible expenses: 98.70 in all, 17.20 food, 12.00 transport"


def check_sort_date(p: Page) -> str:
    for desc, date in (("Old", "2025-12-31"), ("Newest", "2026-03-02"), ("Middle", "2026-01-15")):
        p.add_expense(desc, "5", "food", date)
    expect_soon(p, lambda: p.descriptions() == ["Newest", "Middle", "Old"],
                lambda: f"newest date first: the list is {p.descriptions()}, want ['Newest', 'Middle', 'Old']")
    p.add_expense("Earliest", "5", "food", "2025-06-01")
    want = ["Newest", "Middle", "Old", "Earliest"]
    expect_soon(p, lambda: p.descriptions() == want,
                lambda: f"after adding an older expense the list is {p.descriptions()}, want {want}")
    return "a fresh list shows the newest date first, whatever the order of adding"


def check_sort_amount(p: Page) -> str:
    for desc, amount, date in (("Five", "5", "2026-01-02"), ("Thirty", "30", "2026-01-01"),
                               ("Big", "120.5", "2026-01-03")):
        p.add_expense(desc, amount, "food", date)
    p.select("#sort", "amount-desc", "sort select")
    expect_soon(p, lambda: p.descriptions() == ["Big", "Thirty", "Five"],
                lambda: f"sort 'amount-desc': the list is {p.descriptions()}, want ['Big', 'Thirty', 'Five']")
    p.select("#sort", "amount-asc", "sort select")
    expect_soon(p, lambda: p.descriptions() == ["Five", "Thirty", "Big"],
                lambda: f"sort 'amount-asc': the list is {p.descriptions()}, want ['Five', 'Thirty', 'Big']")
    return "amounts sorted as numbers, largest first and smallest first"


def _category_totals(p: Page) -> dict[str, str]:
    entries = p.d.find_elements("css selector", "#category-totals [data-testid=category-total]")
    return {(e.get_attribute("data-category") or "").strip(): e.get_attribute("textContent").strip() for e in entries}


def check_category_totals(p: Page) -> str:
    p.one("#category-totals", "category totals")
    for desc, amount, category in (("Bread", "3.2", "food"), ("Pizza", "14", "food"), ("Train", "12", "transport")):
        p.add_expense(desc, amount, category)

    def right(want: dict[str, str]) -> bool:
        got = _category_totals(p)
        return (all(number(got.get(c)) == v for c, v in want.items())
                and all(number(t) in (None, "0.00", "0") for c, t in got.items() if c not in want))

    want = {"food": "17.20", "transport": "12.00"}
    expect_soon(p, lambda: right(want), lambda: f"per-category totals {_category_totals(p)}, want {want}")
    p.add_expense("Bus", "2.5", "transport")
    want = {"food": "17.20", "transport": "14.50"}
    expect_soon(p, lambda: right(want), lambda: f"after adding Bus 2.50: per-category totals {_category_totals(p)}, want {want}")
    return "one entry per category in use with its sum (food 17.20, transport 14.50)"


def check_persistence(p: Page) -> str:
    p.add_expense("Rent", "800", "bills", "2026-02-01")
    p.add_expense("Snack", "2.75", "food", "2026-02-03")
    before = [{k: v for k, v in r.items() if k != "visible"} for r in p.rows()]
    total = p.total_text()
    p.reload()
    after = p.until(lambda: len(p.rows()) == len(before) and p.rows()) or p.rows()
    got = [{k: v for k, v in r.items() if k != "visible"} for r in after]
    expect(got == before, f"after reload the expenses are {got}, before they were {before}")
    expect(p.total_text() == total, f"after reload #total shows {p.total_text()!r}, before {total!r}")
    return "expenses (descriptions, amounts, categories, dates, order) and the total survive a reload"


def check_accessible_names(p: Page) -> str:
    p.add_expense("Named", "1")
    missing = p.unnamed_controls()
    _open_editor(p, "Named")
    missing += p.unnamed_controls(p.one("#expense-dialog", "expense dialog"))
    expect(not missing, "controls without an accessible name: " + ", ".join(sorted(set(missing))))
    return "every visible button, input, select and textarea has an accessible name"


CHECKS = {name: globals()[f"check_{name}"] for name, _ in CATEGORIES if name != webcheck.CONSOLE}
SUITE = webcheck.Suite(
    kind="expense_quality", label="expense quality", description="Expense-app browser acceptance checks",
    categories=CATEGORIES, checks=CHECKS, page=Page, profile_prefix="expense-chrome-",
    never_loaded="the app never rendered, so there was no session to watch")


def score(workspace: str | Path, out: str | Path, *, driver=None) -> dict[str, Any]:
    """Score the app in ``workspace`` on every category; write and return quality.json
    (screenshots in ``screenshots/`` beside it). Pass a running ``driver`` to reuse one browser
    for several workspaces (tests do)."""
    return webcheck.score(SUITE, workspace, out, driver=driver)


def main(argv: list[str] | None = None) -> int:
    return webcheck.main(SUITE, argv)


if __name__ == "__main__":
    sys.exit(main())
