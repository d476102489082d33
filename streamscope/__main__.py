"""`python -m streamscope`: the `streamscope` command."""

import sys

from .workflows.cli import main

sys.exit(main())
