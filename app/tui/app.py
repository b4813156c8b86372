"""``MlxtermApp``: the chat TUI. ``mlxterm`` (or ``mlxterm chat``) runs it.

Everything the tests need to pin down is injectable: the profile, the session store file,
the prompt history and settings files, the clock used for "3h ago", the memory probe and
the engine factory (tests run agent mode on ``agents.scripted.ScriptedEngine``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.errors import MlxtermError

from textual.app import App
from textual.binding import Binding
from textual.worker import WorkerFailed

from app.threads import wait_for_os_exit
from app.tui import logs, settings
from app.tui.board import BoardService
from app.tui.controller import ChatController
from app.tui.format import process_rss
from app.tui.history import PromptHistory
from app.tui.screens.help import HelpScreen
from app.tui.screens.main import MainScreen
from app.tui.widgets.message import MessageView
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.tool_card import ToolCard

log = logging.getLogger(__name__)
STYLES = Path(__file__).parent / "styles"


class MlxtermApp(App[int]):
    TITLE = "mlxterm"
    CSS_PATH = [STYLES / "app.tcss", STYLES / "agent.tcss", STYLES / "dialogs.tcss", STYLES / "board.tcss"]
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("ctrl+t", "toggle_theme", "Light/dark theme", show=False),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, profile: str | None = None, session_id: str | None = None, *,
                 store=None, store_path: Path | None = None, history_path: Path | None = None,
                 settings_path: Path | None = None, log_path: Path | None = None,
                 clock: Callable[[], float] = time.time,
                 memory_probe: Callable[[], int] = process_rss, autoload: bool = True,
                 engine_factory: Callable[[str], object] | None = None, board=None) -> None:
        super().__init__()
        from engine.sessions import SessionStore

        store = store if store is not None else SessionStore(store_path)
        if profile is None and session_id is not None:
            profile = _profile_of(store, session_id)
        self.controller = ChatController(store, profile, engine_factory=engine_factory)
        self.board = BoardService(self.controller, board)  # the task board; runs while you chat
        self.initial_session = session_id
        self.history = PromptHistory(history_path)
        self.settings_path = settings_path or settings.default_path()
        self.settings = settings.load(self.settings_path)
        self.log_path = log_path or logs.default_path()
        self.clock = clock
        self.memory_probe = memory_probe
        self.autoload = autoload
        self.crash_message: str | None = None
        self.threads_at_exit: list[threading.Thread] = []  # see on_unmount

    def on_mount(self) -> None:
        theme = self.settings.get("theme", settings.DARK)
        self.theme = theme if theme in self.available_themes else settings.DARK

    def get_default_screen(self) -> MainScreen:
        return MainScreen()

    # -- actions ---------------------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(help_sections()))

    def action_toggle_theme(self) -> None:
        self.theme = settings.LIGHT if self.theme == settings.DARK else settings.DARK
        self.settings["theme"] = self.theme
        settings.save(self.settings_path, self.settings)

    async def action_quit(self) -> None:
        main = self._main_screen()
        if main is not None and main.generating:
            await main.stop_and_wait(everything=True)
        self.exit()

    def _main_screen(self) -> MainScreen | None:
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen):
                return screen
        return None

    async def on_unmount(self) -> None:
        # The threads to see out of the OS before the interpreter finalizes (run_tui,
        # app.threads): the engines' closed here, asyncio's executor workers joined after.
        self.threads_at_exit = threading.enumerate()
        self.board.close()  # cancels running cards (they are requeued as resumable)
        self.controller.close()  # stops the engine thread (cancels nothing: replies are done)

    # -- errors ----------------------------------------------------------------------------------
    def _handle_exception(self, error: Exception) -> None:
        # Textual's hook for exceptions escaping handlers and workers (it would print a
        # traceback and exit). A readable MlxtermError becomes a notification; anything else
        # is logged in full and the app exits with one line (tests keep the traceback).
        cause = error.error if isinstance(error, WorkerFailed) else error
        if isinstance(cause, MlxtermError):
            log.warning("%s", cause)
            self.notify(str(cause), severity="error", timeout=8)
            return
        log.error("unexpected error", exc_info=(type(cause), cause, cause.__traceback__))
        if self.is_headless:
            super()._handle_exception(error)
            return
        self.crash_message = f"unexpected error: {cause} (details in {self.log_path})"
        self.exit(return_code=1)


def help_sections() -> list[tuple[str, type]]:
    return [("Chat", MainScreen), ("Message box", PromptInput),
            ("A focused message (Tab or click)", MessageView),
            ("A focused tool card (agent mode)", ToolCard), ("App", MlxtermApp)]


def _profile_of(store, session_id: str) -> str | None:
    """The profile a session was made with, when it can still be found."""
    from engine.profiles import find_profile

    try:
        profile = store.get(session_id).profile
        find_profile(profile)
    except MlxtermError:
        return None
    return profile or None


def run_tui(profile: str | None = None, session_id: str | None = None) -> int:
    """Run the TUI in this terminal; returns the exit code. Logs go to ``log_dir()/tui.log``."""
    import sys

    log_path = logs.default_path()
    app = MlxtermApp(profile, session_id, log_path=log_path)  # bad store/session: raises here
    if session_id is not None:
        app.controller.session(session_id)
    restore = logs.log_to_file(log_path)
    try:
        code = app.run()
    finally:
        restore()
    wait_for_os_exit(app.threads_at_exit)
    if app.crash_message:
        print(f"mlxterm: {app.crash_message}", file=sys.stderr)
        return 1
    return int(code or 0)
