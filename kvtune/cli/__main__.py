"""`python -m kvtune.cli`: the same as `kvtune`."""
import sys

from . import main

sys.exit(main())
