"""Browser acceptance checks for the Kanban-app task: 18 categories -> ``quality.json``.

Serves the workspace on a loopback port (inside this process) and drives Debian's headless
``chromium`` through ``chromedriver`` with Selenium. Every category starts from a fresh board
(localStorage cleared, page reloaded), builds what it needs through the UI and reports
``pass``, ``fail`` (the failing assertion) or ``blocked`` (a prerequisite is missing: no
``index.html``, no browser, the new-card form does not work...), with a screenshot path.

Made to run inside the checks sandbox: it writes only to ``--out`` (quality.json and
``screenshots/`` beside it) and to a private temporary browser profile, and talks only to
127.0.0.1. Drag and drop is driven with synthetic HTML5 drag events (``DragEvent`` carrying one
shared ``DataTransfer``): chromedriver's pointer actions do not start native HTML5 drags.

Usage (the task's checks)::

    check.py --score [--workspace DIR] [--out FILE]   # run the browser once, write quality.json
    check.py CATEGORY [--out FILE]                    # exit 0 iff CATEGORY passed in quality.json

``--out`` defaults to ``$MLXTERM_RUN_DIR/quality.json`` (set by ``mlxterm run``), else
``./quality.json``. Needs ``selenium`` (``pip install 'mlxterm[browser]'``) and
``apt-get install chromium chromium-driver``; without them every category is blocked.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,900")
WAIT_S = 2.0  # how long an expected change may take to show (renders are usually immediate)


class Blocked(Exception):
    """A prerequisite for the category is missing; the category itself was not tested."""


class NoBoard(Blocked):
    """A freshly loaded page shows no board: every later category would be blocked the same way."""


class Fail(AssertionError):
    """The category's behaviour is wrong; the message is the failing assertion."""


# -- the browser and the server --------------------------------------------------------------
def browser_missing() -> str | None:
    """Why no browser session can start (None: selenium, chromium and chromedriver are here)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'mlxterm[browser]')"
    if not _chromium() or not _chromedriver():
        return "chromium / chromedriver not found (apt-get install chromium chromium-driver)"
    return None


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _chromedriver() -> str | None:
    return shutil.which("chromedriver")


def launch_browser(profile_dir: str | Path):
    """A headless Chromium on a fresh profile, console messages logged, nothing fetched."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _chromium()
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Chromium also writes under $HOME (~/.pki, ~/.cache): point that at the private profile dir
    # so a sandbox with a read-only home works. An explicit driver path keeps Selenium Manager
    # (which would try to download drivers) out of it.
    home = Path(profile_dir)
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_CACHE_HOME": str(home / ".cache")}
    driver = webdriver.Chrome(service=Service(executable_path=_chromedriver(), env=env), options=options)
    # A hung app (an endless loop on load) costs its categories, not the whole check's timeout.
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(10)
    return driver


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # quiet: the checks' output is the evidence
        pass

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def do_GET(self) -> None:
        # Browsers ask for /favicon.ico on their own; a 404 would be a console error the app
        # did not cause.
        if self.path.split("?")[0] == "/favicon.ico" and not Path(self.directory, "favicon.ico").exists():
            self.send_response(204)
            self.end_headers()
            return
        super().do_GET()


class LoopbackServer:
    """Static files of a directory on 127.0.0.1:<free port>, served from a thread."""

    def __init__(self, directory: str | Path):
        handler = functools.partial(_Handler, directory=str(directory))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


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


