"""`python -m cgbuild_rules.mint`: the mint worker (one request on stdin, one result line on
stdout), or, with `--stage NAME DIR`, one of its stage children."""

import sys

from cgbuild_rules.mint.worker import main

sys.exit(main())
