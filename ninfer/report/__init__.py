"""`ninfer report`: summary tables and plots of a `--request-log-jsonl` campaign file.

campaign reads the file into server runs (events.py: the fields read), summary computes each
run's numbers, markdown and plots present them, command ties them to the CLI.
"""

from ninfer.report.command import run_report

__all__ = ["run_report"]
