"""The generic half of the web-app tasks' browser checks (kanban-app/check.py, expense-app/check.py).

A task's ``check.py`` describes its categories as a ``Suite`` (quality.json ``kind``, names and
titles, one function per category, the ``Page`` subclass with the app's moves); this module
serves the workspace on a loopback port, drives Debian's headless ``chromium`` through
``chromedriver`` with Selenium, starts every category from a fresh app (localStorage cleared,
page reloaded), records ``pass``, ``fail`` or ``blocked`` with a screenshot, watches the console
for ``console_errors``, writes ``quality.json`` atomically and serves the command line
(``check.py --score [--workspace DIR] [--out FILE]``; ``check.py CATEGORY [--out FILE]``).

Runs inside the checks sandbox on a bare python3 with selenium (``apt-get install chromium
chromium-driver``; without them every category is blocked): no mlxterm imports, writes only to
``--out``'s folder and a private temporary browser profile, talks only to 127.0.0.1. A check
script imports it by putting its parent folder (``$MLXTERM_TASK_DIR``) on ``sys.path``.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,900")
WAIT_S = 2.0  # how long an expected change may take to show (renders are usually immediate)
CONSOLE = "console_errors"  # the category watched over the whole session, not run on its own page


class Blocked(Exception):
    """A prerequisite for the category is missing; the category itself was not tested."""


class NoApp(Blocked):
    """A freshly loaded page does not show the app: every later category would be blocked the same way."""


_NOT_TYPED = {"button", "checkbox", "color", "file", "hidden", "image", "radio", "range", "reset", "submit"}


def _named(el) -> str:
    """How evidence names an element: ``#id``, else its data-testid, else its markup's start."""
    if el.get_attribute("id"):
        return f"#{el.get_attribute('id')}"
    if el.get_attribute("data-testid"):
        return f'[data-testid="{el.get_attribute("data-testid")}"]'
    return (el.get_attribute("outerHTML") or "")[:80]


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
class Page:
    """One browser tab on the served app, with the moves every web-app task needs. A task
    subclasses it: ``ready_css`` is what a rendered app shows, ``not_ready`` the reason given
    when it does not, and the subclass adds the app's own moves."""

    ready_css = "body"
    not_ready = "the app did not render after loading index.html"

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
            raise NoApp(str(e)) from None

    def reload(self) -> None:
        self.collect_console()
        self.d.get(self.url)
        if not self.until(lambda: self.d.find_elements("css selector", self.ready_css)):
            raise Blocked(self.not_ready)

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

    def shown(self, css: str) -> bool:
        """Whether an element matching ``css`` is displayed (an open dialog, an error message)."""
        found = self.d.find_elements("css selector", css)
        return bool(found) and found[0].is_displayed()

    def unnamed_controls(self, root=None) -> list[str]:
        """The visible buttons, inputs, selects, textareas and links under ``root`` that have no
        accessible name, as ``<tag> id-or-testid-or-markup``."""
        missing = []
        sel = "button, input, select, textarea, [role=button], a[href]"
        for el in (root or self.d).find_elements("css selector", sel):
            if not el.is_displayed():
                continue
            name = (el.accessible_name or "").strip()
            if not name:
                ident = el.get_attribute("id") or el.get_attribute("data-testid") or el.get_attribute("outerHTML")[:80]
                missing.append(f"<{el.tag_name}> {ident}")
        return missing

    # acting
    def type_into(self, el, text: str) -> None:
        """Type ``text`` into a text field, replacing its value; an element that is no text
        field fails the check naming it (the browser only says "invalid element state")."""
        tag = el.tag_name.lower()
        kind = (el.get_attribute("type") or "text").lower() if tag == "input" else ""
        editable = el.get_attribute("contenteditable") in ("", "true", "plaintext-only")
        if not (tag == "textarea" or (tag == "input" and kind not in _NOT_TYPED) or editable):
            raise Fail(f"{_named(el)} is a <{tag}{f' type={kind}' if kind else ''}>, not a text field "
                       "(an <input> or <textarea>): it cannot be typed into")
        if not el.is_enabled() or el.get_attribute("readonly") is not None:
            raise Fail(f"{_named(el)} is disabled or read-only: it cannot be typed into")
        el.clear()
        el.send_keys(text)

    def set_value(self, el, value: str) -> None:
        """Set an input's value as a script would and fire ``input`` and ``change`` (for date
        inputs, whose typed form depends on the browser's locale)."""
        self.d.execute_script(
            "const [el, v] = arguments; el.value = v;"
            "el.dispatchEvent(new Event('input', {bubbles: true}));"
            "el.dispatchEvent(new Event('change', {bubbles: true}));", el, value)

    def select(self, css: str, value: str, what: str, blocked: bool = False) -> None:
        """Choose the option with ``value`` by clicking it, as a user does (fires ``change``)."""
        el = self.one(css, what, blocked=blocked)
        options = el.find_elements("css selector", f'option[value="{value}"]')
        if el.tag_name.lower() != "select" or not options:
            msg = f"{css} ({what}) has no option with value {value!r}"
            raise Blocked(msg) if blocked else Fail(msg)
        options[0].click()

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


