"""`python -m streamscope`: the `streamscope` command."""

import sys

from .cli import main

sys.exit(main())
