"""Fetch the default target into models/smollm2-135m-instruct (`make model`): see
kenspec.server.default_model, which `kenspec serve` also uses on first start-up."""

import sys

from kenspec.server.default_model import main

if __name__ == "__main__":
    sys.exit(main())
