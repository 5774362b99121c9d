"""``python -m stagetorch demo``: the main job on an embedded default."""

import sys

from .demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
