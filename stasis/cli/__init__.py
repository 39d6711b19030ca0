"""The `stasis` command line. It talks to the daemon through stasis.client only (and runs
`stasis check` and `stasis daemon` itself); it owns all terminal output: JSON with --json,
rich tables and progress bars on a terminal, one-line errors and exit codes (0 ok, 1 failed,
2 bad usage or unknown id)."""
