"""Load generator for a running supportbot deployment: `python -m tests.load --help`."""
