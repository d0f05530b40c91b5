"""`python -m looped_spec.cli`: the `looped-spec` command."""

import sys

from looped_spec.cli import main

sys.exit(main())