class Page:
    """One browser tab on the served app, with the few moves the categories are made of."""

    def __init__(self, driver, url: str):
        self.d = driver
        self.url = url
        self.console: list[dict[str, Any]] = []

    # navigation and state
    def fresh(self) -> None:
        """The app with empty localStorage, freshly loaded (one navigation once on the origin)."""
        if not (self.d.current_url or "").startswith(self.url):
            self.d.get(self.url)
        self.d.execute_script("try { localStorage.clear(); sessionStorage.clear(); } catch (e) {}")
        try:
            self.reload()
        except Blocked as e:
            raise NoBoard(str(e)) from None

    def reload(self) -> None:
        self.collect_console()
        self.d.get(self.url)
        if not self.until(lambda: self.d.find_elements("css selector", "[data-testid=column]")):
            raise Blocked("the board did not render: no [data-testid=column] element after loading index.html")

    def collect_console(self) -> None:
        try:
            self.console += [e for e in self.d.get_log("browser") if e.get("level") == "SEVERE"]
        except Exception:  # noqa: BLE001 - a driver without the log endpoint: nothing to add
            pass

    def until(self, fn: Callable[[], Any], timeout: float = WAIT_S) -> Any:
        """Poll ``fn`` until it returns something truthy (or the time is up); its last value."""
        end = time.monotonic() + timeout
        while True:
            try:
                value = fn()
            except Exception:  # noqa: BLE001 - stale elements mid-render: try again
                value = None
            if value or time.monotonic() >= end:
                return value
            time.sleep(0.05)

    # finding things
    def one(self, css: str, what: str, root=None, blocked: bool = False):
        found = (root or self.d).find_elements("css selector", css)
        if not found:
            msg = f"no element matching {css!r} ({what})"
            raise Blocked(msg) if blocked else Fail(msg)
        return found[0]

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

    # acting
    def type_into(self, el, text: str) -> None:
        el.clear()
        el.send_keys(text)

    def select(self, css: str, value: str, what: str, blocked: bool = False) -> None:
        """Choose the option with ``value`` by clicking it, as a user does (fires ``change``)."""
        el = self.one(css, what, blocked=blocked)
        options = el.find_elements("css selector", f'option[value="{value}"]')
        if el.tag_name.lower() != "select" or not options:
            msg = f"{css} ({what}) has no option with value {value!r}"
            raise Blocked(msg) if blocked else Fail(msg)
        options[0].click()

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

    def keys(self, *keys: str, alt: bool = False) -> None:
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        chain = ActionChains(self.d)
        if alt:
            chain.key_down(Keys.ALT)
        for k in keys:
            chain.send_keys(k)
        if alt:
            chain.key_up(Keys.ALT)
        chain.perform()

    def drag(self, src, dst, where: str) -> None:
        self.d.execute_script(_DRAG_JS, src, dst, where)

    def focused_title(self) -> str | None:
        return self.d.execute_script(
            "const c = document.activeElement && document.activeElement.closest('[data-testid=card]');"
            "const t = c && c.querySelector('[data-testid=card-title]'); return t ? t.textContent.trim() : null;")

    def dialog_open(self) -> bool:
        found = self.d.find_elements("css selector", "#card-dialog")
        return bool(found) and found[0].is_displayed()


def expect(cond: Any, message: str) -> None:
    if not cond:
        raise Fail(message)


def expect_soon(page: Page, fn: Callable[[], Any], message: Callable[[], str] | str) -> None:
    if not page.until(fn):
        raise Fail(message() if callable(message) else message)


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
    missing = []
    sel = "button, input, select, textarea, [role=button], a[href]"

    def scan(root=None) -> None:
        for el in (root or p.d).find_elements("css selector", sel):
            if not el.is_displayed():
                continue
            name = (el.accessible_name or "").strip()
            if not name:
                ident = el.get_attribute("id") or el.get_attribute("data-testid") or el.get_attribute("outerHTML")[:80]
                missing.append(f"<{el.tag_name}> {ident}")

    scan()
    _open_editor(p, "Named")
    scan(p.one("#card-dialog", "card dialog"))  # a modal dialog makes the rest of the page inert
    expect(not missing, "controls without an accessible name: " + ", ".join(sorted(set(missing))))
    return "every visible button, input, select and textarea has an accessible name"


CHECKS: dict[str, Callable[[Page], str]] = {name: globals()[f"check_{name}"] for name, _ in CATEGORIES
                                           if name != "console_errors"}


# -- scoring -------------------------------------------------------------------------------------
def _entry(name: str, status: str, evidence: str, screenshot: str | None = None, duration_ms: int = 0) -> dict:
    return {"name": name, "title": dict(CATEGORIES)[name], "status": status, "evidence": evidence,
            "screenshot": screenshot, "duration_ms": duration_ms}


