"""mlxterm's terminal front end: the Textual TUI and the command line."""
