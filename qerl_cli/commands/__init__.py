"""One module per CLI command: flags -> config dataclass -> library call."""
