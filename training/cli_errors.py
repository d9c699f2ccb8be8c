"""One rule for every console script (``mixerlab-train``, ``mixerlab-eval``, ``mixerlab-generate``,
``mixerlab-prepare-data``, ``mixerlab-train-tokenizer``, and any later one): a failure is ONE line on stderr,
``<prog>: error: <message>``, that names the argument (or config key, or file), and the exit code says whose
problem it is:

  0    done
  1    a runtime failure (a device, the network, a bug): the message names what failed
  2    a usage or config error: a bad argument, config key, input file or run directory (argparse's own errors
       are 2 too)
  130  interrupted (Ctrl-C)

Set MIXERLAB_TRACEBACK=1 to get the Python traceback instead of the one line.

Use: decorate ``main`` with ``@entry_point("mixerlab-x")`` and wrap the code that reads an argument in
``with naming("--arg"):`` so that a missing file or a bad value inside it is reported with the argument's name.
"""
from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager

OK, RUNTIME_ERROR, USAGE_ERROR, INTERRUPTED = 0, 1, 2, 130
TRACEBACK_ENV = "MIXERLAB_TRACEBACK"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package: <checkout>/mixerlab (its folders
#                                                                    are links) or site-packages/mixerlab
_OWN_DIRS = (_ROOT + os.sep,)  # every subpackage: mixers, pallas_kernels, models, training, eval, interop
_USER_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


class UsageError(ValueError):
    """A bad argument, config key or input; the message names it. Exit code 2."""


@contextmanager
def naming(argument: str):
    """A missing file or a refused value inside the block becomes a UsageError that starts with ``argument``
    (unless its message already names it)."""
    try:
        yield
    except UsageError:
        raise
    except (*_USER_ERRORS, ValueError) as e:
        message = _first_line(e)
        raise UsageError(message if argument in message else f"{argument}: {message}") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= 500 else line[:497] + "..."


def _raised_by_us(e: BaseException) -> bool:
    """True when the innermost frame of the exception is mixerlab's own code (its messages name the input)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_OWN_DIRS)


def exit_code(e: BaseException) -> int:
    """2 for the user's input (UsageError, a missing file, a ValueError raised by mixerlab's checks), else 1."""
    if isinstance(e, (UsageError, *_USER_ERRORS)):
        return USAGE_ERROR
    if isinstance(e, ValueError) and _raised_by_us(e):
        return USAGE_ERROR
    return RUNTIME_ERROR


def describe(e: BaseException) -> str:
    """The one line: our own messages as they are; a library's with its exception type."""
    if isinstance(e, (UsageError, *_USER_ERRORS)) or _raised_by_us(e):
        return _first_line(e)
    return f"{type(e).__name__}: {_first_line(e)}"


def entry_point(prog: str):
    """Decorates a console script's ``main(argv=None) -> int``: the quiet CPU environment first (see
    training/environment.py), then every exception as one line and an exit code (module docstring)."""
    def decorate(main):
        @functools.wraps(main)
        def run(argv=None) -> int:
            from mixerlab.training.environment import quiet_cpu_setup

            quiet_cpu_setup()
            try:
                return main(argv)
            except SystemExit:
                raise
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return INTERRUPTED
            except Exception as e:  # noqa: BLE001 - the point: one line, not a traceback
                if os.environ.get(TRACEBACK_ENV):
                    raise
                code = exit_code(e)
                hint = f" (set {TRACEBACK_ENV}=1 for the traceback)" if code == RUNTIME_ERROR else ""
                print(f"{prog}: error: {describe(e)}{hint}", file=sys.stderr)
                return code

        return run

    return decorate
