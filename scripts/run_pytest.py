"""Run the whole test suite; "no tests collected" (pytest exit 5) is a failure."""

from __future__ import annotations

import sys

import pytest

NO_TESTS_COLLECTED = 5


def main() -> int:
    code = int(pytest.main(["tests", *sys.argv[1:]]))
    if code == NO_TESTS_COLLECTED:
        print("error: pytest collected no tests; an empty run is a failure", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
