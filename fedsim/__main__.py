"""``python -m fedsim``: the command line (part of the composition root)."""
import sys

from fedsim.app.cli import main

sys.exit(main())
