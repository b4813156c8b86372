"""Check script of the `hi` demo card: run hi.py from the workspace and compare what it prints.

Kept next to the card's YAML on purpose: a card's checks read its task folder ($MLXTERM_TASK_DIR)
inside the sandbox, as `mlxterm run` does.
"""

import subprocess
import sys

out = subprocess.run([sys.executable, "hi.py"], capture_output=True, text=True, timeout=30)
if out.returncode != 0 or out.stdout.strip() != "hi":
    sys.exit(f"hi.py printed {out.stdout!r} (exit code {out.returncode}), expected 'hi'\n{out.stderr}")
print("hi.py prints hi")
