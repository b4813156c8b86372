"""Browser acceptance checks for the Kanban-app task: 18 categories -> ``quality.json``.

Every category starts from a fresh board (localStorage cleared, page reloaded), builds what it
needs through the UI and reports ``pass``, ``fail`` (the failing assertion) or ``blocked`` (a
prerequisite is missing: no ``index.html``, no browser, the new-card form does not work...),
with a screenshot. Drag and drop uses synthetic HTML5 drag events (one shared
``DataTransfer``): chromedriver's pointer actions do not start native HTML5 drags.

    check.py --score [--workspace DIR] [--out FILE]   # run the browser once, write quality.json
    check.py CATEGORY [--out FILE]                    # exit 0 iff CATEGORY passed in quality.json

``--out`` defaults to ``$MLXTERM_RUN_DIR/quality.json``, else ``./quality.json``. The browser,
loopback server, sandbox rules, scoring loop and command line are shared with the other web-app
tasks (``../webcheck.py``, which says what they need); this file holds the board's categories.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tasks folder: webcheck.py
import webcheck  # noqa: E402
from webcheck import Blocked, Fail, expect, expect_soon  # noqa: E402

browser_missing = webcheck.browser_missing
launch_browser = webcheck.launch_browser
NoBoard = webcheck.NoApp

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("create_card", "create card"),
    ("edit_card", "edit card title/description"),
    ("delete_card", "delete card"),
    ("columns", "add and rename columns"),
    ("drag_between_columns", "move a card between columns by drag-and-drop"),
    ("reorder_within_column", "reorder within a column"),
    ("keyboard_move", "keyboard move"),
    ("open_with_keyboard", "open a focused card with Enter or Space"),
    ("archive_restore", "archive and restore"),
    ("search", "search"),
    ("filter_label", "filter by label"),
    ("filter_assignee", "filter by assignee"),
    ("filter_combined", "label AND assignee filters combined"),
    ("filter_reset", "resetting a filter shows every card again"),
    ("persistence", "persistence across reload"),
    ("themes", "light and dark themes"),
    ("console_errors", "no console errors"),
    ("accessible_names", "accessible names on controls"),
)

# -- page helpers ------------------------------------------------------------------------------
_DRAG_JS = """
const [src, dst, where] = arguments;
const dt = new DataTransfer();
const r = dst.getBoundingClientRect();
const y = where === 'end' ? r.bottom - 2 : r.top + Math.min(r.height / 4, 6);
const fire = (el, type, x, yy) => el.dispatchEvent(new DragEvent(type, {bubbles: true, cancelable: true,
  composed: true, dataTransfer: dt, clientX: x, clientY: yy}));