def score(workspace: str | Path, out: str | Path, *, driver=None) -> dict[str, Any]:
    """Score the app in ``workspace`` on every category; write and return quality.json.

    ``out`` is the quality.json path; screenshots go to ``screenshots/`` beside it. Pass a
    running ``driver`` to reuse one browser for several workspaces (tests do).
    """
    workspace, out = Path(workspace).resolve(), Path(out).resolve()
    shots = out.parent / "screenshots"
    t0 = time.monotonic()
    reason = None
    if not (workspace / "index.html").is_file():
        reason = f"no index.html in the workspace {workspace}"
    elif driver is None:
        reason = browser_missing()
    if reason:
        results = [_entry(n, "blocked", reason) for n, _ in CATEGORIES]
    else:
        results = _score_in_browser(workspace, shots, driver)
    report = {
        "kind": "kanban_quality", "version": 1, "workspace": str(workspace),
        "passed": sum(r["status"] == "pass" for r in results),
        "failed": sum(r["status"] == "fail" for r in results),
        "blocked": sum(r["status"] == "blocked" for r in results),
        "total": len(CATEGORIES), "wall_s": round(time.monotonic() - t0, 2),
        "categories": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    # Atomic by hand (not engine.atomic): this script must run on a bare python3 with selenium.
    os.replace(tmp, out)
    return report


def _score_in_browser(workspace: Path, shots: Path, driver) -> list[dict]:
    shots.mkdir(parents=True, exist_ok=True)
    own = driver is None
    profile = tempfile.mkdtemp(prefix="kanban-chrome-") if own else None
    results: list[dict] = []
    try:
        if own:
            driver = launch_browser(profile)
        with LoopbackServer(workspace) as server:
            page = Page(driver, server.url + "index.html")
            page.collect_console()  # drop what an earlier workspace left in a shared driver
            page.console.clear()
            no_board = None
            for name, _ in CATEGORIES:
                if name == "console_errors":
                    continue
                if no_board:  # the page never shows a board: no point loading it 16 more times
                    results.append(_entry(name, "blocked", no_board))
                    continue
                results.append(_run_one(page, name, shots))
                no_board = results[-1].pop("no_board", None)
            loaded = no_board is None
            page.collect_console()
            results.insert([n for n, _ in CATEGORIES].index("console_errors"), _console_entry(page, loaded))
    except Exception as e:  # noqa: BLE001 - the browser itself broke: what is left is blocked
        done = {r["name"] for r in results}
        results += [_entry(n, "blocked", f"browser session failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    for n, _ in CATEGORIES if n not in done]
        order = [n for n, _ in CATEGORIES]
        results.sort(key=lambda r: order.index(r["name"]))
    finally:
        if own and driver is not None:
            driver.quit()
        if profile:
            shutil.rmtree(profile, ignore_errors=True)
    return results


def _run_one(page: Page, name: str, shots: Path) -> dict:
    t0 = time.monotonic()
    from selenium.common.exceptions import WebDriverException

    no_board = None
    try:
        page.fresh()
        status, evidence = "pass", CHECKS[name](page)
    except NoBoard as e:
        status, evidence = "blocked", str(e)
        no_board = str(e)
    except Blocked as e:
        status, evidence = "blocked", str(e)
    except Fail as e:
        status, evidence = "fail", str(e)
    except WebDriverException as e:
        first = (e.msg or type(e).__name__).splitlines()[0]
        status, evidence = "fail", f"browser error while checking: {type(e).__name__}: {first}"
    except (StopIteration, IndexError, KeyError, TypeError) as e:
        status, evidence = "fail", f"unexpected page structure: {type(e).__name__}: {e}"
    shot = shots / f"{name}.png"
    try:
        page.d.save_screenshot(str(shot))
    except WebDriverException:
        shot = None
    entry = _entry(name, status, evidence, str(shot) if shot else None, round((time.monotonic() - t0) * 1000))
    if no_board:
        entry["no_board"] = no_board
    return entry


def _console_entry(page: Page, loaded: bool) -> dict:
    if page.console:
        msgs = "; ".join(e.get("message", "")[:200] for e in page.console[:5])
        return _entry("console_errors", "fail", f"{len(page.console)} console error(s): {msgs}")
    if not loaded:
        return _entry("console_errors", "blocked", "the board never rendered, so there was no session to watch")
    return _entry("console_errors", "pass", "no console errors during the whole session (every category's interactions)")


# -- command line --------------------------------------------------------------------------------
def _default_out() -> Path:
    run_dir = os.environ.get("MLXTERM_RUN_DIR")
    return Path(run_dir) / "quality.json" if run_dir else Path("quality.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Kanban-app browser acceptance checks")
    ap.add_argument("category", nargs="?", help="report this category from quality.json (exit 0 iff it passed)")
    ap.add_argument("--score", action="store_true", help="run the browser on the workspace and write quality.json first")
    ap.add_argument("--workspace", type=Path, default=Path.cwd(), help="the app's directory (default: the current one)")
    ap.add_argument("--out", type=Path, default=None, help="quality.json path (default: $MLXTERM_RUN_DIR/quality.json)")
    args = ap.parse_args(argv)
    out = args.out or _default_out()
    if args.category and args.category not in dict(CATEGORIES):
        print(f"unknown category {args.category!r} (categories: {', '.join(dict(CATEGORIES))})", file=sys.stderr)
        return 2
    if args.score:
        out.unlink(missing_ok=True)  # never let a category read an earlier run's verdict
        report = score(args.workspace, out)
        print(f"kanban quality: {report['passed']}/{report['total']} passed, {report['failed']} failed, "
              f"{report['blocked']} blocked ({report['wall_s']} s) -> {out}")
    if not args.category:
        return 0
    try:
        report = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        print(f"blocked: no readable {out} (the scoring check did not run or broke)")
        return 1
    entry = next(c for c in report["categories"] if c["name"] == args.category)
    print(f"{entry['status']}: {entry['title']}: {entry['evidence']}")
    if entry.get("screenshot"):
        print(f"screenshot: {entry['screenshot']}")
    return 0 if entry["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
