"""The `ralm` command groups, one module each; cli.py puts them together into one app."""