def expect(cond: Any, message: str) -> None:
    if not cond:
        raise Fail(message)


def expect_soon(page: Page, fn: Callable[[], Any], message: Callable[[], str] | str) -> None:
    if not page.until(fn):
        raise Fail(message() if callable(message) else message)


# -- scoring -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Suite:
    """One task's categories. ``categories``: (name, title) in report order, ``console_errors``
    among them; ``checks``: name -> function of a fresh ``Page`` returning the pass evidence (every
    category but ``console_errors``); ``page``: the Page class; ``kind``: quality.json's kind;
    ``label``: the summary line's ("kanban quality"); ``never_loaded``: the console category's
    evidence when the app never rendered; ``profile_prefix``: the temporary browser profile's."""

    kind: str
    label: str
    description: str
    categories: tuple[tuple[str, str], ...]
    checks: dict[str, Callable[[Page], str]]
    page: type[Page]
    never_loaded: str
    profile_prefix: str = "webcheck-chrome-"

    def __post_init__(self) -> None:
        names = [n for n, _ in self.categories]
        if CONSOLE not in names or set(self.checks) != set(names) - {CONSOLE}:
            raise ValueError(f"{self.kind}: checks {sorted(self.checks)} do not match categories {names}")

    def entry(self, name: str, status: str, evidence: str, screenshot: str | None = None,
              duration_ms: int = 0) -> dict:
        return {"name": name, "title": dict(self.categories)[name], "status": status, "evidence": evidence,
                "screenshot": screenshot, "duration_ms": duration_ms}


