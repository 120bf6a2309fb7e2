"""`python -m cgbuild.cli`: the same entry point as the `cgbuild` script."""

import sys

from cgbuild.cli.main import main

sys.exit(main())
