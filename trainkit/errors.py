"""One-line errors for bad input: what is wrong and how to fix it, then a non-zero exit."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """Bad input the user can fix. The message is one line: the problem and the fix."""


EXIT_USER_ERROR = 2


def run_main(main: Callable[[], object], prog: str) -> None:
    """Run a job's main(); turn a UserError (also one raised on a Ray worker) into one line + exit 2."""
    try:
        main()
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except Exception as e:  # a worker's UserError arrives wrapped by Ray
        cause = find_user_error(e)
        if cause is None:
            raise
        print(f"{prog}: error: {cause}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)


def find_user_error(exc: BaseException) -> UserError | None:
    """The UserError inside an exception chain, including Ray's wrapped worker errors."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        # Ray Train V2 keeps the workers' exceptions in a dict rank -> exception.
        for inner in (getattr(e, "worker_failures", None) or {}).values():
            stack.append(inner)
        if isinstance(inner := getattr(e, "error", None), BaseException):
            stack.append(inner)
    return None
