"""The command line. `specrun --help` and `--version` import every module here (cli/main mounts
all the commands), so what a command needs beyond Typer, Rich and the registry (numpy, llama/,
the engine, the server) is imported inside the command's functions; tests/test_layers.py checks
that --help and --version load none of it."""