const s = src.getBoundingClientRect();
fire(src, 'dragstart', s.left + s.width / 2, s.top + s.height / 2);
fire(dst, 'dragenter', r.left + r.width / 2, y);
fire(dst, 'dragover', r.left + r.width / 2, y);
fire(dst, 'drop', r.left + r.width / 2, y);
fire(src, 'dragend', r.left + r.width / 2, y);
"""

_BOARD_JS = """
const text = (el) => (el ? el.textContent : '').trim();
return Array.from(document.querySelectorAll('[data-testid=column]')).map((col) => ({
  title: text(col.querySelector('[data-testid=column-title]')),
  cards: Array.from(col.querySelectorAll('[data-testid=card]')).map((c) => ({
    title: text(c.querySelector('[data-testid=card-title]')),
    description: text(c.querySelector('[data-testid=card-description]')),
    label: text(c.querySelector('[data-testid=card-label]')),
    assignee: text(c.querySelector('[data-testid=card-assignee]')),
    visible: c.getClientRects().length > 0 && getComputedStyle(c).visibility !== 'hidden',
  })),
}));
"""



class Page(webcheck.Page):
    """One browser tab on the served board, with the few moves the categories are made of."""

    ready_css = "[data-testid=column]"
    not_ready = "the board did not render: no [data-testid=column] element after loading index.html"

    def board(self) -> list[dict[str, Any]]:
        return self.d.execute_script(_BOARD_JS)

    def columns(self):
        return self.d.find_elements("css selector", "[data-testid=column]")

    def card(self, title: str):
        for c in self.d.find_elements("css selector", "[data-testid=card]"):
            t = c.find_elements("css selector", "[data-testid=card-title]")
            if t and t[0].text.strip() == title or (t and t[0].get_attribute("textContent").strip() == title):
                return c
        raise Fail(f"no card titled {title!r} on the board")

    def column_cards(self, index: int) -> list[str]:
        cols = self.board()
        return [c["title"] for c in cols[index]["cards"]] if index < len(cols) else []

    def visible_titles(self) -> set[str]:
        return {c["title"] for col in self.board() for c in col["cards"] if c["visible"]}

    def all_titles(self) -> set[str]:
        return {c["title"] for col in self.board() for c in col["cards"]}

    def add_card(self, title: str, description: str = "", label: str = "", assignee: str = "",
                 blocked: bool = True) -> None:
        """Create a card through the new-card form (a prerequisite unless ``blocked=False``)."""
        before = len(self.all_titles())
        self.type_into(self.one("#new-card-title", "new card title input", blocked=blocked), title)
        if description:
            self.type_into(self.one("#new-card-description", "new card description", blocked=blocked), description)
        if label:
            self.select("#new-card-label", label, "new card label", blocked=blocked)
        if assignee:
            self.select("#new-card-assignee", assignee, "new card assignee", blocked=blocked)
        self.one("#add-card", "add card button", blocked=blocked).click()
        def added() -> bool:
            titles = self.all_titles()
            return title in titles and len(titles) > before

        if not self.until(added):
            msg = f"adding card {title!r} through the new-card form did not put it on the board"
            raise Blocked(msg + " (create card is broken)") if blocked else Fail(msg)

    def focus_card(self, title: str):
        card = self.card(title)
        self.d.execute_script("arguments[0].focus()", card)
        return card

    def drag(self, src, dst, where: str) -> None:
        self.d.execute_script(_DRAG_JS, src, dst, where)

    def focused_title(self) -> str | None:
        return self.d.execute_script(
            "const c = document.activeElement && document.activeElement.closest('[data-testid=card]');"
            "const t = c && c.querySelector('[data-testid=card-title]'); return t ? t.textContent.trim() : null;")

    def dialog_open(self) -> bool:
        return self.shown("#card-dialog")


# -- the categories ----------------------------------------------------------------------------
def check_create_card(p: Page) -> str:
    p.add_card("Buy milk", "two litres", "feature", "carol", blocked=False)
    cards = p.board()[0]["cards"]
    expect(cards and cards[-1]["title"] == "Buy milk", f"the new card is not last in the first column: {p.column_cards(0)}")
    got = cards[-1]
    expect("two litres" in got["description"], f"description not shown on the card: {got['description']!r}")
    expect("feature" in got["label"], f"label not shown on the card: {got['label']!r}")
    expect("carol" in got["assignee"], f"assignee not shown on the card: {got['assignee']!r}")
    expect(p.one("#new-card-title", "title input").get_attribute("value") == "",
           "the title input is not cleared after adding a card")
    n = len(p.all_titles())
    p.one("#add-card", "add card button").click()
    time.sleep(0.2)
    expect(len(p.board()[0]["cards"]) == n, "a card with an empty title was added")
    return "card created in the first column with title, description, label and assignee"


def _open_editor(p: Page, title: str) -> None:
    p.one("[data-testid=edit-card]", "edit button", root=p.card(title)).click()
    expect_soon(p, p.dialog_open, "clicking edit-card did not show #card-dialog")


def check_edit_card(p: Page) -> str:
    p.add_card("Draft", "first words")
    _open_editor(p, "Draft")
    title = p.one("#edit-title", "edit title input")
    expect(title.get_attribute("value") == "Draft", f"#edit-title shows {title.get_attribute('value')!r}, not 'Draft'")
    p.type_into(title, "Final title")
    p.type_into(p.one("#edit-description", "edit description"), "New description")
    p.one("#save-card", "save button").click()
    expect_soon(p, lambda: not p.dialog_open(), "#card-dialog still shown after #save-card")
    expect_soon(p, lambda: "Final title" in p.all_titles(), lambda: f"title not updated: {sorted(p.all_titles())}")
    card = next(c for col in p.board() for c in col["cards"] if c["title"] == "Final title")
    expect(card["description"] == "New description", f"description not updated: {card['description']!r}")
    return "title and description edited through #card-dialog"


def check_delete_card(p: Page) -> str:
    p.add_card("Keep me")
    p.add_card("Remove me")
    p.one("[data-testid=delete-card]", "delete button", root=p.card("Remove me")).click()
    expect_soon(p, lambda: p.all_titles() == {"Keep me"}, lambda: f"after deleting, the board has {sorted(p.all_titles())}")
    return "the deleted card is gone, the other stays"


def check_columns(p: Page) -> str:
    n = len(p.columns())
    expect(n >= 1 and p.board()[0]["title"] == "To do",
           f"a fresh board should start with 'To do', 'In progress', 'Done'; got {[c['title'] for c in p.board()]}")
    p.type_into(p.one("#new-column-name", "new column name input"), "Review")
    p.one("#add-column", "add column button").click()
    expect_soon(p, lambda: len(p.columns()) == n + 1 and p.board()[-1]["title"] == "Review",
                lambda: f"adding column 'Review' gave columns {[c['title'] for c in p.board()]}")
    p.one("[data-testid=rename-column]", "rename button", root=p.columns()[0]).click()
    field = p.until(lambda: p.d.find_elements("css selector", "[data-testid=column-title-input]"))
    expect(field, "rename-column did not show a [data-testid=column-title-input]")
    from selenium.webdriver.common.keys import Keys

    p.type_into(field[0], "Backlog")
    field[0].send_keys(Keys.ENTER)
    expect_soon(p, lambda: p.board()[0]["title"] == "Backlog",
                lambda: f"renaming the first column to 'Backlog' gave {[c['title'] for c in p.board()]}")
    return "column 'Review' added at the end, first column renamed to 'Backlog'"


def _lists(p: Page):
    return [p.one("[data-testid=card-list]", "card list", root=col) for col in p.columns()]


def check_drag_between_columns(p: Page) -> str:
    p.add_card("Alpha")
    p.add_card("Beta")
    expect(len(p.columns()) >= 2, "need at least two columns")
    p.drag(p.card("Alpha"), _lists(p)[1], "end")
    expect_soon(p, lambda: p.column_cards(1) == ["Alpha"] and p.column_cards(0) == ["Beta"],
                lambda: f"dragging Alpha onto column 2: columns hold {p.column_cards(0)} / {p.column_cards(1)}")
    p.drag(p.card("Beta"), p.card("Alpha"), "before")
    expect_soon(p, lambda: p.column_cards(1) == ["Beta", "Alpha"] and p.column_cards(0) == [],
                lambda: f"dragging Beta onto Alpha in column 2: columns hold {p.column_cards(0)} / {p.column_cards(1)}")
    return "dropped on a column's list (appended) and on a card of another column (inserted before it)"


def check_reorder_within_column(p: Page) -> str:
    for t in ("One", "Two", "Three"):
        p.add_card(t)
    p.drag(p.card("Three"), p.card("One"), "before")
    expect_soon(p, lambda: p.column_cards(0) == ["Three", "One", "Two"],
                lambda: f"dragging Three onto One: first column is {p.column_cards(0)}")
    p.drag(p.card("One"), _lists(p)[0], "end")
    expect_soon(p, lambda: p.column_cards(0) == ["Three", "Two", "One"],
                lambda: f"dragging One to the end of its column: first column is {p.column_cards(0)}")
    return "cards reordered inside the first column by drag-and-drop"


def check_keyboard_move(p: Page) -> str:
    from selenium.webdriver.common.keys import Keys

    p.add_card("Left")
    p.add_card("Mover")
    p.focus_card("Mover")
    p.keys(Keys.ARROW_RIGHT, alt=True)
    expect_soon(p, lambda: "Mover" in p.column_cards(1), lambda: f"Alt+ArrowRight: column 2 holds {p.column_cards(1)}")
    expect_soon(p, lambda: p.focused_title() == "Mover", lambda: f"after Alt+ArrowRight focus is on {p.focused_title()!r}, not the moved card")
    p.keys(Keys.ARROW_LEFT, alt=True)
    expect_soon(p, lambda: "Mover" in p.column_cards(0), lambda: f"Alt+ArrowLeft: column 1 holds {p.column_cards(0)}")
    order = p.column_cards(0)
    p.focus_card(order[-1])
    p.keys(Keys.ARROW_UP, alt=True)
    want = order[:-2] + [order[-1], order[-2]]
    expect_soon(p, lambda: p.column_cards(0) == want, lambda: f"Alt+ArrowUp on {order[-1]}: column 1 is {p.column_cards(0)}, want {want}")
    expect_soon(p, lambda: p.focused_title() == order[-1], "focus left the card moved by Alt+ArrowUp")
    p.keys(Keys.ARROW_DOWN, alt=True)
    expect_soon(p, lambda: p.column_cards(0) == order, lambda: f"Alt+ArrowDown: column 1 is {p.column_cards(0)}, want {order}")
    return "Alt+arrows moved the focused card across and within columns; focus followed it"


def check_open_with_keyboard(p: Page) -> str:
    from selenium.webdriver.common.keys import Keys

    p.add_card("Open me")
    for key, name in ((Keys.ENTER, "Enter"), (Keys.SPACE, "Space")):
        p.focus_card("Open me")
        p.keys(key)
        expect_soon(p, p.dialog_open, f"{name} on a focused card did not show #card-dialog")
        value = p.one("#edit-title", "edit title input").get_attribute("value")
        expect(value == "Open me", f"the dialog opened by {name} shows {value!r}, not the focused card")
        p.keys(Keys.ESCAPE)
        if not p.until(lambda: not p.dialog_open(), 0.5):
            p.one("#close-dialog", "close button").click()
        expect_soon(p, lambda: not p.dialog_open(), "#card-dialog does not close (Escape or #close-dialog)")
    return "Enter and Space on a focused card open it"


def check_archive_restore(p: Page) -> str:
    p.add_card("Old")
    p.add_card("Current")
    p.one("[data-testid=archive-card]", "archive button", root=p.card("Old")).click()
    expect_soon(p, lambda: p.all_titles() == {"Current"}, lambda: f"after archiving Old the board has {sorted(p.all_titles())}")
    archive = p.one("#archive", "archive list")
    entries = archive.find_elements("css selector", "[data-testid=archived-card]")
    expect(any("Old" in e.get_attribute("textContent") for e in entries), "Old is not listed in #archive")
    entry = next(e for e in entries if "Old" in e.get_attribute("textContent"))
    p.one("[data-testid=restore-card]", "restore button", root=entry).click()
    expect_soon(p, lambda: "Old" in p.column_cards(0), lambda: f"after restoring, column 1 holds {p.column_cards(0)}")
    left = [e.get_attribute("textContent") for e in p.d.find_elements("css selector", "#archive [data-testid=archived-card]")]
    expect(not any("Old" in t for t in left), f"Old is still listed in #archive after restoring: {left}")
    return "archived card left the board and came back to its column"


FILTER_CARDS = (("Fix login", "users cannot sign in", "bug", "alice"),
                ("Add export", "CSV download", "feature", "bob"),
                ("Write guide", "Invoice how-to", "docs", "alice"),
                ("Crash on save", "stack trace", "bug", "bob"),
                ("Dark mode", "theme work", "feature", "carol"))


def _filter_board(p: Page) -> None:
    for card in FILTER_CARDS:
        p.add_card(*card)


def _visible(p: Page, want: set[str], what: str) -> None:
    expect_soon(p, lambda: p.visible_titles() == want,
                lambda: f"{what}: visible cards {sorted(p.visible_titles())}, want {sorted(want)}")


def check_search(p: Page) -> str:
    _filter_board(p)
    box = p.one("#search", "search input")
    p.type_into(box, "login")
    _visible(p, {"Fix login"}, "search 'login'")
    p.type_into(box, "INVOICE")
    _visible(p, {"Write guide"}, "search 'INVOICE' (in a description, other case)")
    box.clear()
    box.send_keys(" ")
    box.send_keys("\b")
    _visible(p, {c[0] for c in FILTER_CARDS}, "search cleared")
    return "search matches titles and descriptions in any case; clearing shows all"


def check_filter_label(p: Page) -> str:
    _filter_board(p)
    p.select("#filter-label", "feature", "label filter")
    _visible(p, {"Add export", "Dark mode"}, "label filter 'feature'")
    return "label filter shows only cards with that label"


def check_filter_assignee(p: Page) -> str:
    _filter_board(p)
    p.select("#filter-assignee", "carol", "assignee filter")
    _visible(p, {"Dark mode"}, "assignee filter 'carol'")
    return "assignee filter shows only that person's cards"


def check_filter_combined(p: Page) -> str:
    _filter_board(p)
    p.select("#filter-label", "bug", "label filter")
    p.select("#filter-assignee", "alice", "assignee filter")
    _visible(p, {"Fix login"}, "label 'bug' AND assignee 'alice'")
    return "label and assignee filters combine with AND"


def check_filter_reset(p: Page) -> str:
    _filter_board(p)
    everything = {c[0] for c in FILTER_CARDS}
    p.select("#filter-label", "bug", "label filter", blocked=True)
    if not p.until(lambda: p.visible_titles() == {"Fix login", "Crash on save"}):
        raise Blocked("the label filter 'bug' does not filter, so resetting it cannot be tested")
    p.select("#filter-label", "", "label filter ('All labels')")
    _visible(p, everything, "label filter back to 'All labels'")
    p.select("#filter-assignee", "bob", "assignee filter", blocked=True)
    if not p.until(lambda: p.visible_titles() == {"Add export", "Crash on save"}):
        raise Blocked("the assignee filter 'bob' does not filter, so resetting it cannot be tested")
    p.select("#filter-assignee", "", "assignee filter ('All assignees')")
    _visible(p, everything, "assignee filter back to 'All assignees'")
    return "'All labels' and 'All assignees' show every card again"


def check_persistence(p: Page) -> str:
    p.add_card("Saved one", "kept across reloads", "docs", "bob")
    p.add_card("Saved two")
    before = p.board()
    p.reload()
    after = p.until(lambda: p.column_cards(0) and p.board())
    strip = [[{k: v for k, v in c.items() if k != "visible"} for c in col["cards"]] for col in (before or [])]
    got = [[{k: v for k, v in c.items() if k != "visible"} for c in col["cards"]] for col in (after or [])]
    expect(got == strip, f"after reload the cards are {got}, before they were {strip}")
    return "cards (titles, descriptions, labels, assignees, order) survive a reload"


def _background(p: Page) -> tuple[float, float]:
    """(luminance of the page background, luminance of the body text colour)."""
    rgb = p.d.execute_script("""
      const parse = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
      let bg = null;
      for (const el of [document.body, document.documentElement]) {
        const c = parse(getComputedStyle(el).backgroundColor);
        if (c.length >= 3 && (c.length < 4 || c[3] > 0)) { bg = c; break; }
      }
      return [bg || [255, 255, 255], parse(getComputedStyle(document.body).color)];""")

    def lum(c):
        return (0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]) / 255

    return lum(rgb[0]), lum(rgb[1])


def check_themes(p: Page) -> str:
    theme = lambda: p.d.execute_script("return document.documentElement.getAttribute('data-theme')")  # noqa: E731
    first = theme()
    first_bg, first_fg = _background(p)
    p.one("#theme-toggle", "theme toggle").click()
    expect_soon(p, lambda: theme() in ("light", "dark") and theme() != first,
                lambda: f"#theme-toggle: <html data-theme> went from {first!r} to {theme()!r}")
    second_bg, second_fg = _background(p)
    looks = {first: (first_bg, first_fg), theme(): (second_bg, second_fg)}
    if "light" in looks and "dark" in looks:
        (lbg, lfg), (dbg, dfg) = looks["light"], looks["dark"]
        expect(dbg < lbg - 0.2, f"dark background (luminance {dbg:.2f}) is not darker than light ({lbg:.2f})")
        expect(dfg > dbg and lfg < lbg, "text is not lighter than the background in dark theme and darker in light theme")
    else:
        raise Fail(f"data-theme values seen: {sorted(map(str, looks))}; want 'light' and 'dark'")
    p.one("#theme-toggle", "theme toggle").click()
    expect_soon(p, lambda: theme() == first, "a second #theme-toggle did not switch back")
    return f"light background luminance {lbg:.2f}, dark {dbg:.2f}; the toggle switches both ways"


def check_accessible_names(p: Page) -> str:
    p.add_card("Named", "", "bug", "alice")
    missing = p.unnamed_controls()
    _open_editor(p, "Named")
    missing += p.unnamed_controls(p.one("#card-dialog", "card dialog"))  # a modal dialog makes the rest of the page inert
    expect(not missing, "controls without an accessible name: " + ", ".join(sorted(set(missing))))
    return "every visible button, input, select and textarea has an accessible name"


CHECKS = {name: globals()[f"check_{name}"] for name, _ in CATEGORIES if name != webcheck.CONSOLE}
SUITE = webcheck.Suite(
    kind="kanban_quality", label="kanban quality", description="Kanban-app browser acceptance checks",
    categories=CATEGORIES, checks=CHECKS, page=Page, profile_prefix="kanban-chrome-",
    never_loaded="the board never rendered, so there was no session to watch")


def score(workspace: str | Path, out: str | Path, *, driver=None) -> dict[str, Any]:
    """Score the app in ``workspace`` on every category; write and return quality.json
    (screenshots in ``screenshots/`` beside it). Pass a running ``driver`` to reuse one browser
    for several workspaces (tests do)."""
    return webcheck.score(SUITE, workspace, out, driver=driver)


def main(argv: list[str] | None = None) -> int:
    return webcheck.main(SUITE, argv)


if __name__ == "__main__":
    sys.exit(main())
