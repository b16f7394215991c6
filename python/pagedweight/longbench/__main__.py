"""`python -m pagedweight.longbench ...` is the same as the `pagedweight-longbench` command."""

import sys

from pagedweight.longbench.cli import main

sys.exit(main())
