"""``python -m bench``: run the benchmark (``--smoke`` for a < 60 s check, ``--help``)."""

import sys

from bench.run import main

sys.exit(main())
