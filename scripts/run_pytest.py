"""Run the whole test suite; "no tests collected" (pytest exit 5) is a failure.

The 25 slowest tests are listed at the end (the suite should stay under 15 minutes on 2 cores).
"""

from __future__ import annotations

import sys

import pytest

NO_TESTS_COLLECTED = 5


def main() -> int:
    # The slowest tests, printed at the end: where the suite's 15-minute budget goes.
    code = int(pytest.main(["tests", "--durations=25", *sys.argv[1:]]))
    if code == NO_TESTS_COLLECTED:
        print("error: pytest collected no tests; an empty run is a failure", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
