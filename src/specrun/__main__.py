from specrun.cli.main import entry

entry()
