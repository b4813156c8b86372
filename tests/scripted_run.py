"""``python -m tests.scripted_run ARGS...``: ``mlxterm ARGS...`` with a scripted model that writes files.

For tests that need ``mlxterm run`` as a real process (a SIGKILL and ``--resume``) but no real
model. The engine answers a planning turn with ``PLAN`` and a turn that opens a file for it
(``path`` line and fence, ``agents.planned``) with that file's body, slowly (``DELAY_S`` per
token) so a kill lands mid-run. The reply depends only on the prompt, so a resumed process
continues the same script.
"""

from __future__ import annotations

import re
import sys

from engine import runtime
from engine.serving import remote_engine

from agents.scripted import Reply, ScriptedEngine, scripted_profile

FILES = ("index.html", "app.js", "style.css", "notes.md")
# what follows the planning turn's opening ("Plan:\n1. ")
PLAN = "\n".join(f"{n}. {name}: part {n} of the app" for n, name in enumerate(FILES, 1))[3:]
DELAY_S = 0.004
_OPENED = re.compile(r"assistant\n(\S+)\n```\w*\n$")


def body(path: str) -> str:
    return "".join(f"{path} line {i}\n" for i in range(12))


class FileWriter(ScriptedEngine):
    def submit(self, request):
        opened = _OPENED.search(self.tokenizer.decode(request.prompt_ids)[-200:])
        self.replies = [Reply(body(opened.group(1)) + "```\n", delay_s=DELAY_S) if opened else Reply(PLAN)]
        return super().submit(request)


def main() -> int:
    engine = FileWriter([], profile=scripted_profile(edit_format="whole", max_tokens=600))
    runtime.Engine.load = classmethod(lambda cls, profile=None: engine)
    remote_engine.load_engine = lambda profile=None: engine  # what `mlxterm run` loads with
    from app.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
