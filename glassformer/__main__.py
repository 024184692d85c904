"""python -m glassformer: the same as the `glassformer` command."""

import sys

from glassformer.cli import main

sys.exit(main())
