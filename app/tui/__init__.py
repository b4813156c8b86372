"""The chat front ends: the Textual TUI (``MlxtermApp``) and the plain prompt-toolkit REPL.

Both talk to the engine and the session store only through ``ChatController``
(``app/tui/controller.py``). Importing this package imports neither Textual nor MLX.
"""
