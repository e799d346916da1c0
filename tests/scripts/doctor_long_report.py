"""A long report written as the doctor writes its report: ``doctor_long_report.py LINES``.

Each line is ``line NNNN`` and 60 ``x``; a reader checks that every line arrived whole.
"""

from __future__ import annotations

import sys

from ringpipe.observe.commands import write_whole_lines

write_whole_lines("".join(f"line {i:04d} {'x' * 60}\n" for i in range(int(sys.argv[1]))))
