"""`specrun bench`: the target alone against every speculation mode on a prompt suite.
(Named `benchmark` apart from bench/, the folder of measuring scripts at the repository's root.)

- ``suite``: the prompts (the built-in suite, Spec-Bench's JSON-lines files) and their columns;
- ``run``: the configurations, the engines and the measuring (its docstring: the method);
- ``report``: the summary per configuration and column, the table, JSON and plot.
- ``harness`` and ``llama_ngram``: what the measuring scripts in bench/ share (docs/bench.md).

No Typer here: cli/bench.py parses the options and calls ``run.run_bench`` and the report.
"""
