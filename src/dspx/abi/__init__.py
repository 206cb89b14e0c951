"""What host, device and compiler agree on: pure data, no I/O, and no import of
any other part of dspx (an import-linter contract in pyproject.toml holds it)."""
