"""``python -m inference_lab``: the ``inference-lab`` command (:func:`inference_lab.cli.main`),
for an environment whose console scripts are not on ``PATH``."""

import sys

from inference_lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
