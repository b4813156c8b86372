"""``mlxterm chat --plain``: a line REPL on the same sessions as the TUI.

In a terminal it uses prompt-toolkit (history shared with the TUI, Meta+Enter or Esc Enter
for a new line, Ctrl+C stops a reply, Ctrl+D quits). When stdin is not a terminal it reads
one prompt per line and prints each reply followed by a newline, for pipes and scripts.
The session id goes to stderr so ``--session ID`` can continue the chat later.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from engine.errors import MlxtermError
from engine.serving.events import ReasoningDelta, TextDelta

from app.threads import wait_for_os_exit
from app.tui.controller import ChatController
from app.tui.format import clean, done_meta, turn_summary
from app.tui.slash import SLASH_COMMANDS, literal, parse_slash

PLAIN_COMMANDS = ("new", "retry", "help", "quit")
DIM, RESET = "\x1b[2m", "\x1b[0m"


class PlainChat:
    """The REPL's state: the controller, the open session and where output goes."""

    def __init__(self, controller: ChatController, session_id: str | None, out: TextIO,
                 err: TextIO, interactive: bool) -> None:
        self.controller = controller
        self.session_id = session_id
        self.out = out
        self.err = err
        self.interactive = interactive

    def handle(self, text: str) -> bool:
        """Run one line (a prompt or a slash command); False means quit."""
        slash = parse_slash(text)
        if slash is None:
            self.reply(lambda sid: self.controller.send(sid, literal(text)))
            return True
        command, _ = slash
        if command.name == "quit":
            return False
        if command.name == "new":
            self.session_id = None
            self.note("new chat")
        elif command.name == "retry":
            if self.session_id is None:
                raise MlxtermError("there is no message to answer again yet")
            self.reply(lambda sid: self.controller.retry(sid))
        elif command.name == "help":
            for name in PLAIN_COMMANDS:
                c = SLASH_COMMANDS[name]
                self.note(f"{c.usage:<10} {c.help}")
            self.note("Meta+Enter (or Esc Enter) inserts a new line; Ctrl+C stops a reply.")
        else:
            raise MlxtermError(f"/{command.name} is only available in the full-screen TUI "
                               "(run mlxterm without --plain, or use mlxterm sessions)")
        return True

    def reply(self, start) -> None:
        if self.session_id is None:
            self.session_id = self.controller.new_session().id
            if self.interactive:
                self.note(f"session {self.session_id}")
        turn = start(self.session_id)
        try:
            for ev in turn:
                if isinstance(ev, TextDelta):
                    self.out.write(clean(ev.text))
                    self.out.flush()
                elif isinstance(ev, ReasoningDelta) and self.interactive:
                    self.out.write(DIM + clean(ev.text) + RESET)
                    self.out.flush()
        except KeyboardInterrupt:
            turn.cancel()  # keep the partial reply; it is saved as "stopped"
        done = turn.result()
        self.out.write("\n")
        self.out.flush()
        if done.finish_reason == "cancelled":
            self.note("[stopped]")
        if done.error:
            self.err.write(f"mlxterm: {done.error}\n")
        elif self.interactive:
            self.note(turn_summary(done_meta(done)))

    def note(self, text: str) -> None:
        if self.interactive:
            self.err.write(f"{DIM}{text}{RESET}\n")
        else:
            self.err.write(text + "\n")
        self.err.flush()


def run_plain(profile: str | None, session_id: str | None, stdin: TextIO | None = None,
              stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    from engine.sessions import SessionStore

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    store = SessionStore()
    if session_id is not None:
        session = store.get(session_id)  # a bad id fails here, before loading the model
        session_id = session.id
        profile = profile or session.profile or None
    controller = ChatController(store, profile)
    interactive = stdin.isatty() and stdout.isatty()
    chat = PlainChat(controller, session_id, stdout, stderr, interactive)
    chat.note(f"loading {controller.profile_spec}…")
    controller.load()
    try:
        if interactive:
            _repl(chat)
        else:
            _pipe(chat, stdin)
    finally:
        if chat.session_id:
            chat.note(f"session {chat.session_id} (continue with: mlxterm chat --session "
                      f"{chat.session_id})")
        threads = threading.enumerate()
        controller.close()
        wait_for_os_exit(threads)  # the engine thread out of the OS before finalizing (app.threads)
    return 0


def _pipe(chat: PlainChat, stdin: TextIO) -> None:
    for line in stdin:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if not chat.handle(text):
            return


def _repl(chat: PlainChat) -> None:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    from app.tui.history import default_path

    keys = KeyBindings()

    @keys.add("escape", "enter")  # Meta+Enter arrives as Esc Enter
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    session = PromptSession(history=FileHistory(str(default_path())), key_bindings=keys,
                            multiline=False, prompt_continuation="… ")
    chat.note("Type a message; /help for commands, Ctrl+D to quit.")
    while True:
        try:
            text = session.prompt("› ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        if not text.strip():
            continue
        try:
            if not chat.handle(text):
                return
        except MlxtermError as e:
            chat.err.write(f"mlxterm: {e}\n")
