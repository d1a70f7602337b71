"""`python -m distmerge` and `torchrun -m distmerge` both land here."""

import sys

from distmerge.front.cli import main

if __name__ == "__main__":
    sys.exit(main())