def score(suite: Suite, workspace: str | Path, out: str | Path, *, driver=None) -> dict[str, Any]:
    """Score the app in ``workspace`` on every category of ``suite``; write and return quality.json.

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
        results = [suite.entry(n, "blocked", reason) for n, _ in suite.categories]
    else:
        results = _score_in_browser(suite, workspace, shots, driver)
    report = {
        "kind": suite.kind, "version": 1, "workspace": str(workspace),
        "passed": sum(r["status"] == "pass" for r in results),
        "failed": sum(r["status"] == "fail" for r in results),
        "blocked": sum(r["status"] == "blocked" for r in results),
        "total": len(suite.categories), "wall_s": round(time.monotonic() - t0, 2),
        "categories": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    # Atomic by hand (not engine.atomic): this script must run on a bare python3 with selenium.
    os.replace(tmp, out)
    return report


def _score_in_browser(suite: Suite, workspace: Path, shots: Path, driver) -> list[dict]:
    shots.mkdir(parents=True, exist_ok=True)
    own = driver is None
    profile = tempfile.mkdtemp(prefix=suite.profile_prefix) if own else None
    order = [n for n, _ in suite.categories]
    results: list[dict] = []
    try:
        if own:
            driver = launch_browser(profile)
        with LoopbackServer(workspace) as server:
            page = suite.page(driver, server.url + "index.html")
            page.collect_console()  # drop what an earlier workspace left in a shared driver
            page.console.clear()
            no_app = None
            for name in order:
                if name == CONSOLE:
                    continue
                if no_app:  # the page never shows the app: no point loading it again per category
                    results.append(suite.entry(name, "blocked", no_app))
                    continue
                results.append(_run_one(suite, page, name, shots))
                no_app = results[-1].pop("no_app", None)
            page.collect_console()
            results.insert(order.index(CONSOLE), _console_entry(suite, page, no_app is None, workspace))
    except Exception as e:  # noqa: BLE001 - the browser itself broke: what is left is blocked
        done = {r["name"] for r in results}
        first = str(e).splitlines()[0] if str(e) else ""
        results += [suite.entry(n, "blocked", f"browser session failed: {type(e).__name__}: {first}")
                    for n in order if n not in done]
        results.sort(key=lambda r: order.index(r["name"]))
    finally:
        if own and driver is not None:
            driver.quit()
        if profile:
            shutil.rmtree(profile, ignore_errors=True)
    return results


def _run_one(suite: Suite, page: Page, name: str, shots: Path) -> dict:
    t0 = time.monotonic()
    from selenium.common.exceptions import WebDriverException

    no_app = None
    try:
        page.fresh()
        status, evidence = "pass", suite.checks[name](page)
    except NoApp as e:
        status, evidence = "blocked", str(e)
        no_app = str(e)
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
    entry = suite.entry(name, status, evidence, str(shot) if shot else None, round((time.monotonic() - t0) * 1000))
    if no_app:
        entry["no_app"] = no_app
    return entry


_SCRIPT_AT = re.compile(r"https?://127\.0\.0\.1:\d+/(\S*) (\d+):\d+")


def source_line(message: str, workspace: Path) -> str:
    """The workspace's source line a console message points at, as `` [app.js:28: the line]``;
    empty when there is none to quote. ChromeDriver's log writes ``URL LINE:COL`` with a 0-based
    line (DevTools' own numbers), the page itself as ``/``. Why: a small model told only
    "TypeError at app.js:28" rewrote another part of the file."""
    m = _SCRIPT_AT.search(message)
    if not m:
        return ""
    name = m.group(1).split("?")[0].split("#")[0]
    if name == "" or name.endswith("/"):
        name += "index.html"
    if not name.endswith((".js", ".mjs", ".html", ".htm")):
        return ""
    workspace = workspace.resolve()
    path, line = (workspace / name).resolve(), int(m.group(2)) + 1
    if not path.is_relative_to(workspace) or not path.is_file():
        return ""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    if line > len(lines):
        return ""
    return f" [{name}:{line}: {lines[line - 1].strip()[:160]}]"


def _console_entry(suite: Suite, page: Page, loaded: bool, workspace: Path) -> dict:
    if page.console:
        # each page load repeats a script's error: count every one, quote each message once,
        # with the line of the workspace's file it points at
        distinct = list(dict.fromkeys(e.get("message", "")[:200] for e in page.console))
        msgs = "; ".join(m + source_line(m, workspace) for m in distinct[:5])
        return suite.entry(CONSOLE, "fail", f"{len(page.console)} console error(s), {len(distinct)} distinct: {msgs}")
    if not loaded:
        return suite.entry(CONSOLE, "blocked", suite.never_loaded)
    return suite.entry(CONSOLE, "pass", "no console errors during the whole session (every category's interactions)")


# -- command line --------------------------------------------------------------------------------
def default_out() -> Path:
    run_dir = os.environ.get("MLXTERM_RUN_DIR")
    return Path(run_dir) / "quality.json" if run_dir else Path("quality.json")


def main(suite: Suite, argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=suite.description)
    ap.add_argument("category", nargs="?", help="report this category from quality.json (exit 0 iff it passed)")
    ap.add_argument("--score", action="store_true", help="run the browser on the workspace and write quality.json first")
    ap.add_argument("--workspace", type=Path, default=Path.cwd(), help="the app's directory (default: the current one)")
    ap.add_argument("--out", type=Path, default=None, help="quality.json path (default: $MLXTERM_RUN_DIR/quality.json)")
    args = ap.parse_args(argv)
    out = args.out or default_out()
    names = dict(suite.categories)
    if args.category and args.category not in names:
        print(f"unknown category {args.category!r} (categories: {', '.join(names)})", file=sys.stderr)
        return 2
    if args.score:
        out.unlink(missing_ok=True)  # never let a category read an earlier run's verdict
        report = score(suite, args.workspace, out)
        print(f"{suite.label}: {report['passed']}/{report['total']} passed, {report['failed']} failed, "
              f"{report['blocked']} blocked ({report['wall_s']} s) -> {out}")
    if not args.category:
        return 0
    try:
        report = json.loads(out.read_text(encoding="utf-8"))
        entry = next(c for c in report["categories"] if c["name"] == args.category)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        print(f"blocked: no readable {out} (the scoring check did not run or broke)")
        return 1
    print(f"{entry['status']}: {entry['title']}: {entry['evidence']}")
    if entry.get("screenshot"):
        print(f"screenshot: {entry['screenshot']}")
    return 0 if entry["status"] == "pass" else 1
