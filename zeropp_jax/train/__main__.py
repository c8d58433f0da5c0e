"""`python -m zeropp_jax.train`: the `zeropp-train` command."""

import sys

from zeropp_jax.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
