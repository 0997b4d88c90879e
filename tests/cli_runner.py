"""Run ``eplb`` commands in the test process (click's runner)."""

import os


def invoke(*args, cwd, expect=0):
    """``eplb ARGS`` in this process from ``cwd``, checking the exit code and that nothing but a
    clean exit escaped: ``(stdout, stderr)``."""
    from click.testing import CliRunner

    from eplb.cli import main

    old = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(main, list(args))
    finally:
        os.chdir(old)
    assert result.exit_code == expect, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.stdout, result.stderr
