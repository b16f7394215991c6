"""`python -m pagedweight ...` is the same as the `pagedweight` command."""

import sys

from pagedweight.cli import main

sys.exit(main())
