"""The CLI's command groups, one module each: `add_commands(sub)` registers a group's subcommands and
their `cmd_*` functions run them (argument parsing and calls into the library, nothing else). `args`
holds the argument types every group shares; `glmkit/cli.py` composes the parser and answers every
failure by the error contract."""
